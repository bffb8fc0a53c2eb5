"""Padded batches for the jitted steps: a `SchedulerOutput`'s rows as device-ready arrays of a
few compiled shapes (host side, numpy; no device state here).

- rows pad to the smallest of `batch_buckets` that holds them (padding rows: slot `NULL_SLOT`, a
  block-table row of `NULL_PAGE`, start 0 and length 0, greedy sampling);
- prefill tokens to the smallest of `token_buckets` that holds the longest chunk (beyond the
  largest bucket: a multiple of it);
- block tables to a power-of-two width (at least `MIN_TABLE_WIDTH` pages, at most
  `max_pages_per_seq`) that holds the step's longest row: the XLA attention reads every page
  of a row's table, so a pool-wide width would make a short request read the whole pool.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kimi_linear_jax.cache import Batch
from serving.core.allocator import NULL_PAGE, block_table_row
from serving.core.request import Request
from serving.core.sampling import SamplingBatch, SamplingParams
from serving.core.scheduler_output import Placement, SchedulerOutput
from serving.core.state_pool import NULL_SLOT

# Smallest block-table width in pages: few enough widths to compile, small enough to read.
MIN_TABLE_WIDTH = 16


def bucket(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n; past the largest, the next multiple of the largest."""
    for b in buckets:
        if b >= n:
            return b
    top = buckets[-1]
    return -(-n // top) * top


class Buckets:
    """The step shapes of one engine and the padded arrays of a step's rows."""

    def __init__(
        self,
        batch_buckets: Sequence[int],
        token_buckets: Sequence[int],
        *,
        max_pages_per_seq: int,
        num_decode_steps: int,
        vocab_size: int,
    ) -> None:
        if not batch_buckets or not token_buckets:
            raise ValueError("batch_buckets and token_buckets must not be empty")
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.token_buckets = tuple(sorted(token_buckets))
        self.max_pages_per_seq = max_pages_per_seq
        self.num_decode_steps = num_decode_steps
        self.vocab_size = vocab_size

    def rows(self, n: int) -> int:
        return bucket(n, self.batch_buckets)

    def tokens(self, n: int) -> int:
        return bucket(n, self.token_buckets)

    @property
    def min_width(self) -> int:
        """The narrowest block-table width a step takes (that of short rows)."""
        return min(MIN_TABLE_WIDTH, self.max_pages_per_seq)

    def width(self, placements: Sequence[Placement]) -> int:
        """The step's block-table width (see the module docstring)."""
        need = max(len(p.pages) for p in placements)
        width = self.min_width  # a short row's: the width the cost-aware profile compiles
        while width < need:
            width *= 2
        return min(width, self.max_pages_per_seq)

    def num_steps(self, steps: Sequence[int]) -> int:
        """Two compiled step counts only: 1 and the configured fusion depth."""
        return 1 if max(steps) == 1 else self.num_decode_steps

    def decode_program(self, placements: Sequence[Placement], steps: Sequence[int]):
        """What a decode step over these rows compiles to: (batch bucket, block-table width,
        fused steps). A row's results may change with it (XLA picks other kernels and
        reduction orders for other shapes: batch 1 and 2 differ in the last bits on a CPU)."""
        return self.rows(len(placements)), self.width(placements), self.num_steps(steps)

    def same_program_for_any_rows(self, output: SchedulerOutput) -> bool:
        """Whether every nonempty subset of the step's decode rows compiles to the same
        program. Bucket, width and fused steps only grow with the rows, so each row alone
        having the program of all rows suffices."""
        rows = [output.placement[r.request_id] for r in output.decode]
        steps = output.decode_steps
        whole = self.decode_program(rows, steps)
        return all(self.decode_program([p], [n]) == whole for p, n in zip(rows, steps, strict=True))

    def batch(self, placements: Sequence[Placement]) -> tuple[int, Batch]:
        """(bucket size, Batch) of the rows `placements`, padded with null rows."""
        b = self.rows(len(placements))
        width = self.width(placements)
        slots = np.full(b, NULL_SLOT, np.int32)
        table = np.full((b, width), NULL_PAGE, np.int32)
        start = np.zeros(b, np.int32)
        lengths = np.zeros(b, np.int32)
        for i, p in enumerate(placements):
            slots[i] = p.slot
            table[i] = block_table_row(p.pages, width)
            start[i] = p.start
            lengths[i] = p.length
        # numpy, not jax arrays: jit takes numpy arguments in its C++ dispatch, where each
        # jnp.asarray is a Python-level device_put (about 20-80 us apiece, 20 per step).
        return b, Batch(slots, table, start, lengths)

    def sampling(self, requests: Sequence[Request | None], b: int, mode: str):
        """SamplingBatch and penalty inputs for rows `requests` (None: a padding or non-sampling
        row, given greedy params). Counts and prompt masks are [b, V] only in penalized mode."""
        greedy = SamplingParams(temperature=0.0, seed=0)
        params = [r.params if r is not None else greedy for r in requests]
        # The PRNG stream position counts pending tokens (async scheduling) as drawn.
        steps = [len(r.output_token_ids) + r.num_pending if r is not None else 0 for r in requests]
        params += [greedy] * (b - len(params))
        steps += [0] * (b - len(steps))
        sampling = SamplingBatch.from_params(params, steps, b)
        vocab = self.vocab_size if mode == "penalized" else 1
        counts = np.zeros((b, vocab), np.int32)
        prompt_mask = np.zeros((b, vocab), bool)
        if mode == "penalized":
            for i, r in enumerate(requests):
                if r is not None:
                    np.add.at(counts[i], np.asarray(r.output_token_ids, np.int64), 1)
                    prompt_mask[i, r.prompt_token_ids] = True
        return sampling, counts, prompt_mask
