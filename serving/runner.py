"""Model runner: turns a `SchedulerOutput` into padded device batches, runs the jitted steps and
samples on device (one device-to-host transfer of the sampled tokens per step call).

The runner owns the parameters (`nnx.split(model)`) and the cache. Every batch is padded to a
bucket size so that a few compiled shapes serve any step:

- rows to the smallest of `batch_buckets` that holds them (padding rows: slot `NULL_SLOT`, a
  block-table row of `NULL_PAGE`, start 0 and length 0, greedy sampling);
- prefill tokens to the smallest of `token_buckets` that holds the longest chunk (beyond the
  largest bucket: a multiple of it);
- block tables to a fixed width, `max_pages_per_seq`, so their shape never varies.

Prefill chunks and decodes run as two calls (`prefill_step` with `last_only=True`, then
`decode_step` with T = 1). A first chunk (`start == 0`) zeroes its state slot first, since the
slot may hold a previous owner's state.

Sampling: an all-greedy batch is an argmax; otherwise `sampling.sample` with a `SamplingBatch`
(seeded per request and decode step, so a draw does not depend on the batch). When a row asks
for a repetition / presence / frequency penalty, the host builds the output-token counts and
prompt masks [B, V] and `apply_penalties` runs first (greedy rows included, as in vLLM).
Not done yet: logprobs (`sample` computes them; they are not returned).
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi_linear_jax.cache import Batch, init_cache
from kimi_linear_jax.generation import dcp_mesh, shard_cache
from kimi_linear_jax.model import decode_step, prefill_step
from serving.allocator import NULL_PAGE, PageAllocator
from serving.sampling import GREEDY_EPS, SamplingBatch, apply_penalties, sample
from serving.scheduler import Request, SchedulerOutput
from serving.state_pool import NULL_SLOT, StatePool, reset_slots


def bucket(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n; past the largest, the next multiple of the largest."""
    for b in buckets:
        if b >= n:
            return b
    top = buckets[-1]
    return -(-n // top) * top


@functools.partial(jax.jit, donate_argnames=("cache",))
def _reset(cache, slots):
    return cache._replace(kda=reset_slots(cache.kda, slots))


@jax.jit
def _greedy(logits):
    return jnp.argmax(logits.reshape(logits.shape[0], -1), axis=-1).astype(jnp.int32)


@jax.jit
def _sample(logits, sampling: SamplingBatch):
    tokens, _, _ = sample(logits.reshape(logits.shape[0], -1), sampling, num_top_logprobs=1)
    return tokens


@jax.jit
def _sample_penalized(logits, counts, prompt_mask, sampling: SamplingBatch):
    logits = logits.reshape(logits.shape[0], -1).astype(jnp.float32)
    logits = apply_penalties(logits, counts, prompt_mask, sampling)
    tokens, _, _ = sample(logits, sampling, num_top_logprobs=1)
    return tokens


def _has_penalty(request: Request) -> bool:
    p = request.params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


class ModelRunner:
    def __init__(
        self,
        model,
        *,
        num_pages: int,
        page_size: int,
        num_slots: int,
        dcp_size: int = 1,
        max_pages_per_seq: int | None = None,
        batch_buckets: Sequence[int] = (1, 2, 4, 8, 16, 32),
        token_buckets: Sequence[int] = (16, 64, 256),
    ) -> None:
        if not batch_buckets or not token_buckets:
            raise ValueError("batch_buckets and token_buckets must not be empty")
        self.config = model.config
        self.graphdef, self.params = nnx.split(model)
        self.mesh = dcp_mesh(dcp_size)
        self.dcp_size = dcp_size
        self.page_size = page_size
        # An allocator page is a virtual page of page_size * dcp_size tokens (page_size on
        # each rank); the cache holds the virtual page, sharded over its in-page axis.
        self.tokens_per_page = page_size * dcp_size
        self.num_pages = num_pages
        self.num_slots = num_slots
        self.max_pages_per_seq = max_pages_per_seq or (num_pages - 1)
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.token_buckets = tuple(sorted(token_buckets))
        cache = init_cache(
            self.config,
            num_slots=num_slots,
            num_pages=num_pages,
            page_size=self.tokens_per_page,
            dtype=model.dtype,
        )
        self.cache = shard_cache(cache, self.mesh) if self.mesh is not None else cache

    # ---- host-side batch building ----------------------------------------------------------

    def _table(self, allocator: PageAllocator, rid: Hashable) -> np.ndarray:
        return allocator.block_table_row(rid, self.max_pages_per_seq)

    def _batch(self, slots, table, start, lengths) -> Batch:
        return Batch(
            slots=jnp.asarray(slots),
            block_table=jnp.asarray(table),
            start=jnp.asarray(start),
            lengths=jnp.asarray(lengths),
        )

    def _arrays(self, b: int):
        return (
            np.full(b, NULL_SLOT, np.int32),
            np.full((b, self.max_pages_per_seq), NULL_PAGE, np.int32),
            np.zeros(b, np.int32),
            np.zeros(b, np.int32),
        )

    def _sampled(self, logits, requests: Sequence[Request | None], b: int) -> np.ndarray:
        """Tokens [b] on device, then one transfer to host."""
        live = [r for r in requests if r is not None]
        penalized = any(_has_penalty(r) for r in live)
        if not penalized and all(r.params.temperature < GREEDY_EPS for r in live):
            tokens = _greedy(logits)
        else:
            # Rows that do not sample (non-final chunks) are given greedy params.
            greedy = type(live[0].params)(temperature=0.0, seed=0)
            params = [r.params if r is not None else greedy for r in requests]
            steps = [len(r.output_token_ids) if r is not None else 0 for r in requests]
            sampling = SamplingBatch.from_params(params, steps, b)
            if penalized:
                vocab = logits.shape[-1]
                counts = np.zeros((b, vocab), np.int32)
                prompt_mask = np.zeros((b, vocab), bool)
                for i, r in enumerate(requests):
                    if r is not None:
                        np.add.at(counts[i], np.asarray(r.output_token_ids, np.int64), 1)
                        prompt_mask[i, r.prompt_token_ids] = True
                tokens = _sample_penalized(
                    logits, jnp.asarray(counts), jnp.asarray(prompt_mask), sampling
                )
            else:
                tokens = _sample(logits, sampling)
        return np.asarray(jax.device_get(tokens))

    # ---- one step --------------------------------------------------------------------------

    def run(
        self, output: SchedulerOutput, allocator: PageAllocator, state_pool: StatePool
    ) -> dict[Hashable, int]:
        """Run one scheduled step; return the sampled token of each row that samples."""
        sampled: dict[Hashable, int] = {}
        if output.prefill:
            sampled.update(self._prefill(output, allocator, state_pool))
        if output.decode:
            sampled.update(self._decode(output, allocator, state_pool))
        return sampled

    def _prefill(self, output, allocator, state_pool) -> dict[Hashable, int]:
        chunks = output.prefill
        b = bucket(len(chunks), self.batch_buckets)
        t = bucket(max(c.length for c in chunks), self.token_buckets)
        slots, table, start, lengths = self._arrays(b)
        ids = np.zeros((b, t), np.int32)
        fresh = np.full(b, NULL_SLOT, np.int32)
        for i, c in enumerate(chunks):
            rid = c.request.request_id
            slots[i] = state_pool.slot(rid)
            table[i] = self._table(allocator, rid)
            start[i] = c.start
            lengths[i] = c.length
            ids[i, : c.length] = c.token_ids
            if c.is_first:
                fresh[i] = slots[i]
        if fresh.any():
            self.cache = _reset(self.cache, jnp.asarray(fresh))
        has_prefix = any(c.start > 0 for c in chunks)
        logits, self.cache = prefill_step(
            self.graphdef,
            self.params,
            jnp.asarray(ids),
            self.cache,
            self._batch(slots, table, start, lengths),
            has_prefix=has_prefix,
            last_only=True,
            mesh=self.mesh,
        )
        rows = [c.request if c.samples else None for c in chunks]
        rows += [None] * (b - len(rows))
        tokens = self._sampled(logits, rows, b)
        return {c.request.request_id: int(tokens[i]) for i, c in enumerate(chunks) if c.samples}

    def _decode(self, output, allocator, state_pool) -> dict[Hashable, int]:
        requests = output.decode
        b = bucket(len(requests), self.batch_buckets)
        slots, table, start, lengths = self._arrays(b)
        ids = np.zeros((b, 1), np.int32)
        for i, r in enumerate(requests):
            rid = r.request_id
            slots[i] = state_pool.slot(rid)
            table[i] = self._table(allocator, rid)
            start[i] = r.num_computed_tokens
            lengths[i] = 1
            ids[i, 0] = r.all_token_ids[r.num_tokens - 1]
        logits, self.cache = decode_step(
            self.graphdef,
            self.params,
            jnp.asarray(ids),
            self.cache,
            self._batch(slots, table, start, lengths),
            mesh=self.mesh,
        )
        rows: list[Request | None] = list(requests) + [None] * (b - len(requests))
        tokens = self._sampled(logits, rows, b)
        return {r.request_id: int(tokens[i]) for i, r in enumerate(requests)}
