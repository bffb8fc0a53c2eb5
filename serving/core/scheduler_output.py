"""What `Scheduler.schedule` hands the runner for one step: the prefill chunks and decode rows
(`SchedulerOutput`), each row's slot, pages and token range (`Placement`), and the state copies
of prefix caching. Plain data; the runner needs no allocator or pool."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

from serving.core.request import Request
from serving.core.track import TrackPoint


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    """Compute tokens `all_token_ids[start:start + length]` of `request`."""

    request: Request
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def is_first(self) -> bool:
        """The slot is fresh: the runner zeroes its state before this chunk."""
        return self.start == 0

    @property
    def samples(self) -> bool:
        """The chunk completes the prefill, so the step samples the request's next token."""
        return self.end == self.request.num_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_token_ids[self.start : self.end]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one row of a step lives, as the scheduler fixed it: compute `length` tokens from
    position `start` (a decode: 1 token a step) with the recurrent state in state slot `slot`
    and the KV in `pages` (the request's pages in token order; the runner pads them to its
    block-table width with the null page). The runner needs no allocator or pool."""

    slot: int
    pages: tuple[int, ...]
    start: int
    length: int


@dataclasses.dataclass
class SchedulerOutput:
    """One step. Rows are `prefill` chunks then `decode` requests, in that order; `placement`
    maps each row's request id to its slot, pages, start and length.

    A decode computes token `num_tokens - 1` at position `num_computed_tokens` and samples.
    """

    prefill: list[PrefillChunk] = dataclasses.field(default_factory=list)
    decode: list[Request] = dataclasses.field(default_factory=list)
    # Per decode row: fused decode steps to run (pages are allocated for them). All 1 when the
    # step also has prefill chunks: fusion runs only in decode-only steps.
    decode_steps: list[int] = dataclasses.field(default_factory=list)
    # Speculative steps, per decode row: the most drafts it may propose (0: a plain decode).
    max_drafts: list[int] = dataclasses.field(default_factory=list)
    # The decode rows whose drafts are a probe (a resting request drafts once): the next
    # step's drafts depend on what it accepts, not only on its tokens.
    probes: set[Hashable] = dataclasses.field(default_factory=set)
    # The decode rows that rest (their acceptance is below the drafting threshold, so
    # `max_drafts` is 0) -> the drafts their reserved window holds. Under cost-aware widths
    # a resting row drafts after all in a step that runs a window for the others: it rests
    # from paying for a window, and a window paid for costs it nothing more.
    resting: dict[Hashable, int] = dataclasses.field(default_factory=dict)
    placement: dict[Hashable, Placement] = dataclasses.field(default_factory=dict)
    preempted: list[Hashable] = dataclasses.field(default_factory=list)
    # Prefix caching. Before the step: copy checkpoint slot -> request's slot (a hit). After the
    # step: copy request's slot -> checkpoint slot (a donation; `update` inserts the tree node).
    restores: list[tuple[int, Hashable]] = dataclasses.field(default_factory=list)
    snapshots: list[tuple[Hashable, int, int]] = dataclasses.field(default_factory=list)
    # Speculative rows whose window crosses a track point: request id -> (slot, track point).
    track: dict[Hashable, tuple[int, TrackPoint]] = dataclasses.field(default_factory=dict)
    hits: list = dataclasses.field(default_factory=list)
    # Async scheduling: `Scheduler.advance` counted this step's tokens as pending before they
    # reached the host; `update` then appends them without advancing the computed tokens again.
    advanced: bool = False

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.length for c in self.prefill) + len(self.decode)

    @property
    def rows(self) -> list[Request]:
        return [c.request for c in self.prefill] + list(self.decode)

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode

    @property
    def is_plain_decode(self) -> bool:
        """Decodes only, without drafts, state copies or snapshots: the one kind of step whose
        tokens may stay on the device while the next step is scheduled (async scheduling)."""
        copies = self.restores or self.snapshots or self.track
        return bool(self.decode) and not (self.prefill or self.max_drafts or copies)

    @property
    def restore_copies(self) -> list[tuple[int, int]]:
        """(checkpoint slot, request slot) pairs to copy before the step."""
        return [(src, self.placement[rid].slot) for src, rid in self.restores]

    @property
    def snapshot_copies(self) -> list[tuple[int, int]]:
        """(request slot, checkpoint slot) pairs to copy after the step."""
        return [(self.placement[rid].slot, dst) for rid, dst, _ in self.snapshots]
