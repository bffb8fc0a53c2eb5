"""Model runner: turns a `SchedulerOutput` into padded device batches, runs the jitted steps and
samples on device (one device-to-host transfer of the sampled tokens per step call).

The runner owns the device state (`DeviceState`: the parameters as a flat list of arrays, and
the cache). Every batch is padded to a bucket size (`Buckets`, serving/core/buckets.py) so that a
few compiled shapes serve any step. It reads only the `SchedulerOutput` (rows, placements,
copies), never the scheduler's or the allocator's state.

Prefill chunks and decodes run as two calls (`prefill_step` with `last_only=True`, then the
decode scan). A first chunk (`start == 0`) zeroes its state slot first, since the slot may hold
a previous owner's state.

Decode is `num_decode_steps` steps fused in one `lax.scan` (`decode.decode_steps`, each step
feeds back the token it picked) when the scheduler asks for more than one
(`SchedulerOutput.decode_steps`, decode-only steps), else one step.

Async scheduling: `dispatch_decode` returns an `InFlight` step without fetching its tokens and
`collect` fetches them later. A row whose input token is still on the device (sampled by the
step dispatched before, not collected yet: `Request.num_pending > 0`) reads it from that step's
output (`_next_ids`), so a decode batch can be built before the host knows its tokens. The
model step itself is the same compiled call either way.

Speculative decoding (an engine with a drafter): decode rows become verify windows, or plain
steps where no row drafts (`speculative/steps.py`: the runner's `Verifier`, on the same state).

A prefill step with a row that asks for prompt logprobs keeps every position's logits and
takes their logprobs on device (`serving/core/prompt_logprobs.py`).

Sampling runs on device in one of three static modes (`decode.MODES`): an all-greedy batch is an
argmax; otherwise `sampling.sample` with a `SamplingBatch` seeded per request and decode step,
so a draw depends neither on the batch nor on fusion. Rows with a repetition / presence /
frequency penalty bring output-token counts and prompt masks [B, V] from the host; inside a
fused scan the counts advance on device. Logprobs (the sampled token and the top
`params.logprobs`) come back only for the rows that ask.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kimi_linear_jax.cache import CacheLayout
from kimi_linear_jax.model import prefill_step, split_flat
from kimi_linear_jax.parallel.rules import layout_cache
from serving.core.buckets import Buckets
from serving.core.decode import decode_steps, pick_jit
from serving.core.device_state import DeviceState
from serving.core.prompt_logprobs import entries, prompt_logprobs_step, targets
from serving.core.request import Request
from serving.core.scheduler_output import SchedulerOutput
from serving.core.state_pool import NULL_SLOT, copy_slots, reset_cache_slots
from serving.core.step_result import InFlight, Sample, StepResult, host_samples, sample_mode
from serving.speculative.steps import Verifier


@jax.jit
def _next_ids(prev_tokens, host_ids, src):
    """Decode inputs [B]: the host's token where src < 0, else the in-flight step's pick at
    flat index src of its tokens [B', S'] (the token it sampled last for that request)."""
    flat = prev_tokens.reshape(-1)
    return jnp.where(src >= 0, flat[jnp.maximum(src, 0)], host_ids)


class ModelRunner:
    """Device state and the jitted steps: prefill, decode (fused, or dispatched ahead for
    async scheduling) and, with a drafter, the verify (`self.verifier`)."""

    def __init__(
        self,
        model,
        *,
        layout: CacheLayout,
        max_pages_per_seq: int | None = None,
        batch_buckets: Sequence[int] = (1, 2, 4, 8, 16, 32),
        token_buckets: Sequence[int] = (16, 64, 256),
        num_decode_steps: int = 1,
        drafter=None,
        num_draft_tokens: int = 0,
        widths=None,
        topk: int = 1,
    ) -> None:
        if num_decode_steps < 1:
            raise ValueError(f"num_decode_steps must be >= 1, got {num_decode_steps}")
        # The model is built for its mesh (model.par); the caches follow its sharding rules.
        # An allocator page is a virtual page of page_size * dcp tokens (page_size on each
        # DCP rank); the cache holds the virtual page, sharded over its in-page axis.
        if layout.dcp_size != model.par.dcp:
            raise ValueError(f"layout dcp_size {layout.dcp_size} != model's {model.par.dcp}")
        self.config = model.config
        self.layout = layout
        self.buckets = Buckets(
            batch_buckets,
            token_buckets,
            max_pages_per_seq=max_pages_per_seq or (layout.num_pages - 1),
            num_decode_steps=num_decode_steps,
            vocab_size=model.config.vocab_size,
        )
        self._new_cache = functools.partial(layout_cache, model, layout)
        self.state = DeviceState(*split_flat(model), self._new_cache())
        self.drafter = drafter
        # Speculative decoding: decode rows become verify windows; the recurrent commit is
        # decided once, from the model's declared capability.
        self.verifier = None
        if drafter is not None:
            self.verifier = Verifier(
                self.state,
                self.buckets,
                drafter,
                num_draft_tokens=num_draft_tokens,
                commit_recurrent=model.has_recurrent_state,
                plain=self._plain_samples,
                widths=widths,
                topk=topk,
            )

    # The state's parts, by the names the steps' callers and the tests use.
    graphdef = property(lambda self: self.state.graphdef)
    params = property(lambda self: self.state.params)
    cache = property(
        lambda self: self.state.cache, lambda self, value: setattr(self.state, "cache", value)
    )

    @property
    def widths(self):
        """The cost-aware width policy (`speculative/widths.py`), or None."""
        return None if self.verifier is None else self.verifier.widths

    @property
    def spec_counts(self) -> dict:
        return self.verifier.counts

    def same_program_for_any_rows(self, output: SchedulerOutput) -> bool:
        return self.buckets.same_program_for_any_rows(output)

    def caches_lost(self) -> bool:
        """Whether a failed call consumed a donated cache (its buffers are deleted)."""
        caches = [self.cache, getattr(self.drafter, "cache", None)]
        return any(x.is_deleted() for x in jax.tree.leaves(caches))

    def reset_caches(self) -> None:
        """Fresh zeroed caches (the target's and the drafter's): every slot and page is empty."""
        self.cache = self._new_cache()
        if self.drafter is not None:
            self.drafter.reset()

    # ---- one step --------------------------------------------------------------------------

    def run(self, output: SchedulerOutput) -> StepResult:
        """Run one scheduled step from `output` alone: the samples of each row that samples
        (one for a prefill's last chunk, up to `output.decode_steps[i]` for a decode), the
        drafts each verify row proposed and the prompt logprobs of the prefill rows that ask."""
        result = StepResult({}, {}, {}, {})
        # Prefix-cache hits: the checkpoint is copied into the request's slot before its chunk.
        self._copy(output.restore_copies)
        if output.prefill:
            self._prefill(output, result)
        if output.decode and self.verifier is not None:
            self.verifier.run(output, result)
        elif output.decode:
            result.samples.update(self._decode(output))
        # Donations: the request's slot now holds the state at the snapshot depth.
        self._copy(output.snapshot_copies)
        return result

    def _copy(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        width = self.buckets.batch_buckets[-1]
        self.cache = copy_slots(self.cache, pairs, width)
        if self.drafter is not None:
            self.drafter.copy_slots(pairs, width)

    def _prefill(self, output: SchedulerOutput, result: StepResult) -> None:
        chunks = output.prefill
        placements = [output.placement[c.request.request_id] for c in chunks]
        b, batch = self.buckets.batch(placements)
        t = self.buckets.tokens(max(c.length for c in chunks))
        ids = np.zeros((b, t), np.int32)
        fresh = np.full(b, NULL_SLOT, np.int32)
        for i, (c, p) in enumerate(zip(chunks, placements, strict=True)):
            ids[i, : c.length] = c.token_ids
            if c.is_first:
                fresh[i] = p.slot
        if fresh.any():
            self.cache = reset_cache_slots(self.cache, fresh)
        has_prefix = any(c.start > 0 for c in chunks)
        next_ids = targets(chunks, b, t)
        logits, self.cache = prefill_step(
            self.graphdef,
            self.params,
            ids,
            self.cache,
            batch,
            has_prefix=has_prefix,
            last_only=next_ids is None,
        )
        if self.drafter is not None:
            self.drafter.prefill(ids, batch, fresh, has_prefix)
        prompt = ()
        if next_ids is not None:
            logits, prompt = prompt_logprobs_step(logits, next_ids, batch.lengths)
        self._prefill_samples(chunks, b, logits, prompt, result)

    def _prefill_samples(self, chunks, b: int, logits, prompt, result: StepResult) -> None:
        """Sample the rows whose prefill ends here; fetch their picks and the prompt logprobs
        `prompt` (device arrays, or () when no row asks) in one transfer."""
        rows = [c.request if c.samples else None for c in chunks]
        live = [r for r in rows if r is not None]
        mode = sample_mode(live) if live else "greedy"
        picked = ()
        if live:
            picked = pick_jit(logits, *self.buckets.sampling(rows, b, mode), mode=mode)
            picked = tuple(x[:, None] for x in picked)
        picked, prompt = jax.device_get((picked, prompt))  # one transfer
        if live:
            samples = host_samples(picked, rows, mode)
            result.samples.update(zip((r.request_id for r in live), samples, strict=True))
        if prompt:
            result.prompt_logprobs.update(entries(prompt, chunks))

    def _decode(self, output: SchedulerOutput) -> dict[Hashable, list[Sample]]:
        return self.collect(self.dispatch_decode(output)).samples

    def _plain_samples(self, output: SchedulerOutput, steps: list[int]):
        """A decode of `output`'s rows with `steps` each (the verifier's draftless step)."""
        return self.collect(self.dispatch_decode(output, steps=steps)).samples

    def dispatch_decode(
        self, output: SchedulerOutput, prev: InFlight | None = None, steps: list[int] | None = None
    ) -> InFlight:
        """Dispatch a decode step without waiting for its tokens. A row whose last token is
        still pending (`num_pending`, async scheduling) reads it on the device from `prev`,
        the step that sampled it (dispatched before, so it has run by then). `steps`: each
        row's fused steps, `output.decode_steps` unless given."""
        requests = output.decode
        steps = output.decode_steps if steps is None else steps
        b, batch = self.buckets.batch([output.placement[r.request_id] for r in requests])
        ids = np.zeros(b, np.int32)
        steps_left = np.zeros(b, np.int32)
        for i, r in enumerate(requests):
            if r.num_pending == 0:
                ids[i] = r.all_token_ids[r.num_tokens - 1]
            steps_left[i] = steps[i]
        num_steps = self.buckets.num_steps(steps)
        mode = sample_mode(requests)
        rows: list[Request | None] = list(requests)
        picked, _, self.cache = decode_steps(
            self.graphdef,
            self.params,
            self._ids(requests, ids, prev),
            self.cache,
            batch,
            steps_left,
            *self.buckets.sampling(rows, b, mode),
            num_steps=num_steps,
            mode=mode,
        )
        return InFlight(output, picked, mode)

    def _ids(self, requests: Sequence[Request], host_ids: np.ndarray, prev: InFlight | None):
        """The step's input tokens: the host's, or for pending rows `prev`'s picks."""
        pending = [i for i, r in enumerate(requests) if r.num_pending]
        if not pending:
            return host_ids
        if prev is None:
            raise ValueError("pending tokens need the step that sampled them")
        prev_tokens = prev.picked[0]
        width = prev_tokens.shape[1]
        where = {r.request_id: j for j, r in enumerate(prev.output.decode)}
        src = np.full(len(host_ids), -1, np.int32)
        for i in pending:
            j = where[requests[i].request_id]
            src[i] = j * width + prev.output.decode_steps[j] - 1
        return _next_ids(prev_tokens, host_ids, src)

    def collect(self, flight: InFlight) -> StepResult:
        """Wait for a dispatched decode step's picks (one transfer): each row's samples."""
        output = flight.output
        rows: list[Request | None] = list(output.decode)
        samples = host_samples(jax.device_get(flight.picked), rows, flight.mode)
        by_row = {
            r.request_id: row[: output.decode_steps[i]]
            for i, (r, row) in enumerate(zip(output.decode, samples, strict=True))
        }
        return StepResult(by_row, {}, {}, {})
