"""Continuous batching with chunked prefill and preemption (host, plain Python; no JAX here).

Every step computes, for each scheduled request, the tokens `[num_computed_tokens, +length)` of
`all_token_ids` and writes their KV and recurrent state. A step whose computed range reaches
`num_tokens` ends with the request's next token sampled: a decode is a range of length 1, the
last chunk of a prefill samples the first output token.

Per step, under the token budget `max_num_batched_tokens`:

1. running decodes, oldest first, one token each;
2. running requests still in prefill, oldest first, a chunk of at most `chunk_size` tokens;
3. WAITING / PREEMPTED requests admitted in arrival order (first come, first served: admission
   stops at the first request that does not fit) while a state slot, `max_num_seqs`, pages for
   its first chunk and budget remain.

Preemption policy: recompute. A chunk first shrinks to the tokens that its own pages and the
free pages can hold. When not even one token fits, the most recently arrived running request
that is not yet scheduled this step (possibly the one asking) is preempted: its pages are freed,
its state slot is released, `num_computed_tokens` goes back to 0 and it waits again in arrival
order. Its tokens (prompt and outputs so far) are kept, and on re-admission prompt + outputs
are prefilled again from scratch into a fresh slot. Nothing of the
recurrent state is saved, so a stale or wrong slot cannot be restored: always correct, at the
cost of recomputation. The runner must zero a request's slot (`reset_slots`) for a chunk whose
`start` is 0 (`PrefillChunk.is_first`), since the slot may hold a previous owner's state.

Pages: a step needs pages for the tokens it computes (`start + length`); the token sampled at
the end of a step gets its KV in the next step.

Async scheduling: `advance` marks a dispatched plain decode step's tokens as pending (counted
as computed and as sequence tokens, not appended), so the next step can be scheduled before
they arrive, when `can_schedule_ahead` says that step is the one synchronous scheduling would
make; `update` appends them later and drops those of a request that finished meanwhile.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from serving.prefix_cache import branching_depth, checkpoint_depth
from serving.request import Request, RequestStatus
from serving.speculative.track import TrackPoint, can_track, track_point

if TYPE_CHECKING:  # both modules import JAX; the scheduler only needs their host methods
    from serving.allocator import PageAllocator
    from serving.prefix_cache import Hit, PrefixCache
    from serving.state_pool import StatePool


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


class Scheduler:
    """Decides which requests run each step and owns their pages and state slots."""

    def __init__(
        self,
        allocator: PageAllocator,
        state_pool: StatePool,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        chunk_size: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        num_decode_steps: int = 1,
        speculative: bool = False,
        spec_min_acceptance: float = 0.0,
        spec_probe_interval: int = 16,
        prefix_cache: PrefixCache | None = None,
        track_interval: int | None = None,
    ) -> None:
        for name, value in (
            ("num_decode_steps", num_decode_steps),
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("chunk_size", chunk_size),
            ("max_model_len", max_model_len),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.allocator = allocator
        self.state_pool = state_pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunk_size = chunk_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.num_decode_steps = num_decode_steps
        # Speculative: decode_steps is each row's verify window (1 + drafts), reserved before
        # the verify; what was not accepted is released after it (`update`).
        self.speculative = speculative
        # Adaptive speculation: a request whose recent acceptance (an EMA) is below this stops
        # proposing (its window is one token) except one probe every `spec_probe_interval`
        # verifies. A verify window costs several decode steps on a CPU, so drafts that keep
        # failing are a loss. 0 turns it off.
        self.spec_min_acceptance = spec_min_acceptance
        self.spec_probe_interval = spec_probe_interval
        self.prefix_cache = prefix_cache
        self.track_interval = track_interval if prefix_cache is not None else None
        self.requests: dict[Hashable, Request] = {}  # every unfinished request
        self.waiting: list[Request] = []  # WAITING and PREEMPTED, by arrival
        self.running: list[Request] = []  # RUNNING, by arrival
        self._arrivals = 0
        self._in_flight = False  # schedule() was called and update() not yet
        self._scheduled_ids: set[Hashable] = set()  # requests in the step being built
        self._preempted_now: list[Hashable] = []  # ids preempted while building it

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- admission and abort -------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a new request; raises ValueError for one that could never run."""
        self._validate(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.finish_reason = None
        request.arrival = self._arrivals
        self._arrivals += 1
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _validate(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        prompt_len = len(request.prompt_token_ids)
        if prompt_len == 0:
            raise ValueError(f"request {rid!r}: prompt is empty")
        if request.output_token_ids:
            raise ValueError(f"request {rid!r}: output_token_ids must start empty")
        max_tokens = request.params.max_tokens
        if max_tokens < 1:
            raise ValueError(f"request {rid!r}: max_tokens must be >= 1, got {max_tokens}")
        if prompt_len + max_tokens > self.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt length {prompt_len} + max_tokens {max_tokens} "
                f"exceeds max_model_len {self.max_model_len}"
            )
        # The last sampled token is never computed, so the KV peak is prompt + max_tokens - 1.
        need = self.allocator.pages_for(prompt_len + max_tokens - 1)
        if need > self.allocator.capacity:
            raise ValueError(
                f"request {rid!r} needs {need} pages (prompt {prompt_len} + max_tokens "
                f"{max_tokens}) but the page pool holds only {self.allocator.capacity}"
            )

    def abort(self, request_id: Hashable, reason: str = "abort") -> Request | None:
        """Finish the request (pages and slot freed) with `reason`; None if unknown or already
        finished."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, reason)
        return request

    # ---- scheduling ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self._in_flight:
            raise RuntimeError("schedule() called twice without update()")
        out = SchedulerOutput()
        self._scheduled_ids = set()
        self._preempted_now = out.preempted
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget, decodes=True)
        budget = self._schedule_running(out, budget, decodes=False)
        self._admit(out, budget)
        if out.prefill and not self.speculative:
            out.decode_steps = [1] * len(out.decode)
        self._place(out)
        self._in_flight = not out.is_empty
        return out

    # ---- async scheduling ------------------------------------------------------------------

    def advance(self, output: SchedulerOutput) -> None:
        """`output`'s step is dispatched and its tokens stay on the device for now: its rows
        count them as computed and pending, so that the next step can be scheduled before
        they arrive (`update(output, ...)` appends them then). Plain decode steps only."""
        if not output.is_plain_decode:
            raise ValueError("only a plain decode step can run ahead of its tokens")
        for request, steps in zip(output.decode, output.decode_steps, strict=True):
            request.num_computed_tokens += steps
            request.num_pending += steps
        output.advanced = True
        self._in_flight = False

    def can_schedule_ahead(self) -> bool:
        """Whether the next step may be scheduled while pending tokens are unknown: only when
        it is the step synchronous scheduling would make once they arrive, plus rows that they
        finish (an EOS, a stop token or string, whose extra token is then dropped). So: nothing
        waits (a finish could admit it), every running request decodes without drafts or
        penalties (their counts need the tokens), all fit the budget and the free pages (no
        eviction, no preemption), and no row ends on a track point (its snapshot waits for a
        state that has no extra token in it)."""
        if self.speculative or self.waiting or len(self.running) > self.max_num_batched_tokens:
            return False
        missing, rows = 0, 0
        for request in self.running:
            if request.num_uncomputed != 1 or request.params.has_penalty:
                return False
            steps = self._decode_want(request)
            if steps == 0:
                continue  # it ends (max_tokens) when its pending tokens arrive
            end = request.num_computed_tokens + steps
            if self.track_interval is not None and end % self.track_interval == 0:
                return False
            owned = len(self.allocator.pages(request.request_id))
            missing += max(0, self.allocator.pages_for(end) - owned)
            rows += 1
        return rows > 0 and missing <= self.allocator.num_free

    def drop_finished(self, output: SchedulerOutput) -> None:
        """Remove the decode rows of requests that ended since `output` was scheduled ahead
        (the tokens then in flight finished them, or an abort): what remains is the step
        synchronous scheduling makes now (the same rows, steps and pages)."""
        keep = [i for i, r in enumerate(output.decode) if not r.is_finished]
        output.decode = [output.decode[i] for i in keep]
        output.decode_steps = [output.decode_steps[i] for i in keep]
        output.placement = {r.request_id: output.placement[r.request_id] for r in output.decode}

    # ---- placement -----------------------------------------------------------------------

    def _place(self, out: SchedulerOutput) -> None:
        """Fix each row's slot and pages once every row is scheduled (no row of a step loses
        or gains pages after its own scheduling, but reading them last says so plainly)."""
        rows = [(c.request, c.start, c.length) for c in out.prefill]
        rows += [(r, r.num_computed_tokens, 1) for r in out.decode]
        for request, start, length in rows:
            rid = request.request_id
            pages = tuple(self.allocator.pages(rid))
            out.placement[rid] = Placement(self.state_pool.slot(rid), pages, start, length)

    def _schedule_running(self, out: SchedulerOutput, budget: int, *, decodes: bool) -> int:
        for request in list(self.running):
            if budget == 0:
                break
            rid = request.request_id
            if request.status is not RequestStatus.RUNNING or rid in self._scheduled_ids:
                continue  # preempted earlier in this pass
            if (request.num_uncomputed == 1) != decodes:
                continue
            if decodes:
                want = self._decode_want(request)
                if want == 0:
                    continue  # its pending tokens reach max_tokens: it ends when they arrive
            else:
                want = min(request.num_uncomputed, self.chunk_size, budget)
                want = self._cut_at_donation(request, want)
            length = self._grow(request, want)
            if length == 0:
                continue  # it preempted itself
            self._scheduled_ids.add(rid)
            if decodes:
                budget -= 1  # the budget counts rows of work, not the fused lookahead
                out.decode.append(request)
                out.decode_steps.append(length)
                if self.speculative:
                    out.max_drafts.append(self._max_drafts(request, length - 1))
                self._plan_track(out, request, length)
            else:
                budget -= length
                out.prefill.append(PrefillChunk(request, request.num_computed_tokens, length))
                self._plan_donation(out, request, request.num_computed_tokens + length)
        return budget

    def _decode_want(self, request: Request) -> int:
        """Decode steps the request asks for: fused steps need KV room for each step and
        never pass max_tokens (pending tokens count: 0 when they reach it)."""
        remaining = request.params.max_tokens - len(request.output_token_ids)
        remaining -= request.num_pending
        if remaining <= 0:
            return 0
        return self._cut_at_track(request, min(self.num_decode_steps, remaining))

    def _grow(self, request: Request, length: int) -> int:
        """Pages for `length` more tokens (shrunk to what fits, preempting if none); 0 if the
        request had to preempt itself."""
        rid = request.request_id
        start = request.num_computed_tokens
        self._make_room(rid, start + length)
        while True:
            fit = self._fit(request)
            if fit >= 1:
                length = min(length, fit)
                self.allocator.allocate(rid, start + length)
                return length
            victim = self._victim()
            self._preempt(victim)
            if victim is request:
                return 0

    def _make_room(self, request_id: Hashable, num_tokens: int) -> None:
        """Evict unlocked prefix-tree pages so the request's pages can hold num_tokens."""
        if self.prefix_cache is None:
            return
        have = len(self.allocator.pages(request_id)) if self._holds_pages(request_id) else 0
        missing = self.allocator.pages_for(num_tokens) - have - self.allocator.num_free
        if missing > 0:
            self.prefix_cache.evict_pages(missing)

    def _holds_pages(self, request_id: Hashable) -> bool:
        try:
            self.allocator.pages(request_id)
        except KeyError:
            return False
        return True

    def _fit(self, request: Request) -> int:
        """Most new tokens the request's pages plus the free pages can hold."""
        owned = len(self.allocator.pages(request.request_id))
        room = (owned + self.allocator.num_free) * self.allocator.tokens_per_page
        return room - request.num_computed_tokens

    def _victim(self) -> Request:
        """The most recently arrived running request not scheduled this step.

        Running requests are visited oldest first, so the one asking for pages is itself a
        candidate and no request already in this step's batch is ever chosen.
        """
        for request in reversed(self.running):
            if request.request_id not in self._scheduled_ids:
                return request
        raise AssertionError("no preemptible request")  # the asker is always a candidate

    def _preempt(self, request: Request) -> None:
        """Recompute policy: drop pages and slot, keep the tokens, re-prefill from scratch."""
        rid = request.request_id
        self._release_pages(rid)
        self.state_pool.release(rid)
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        bisect.insort(self.waiting, request, key=lambda r: r.arrival)
        self._preempted_now.append(rid)

    def _release_pages(self, request_id: Hashable) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.release(request_id)  # unlock borrowed tree pages first
        self.allocator.free(request_id)

    # ---- prefix caching hooks --------------------------------------------------------------

    def _cut_at_donation(self, request: Request, length: int) -> int:
        """End the chunk at the next donation depth, so the slot holds the state there."""
        start = request.num_computed_tokens
        for depth in request.donate_depths:
            if start < depth < start + length:
                return depth - start
        return length

    def _plan_donation(self, out: SchedulerOutput, request: Request, end: int) -> None:
        if self.prefix_cache is None or end not in request.donate_depths:
            return
        slot = self.prefix_cache.acquire_slot()
        if slot is not None:
            out.snapshots.append((request.request_id, slot, end))

    def _cut_at_track(self, request: Request, steps: int) -> int:
        """Plain decode: end the fused steps on a track point (the state there is then in the
        slot after the step). Speculative windows track inside the verify instead."""
        interval = self.track_interval
        if interval is None or self.speculative:
            return steps
        start = request.num_computed_tokens
        point = (start // interval + 1) * interval
        return min(steps, point - start)

    def _plan_track(self, out: SchedulerOutput, request: Request, steps: int) -> None:
        interval = self.track_interval
        if interval is None:
            return
        start = request.num_computed_tokens
        if not self.speculative:
            if (start + steps) % interval == 0:
                self._plan_donation_at(out, request, start + steps)
            return
        tp = track_point(start, start + steps, interval)
        if tp.to_track:
            slot = self.prefix_cache.acquire_slot()
            if slot is not None:
                out.track[request.request_id] = (slot, tp)

    def _plan_donation_at(self, out: SchedulerOutput, request: Request, depth: int) -> None:
        slot = self.prefix_cache.acquire_slot()
        if slot is not None:
            out.snapshots.append((request.request_id, slot, depth))

    def _lookup(self, request: Request) -> Hit | None:
        """A prefix hit for a request about to start from token 0 (None: no cache, a miss, or
        a request that asks for prompt logprobs)."""
        cache = self.prefix_cache
        if cache is None:
            return None
        n = request.num_tokens
        if request.params.prompt_logprobs is not None:
            # A hit's skipped positions would have no logits, so no prompt logprobs (vLLM's
            # rule too). The prefill still donates its state, as after a miss.
            depth = checkpoint_depth(0, n, cache.state_chunk, cache.tree_page)
            request.donate_depths = (depth,) if depth else ()
            return None
        hit = cache.lookup(request.all_token_ids)
        depths = {checkpoint_depth(hit.depth, n - hit.depth, cache.state_chunk, cache.tree_page)}
        if hit.kv_depth > hit.depth:
            depths.add(branching_depth(hit.kv_depth, cache.state_chunk, cache.tree_page))
        request.donate_depths = tuple(sorted(d for d in depths if d and d > hit.depth))
        return hit if hit.depth > 0 else None

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0:
            if len(self.running) >= self.max_num_seqs or self.state_pool.num_free == 0:
                return
            request = self.waiting[0]
            if not self._admit_one(out, request, budget):
                return  # first come, first served: nobody overtakes the head
            budget -= out.prefill[-1].length

    def _admit_one(self, out: SchedulerOutput, request: Request, budget: int) -> bool:
        rid = request.request_id
        hit = self._lookup(request)
        start = hit.depth if hit else 0
        request.num_computed_tokens = start
        length = self._cut_at_donation(
            request, min(request.num_tokens - start, self.chunk_size, budget)
        )
        if hit:
            self.prefix_cache.borrow(rid, hit)
        self._make_room(rid, start + length)
        if not self.allocator.can_allocate(rid, start + length):
            if hit:
                self.prefix_cache.release(rid)
                self.allocator.free(rid)
                self.prefix_cache.end_step([hit])
            request.num_computed_tokens = 0
            return False
        self.waiting.pop(0)
        self.allocator.allocate(rid, start + length)
        self.state_pool.acquire(rid)
        if hit:
            out.restores.append((hit.checkpoint, rid))
            out.hits.append(hit)
        request.num_cached_tokens = start
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=lambda r: r.arrival)
        out.prefill.append(PrefillChunk(request, start, length))
        self._plan_donation(out, request, start + length)
        return True

    # ---- after a step --------------------------------------------------------------------

    def update(
        self,
        output: SchedulerOutput,
        sampled: Mapping[Hashable, int | Sequence[int]] | Sequence[int | None],
        num_drafts: Mapping[Hashable, int] | None = None,
    ) -> list[Request]:
        """Advance the step's requests and append their sampled tokens; return those finished.

        `sampled` maps request id -> token (or the tokens of fused decode steps, in order), or
        is one entry per row of `output.rows` (entries of rows that do not sample are ignored).
        Tokens after one that finishes the request are dropped. Requests aborted mid-step are
        skipped. `num_drafts`: the drafts each verify row proposed (its tokens are the accepted
        ones plus one), for the adaptive speculation.
        """
        self._in_flight = False
        if not isinstance(sampled, Mapping):
            rows = output.rows
            if len(sampled) != len(rows):
                raise ValueError(f"{len(sampled)} sampled entries for {len(rows)} rows")
            sampled = {r.request_id: t for r, t in zip(rows, sampled, strict=True)}
        self._record_acceptance(output, sampled, num_drafts or {})
        self._donate(output, sampled)
        if output.advanced:
            return self._append_pending(output, sampled)
        finished: list[Request] = []
        steps = [(c.request, c.end, c.samples) for c in output.prefill]
        steps += [(r, r.num_tokens, True) for r in output.decode]
        for request, end, samples in steps:
            if request.is_finished:
                continue
            request.num_computed_tokens = end
            if samples and self._append_all(request, sampled.get(request.request_id)):
                finished.append(request)
        for request in output.decode:
            if not request.is_finished:
                # Unaccepted window slots: keep pages for the tokens so far (the last one's KV
                # comes next step). Aligned to the allocator page, so the final free never
                # meets a page twice.
                self.allocator.release_tail(request.request_id, request.num_tokens)
        return finished

    def _append_pending(self, output: SchedulerOutput, sampled) -> list[Request]:
        """`update` of an advanced step: its tokens arrive. `advance` already counted them as
        computed, and a later step may already be in flight for the same rows. A row that
        finished meanwhile (an abort, or a stop in the previous step's tokens) drops them."""
        finished: list[Request] = []
        for request, steps in zip(output.decode, output.decode_steps, strict=True):
            if request.is_finished:
                continue
            request.num_pending -= steps
            if self._append_all(request, sampled.get(request.request_id), advanced=True):
                finished.append(request)
        return finished

    def stop(self, request: Request, num_output_tokens: int, reason: str = "stop") -> None:
        """End `request` after its first `num_output_tokens` outputs (a stop string found on
        the host): later tokens are dropped, pages and slot freed. A request that finished in
        this step for another reason (its length, a stop token) takes this reason instead."""
        del request.output_token_ids[num_output_tokens:]
        if request.is_finished:
            request.finish_reason = reason
        else:
            self._finish(request, reason)

    def fail_step(self, output: SchedulerOutput) -> list[Request]:
        """The step of `output` raised before `update` finished: end it. Every request of the
        step finishes with reason "error" (pages and slot freed), the checkpoint slots it
        reserved go back, and the next `schedule` may run. Returns the requests it ended."""
        self._in_flight = False
        cache = self.prefix_cache
        if cache is not None:
            for _, slot, _ in output.snapshots:
                cache.release_slot(slot)
            for slot, _ in output.track.values():
                cache.release_slot(slot)
            cache.end_step(output.hits)
        failed = []
        for request in output.rows:
            if not request.is_finished:
                self._finish(request, "error")
                failed.append(request)
        return failed

    def _donate(self, output: SchedulerOutput, sampled) -> None:
        """Insert the step's snapshots into the tree (before any request of the step finishes
        and frees its pages). A verify's track snapshot counts only if its step was accepted."""
        cache = self.prefix_cache
        if cache is None:
            return

        # The step's sampled tokens are not appended yet; a fused decode's snapshot depth or a
        # window's track point may lie among them.
        def sequence(rid, request):
            new = sampled.get(rid)
            return request.all_token_ids + (list(new) if isinstance(new, Sequence) else [new])

        for rid, slot, depth in output.snapshots:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                cache.release_slot(slot)
            else:
                cache.insert(rid, sequence(rid, request)[:depth], slot)
        for rid, (slot, tp) in output.track.items():
            request = self.requests.get(rid)
            new = sampled.get(rid)
            commit_lens = len(new) if isinstance(new, Sequence) else 0
            if request is None or request.is_finished or not can_track(tp, commit_lens):
                cache.release_slot(slot)
            else:
                cache.insert(rid, sequence(rid, request)[: tp.point], slot)
        cache.end_step(output.hits)

    # ---- speculation ---------------------------------------------------------------------

    def _max_drafts(self, request: Request, room: int) -> int:
        # Penalised rows do not speculate: their counts would change inside the window.
        if room <= 0 or request.params.has_penalty:
            return 0
        if request.spec_acceptance >= self.spec_min_acceptance:
            return room
        request.spec_skipped += 1
        return room if request.spec_skipped % self.spec_probe_interval == 0 else 0

    def _record_acceptance(self, output: SchedulerOutput, sampled, num_drafts) -> None:
        """Each verify row's accepted share of its drafts into its acceptance EMA."""
        for request in output.decode:
            n = num_drafts.get(request.request_id, 0)
            if n > 0:
                rate = (len(sampled[request.request_id]) - 1) / n
                request.spec_acceptance = 0.7 * request.spec_acceptance + 0.3 * rate

    def _append_all(
        self, request: Request, tokens: int | Sequence[int] | None, *, advanced: bool = False
    ) -> bool:
        tokens = list(tokens) if isinstance(tokens, Sequence) else [tokens]
        if not tokens:
            tokens = [None]  # _append raises: a row that samples must get a token
        for j, token in enumerate(tokens):
            if j > 0 and not advanced:
                request.num_computed_tokens += 1  # fused step j computed the previous token
            if self._append(request, token):
                return True
        return False

    def _append(self, request: Request, token: int | None) -> bool:
        if token is None:
            raise ValueError(f"request {request.request_id!r} sampled but got no token")
        request.output_token_ids.append(int(token))
        reason = self._stop_reason(request, int(token))
        if reason is None:
            return False
        self._finish(request, reason)
        return True

    def _stop_reason(self, request: Request, token: int) -> str | None:
        params = request.params
        if token in params.stop_token_ids:
            return "stop"
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if len(request.output_token_ids) >= params.max_tokens:
            return "length"
        return None

    def _finish(self, request: Request, reason: str) -> None:
        rid = request.request_id
        if request.status is RequestStatus.RUNNING:
            self._release_pages(rid)
            self.state_pool.release(rid)
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        # Tokens still on the device (async scheduling) are dropped when they arrive. Its slot
        # and pages may be handed out before the step that writes them has run: a later step
        # reads the cache that step returns (steps run in order) and a new owner's first
        # prefill chunk zeroes the slot; its KV is written before it is read.
        request.num_pending = 0
        del self.requests[rid]
