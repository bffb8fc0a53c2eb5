"""Continuous batching with chunked prefill and preemption (host, plain Python; no JAX here).

The scheduler owns the requests and their queues and is the only thing that changes a request;
pages, state slots and the prefix tree belong to the `CacheManager`, which it asks for room.
Each step computes, per scheduled request, tokens `[num_computed_tokens, +length)`; a range
that reaches `num_tokens` samples the next token. Per step, under the token budget: running
decodes oldest first, then running prefills (chunks of at most `chunk_size`), then waiting
requests first come, first served. Preemption by recompute: when not one token fits, the
newest running request not in this step loses its pages and slot, keeps its tokens and is
prefilled again from scratch (no recurrent state is saved, so no stale slot is restored).
Async scheduling: `advance` counts a dispatched decode step's tokens as pending, and `update`
appends them when they arrive. docs/architecture.md follows a step through it.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterable, Mapping, Sequence

from serving.core.cache_manager import CacheManager
from serving.core.policy import DraftPolicy
from serving.core.request import Request, RequestStatus
from serving.core.scheduler_output import PrefillChunk, SchedulerOutput


class Scheduler:
    """Decides which requests run each step; the one owner of the requests' state."""

    def __init__(
        self,
        cache: CacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        chunk_size: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        num_decode_steps: int = 1,
        draft_policy: DraftPolicy | None = None,
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
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunk_size = chunk_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        # Speculative: decode_steps is each row's verify window (1 + drafts), reserved before
        # the verify; what was not accepted is released after it (`update`).
        self.num_decode_steps = num_decode_steps
        self.draft_policy = draft_policy
        self.requests: dict[Hashable, Request] = {}  # every unfinished request
        self.waiting: list[Request] = []  # WAITING and PREEMPTED, by arrival
        self.running: list[Request] = []  # RUNNING, by arrival
        self._arrivals = 0
        self._in_flight = False  # schedule() was called and update() not yet
        self._scheduled_ids: set[Hashable] = set()  # requests in the step being built
        self._preempted_now: list[Hashable] = []  # ids preempted while building it

    @property
    def speculative(self) -> bool:
        return self.draft_policy is not None

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- arrival and abort ---------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a new request; raises ValueError for one that could never run."""
        self._validate(request)
        request.status, request.num_computed_tokens = RequestStatus.WAITING, 0
        request.finish_reason, request.arrival = None, self._arrivals
        if self.speculative:
            request.spec_prior = self.draft_policy.prior()
        self._arrivals += 1
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _validate(self, request: Request) -> None:
        rid, prompt_len = request.request_id, len(request.prompt_token_ids)
        max_tokens = request.params.max_tokens
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if prompt_len == 0:
            raise ValueError(f"request {rid!r}: prompt is empty")
        if request.output_token_ids:
            raise ValueError(f"request {rid!r}: output_token_ids must start empty")
        if max_tokens < 1:
            raise ValueError(f"request {rid!r}: max_tokens must be >= 1, got {max_tokens}")
        if prompt_len + max_tokens > self.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt length {prompt_len} + max_tokens {max_tokens} "
                f"exceeds max_model_len {self.max_model_len}"
            )
        # The last sampled token is never computed, so the KV peak is prompt + max_tokens - 1.
        need = self.cache.pages_for(prompt_len + max_tokens - 1)
        if need > self.cache.allocator.capacity:
            raise ValueError(
                f"request {rid!r} needs {need} pages (prompt {prompt_len} + max_tokens "
                f"{max_tokens}) but the page pool holds only {self.cache.allocator.capacity}"
            )

    def abort(self, request_id: Hashable, reason: str = "abort") -> Request | None:
        """Finish the request (pages and slot freed) with `reason`; None if unknown or already
        finished."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, reason)
        return request

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self._in_flight:
            raise RuntimeError("schedule() called twice without update()")
        out = SchedulerOutput()
        self._scheduled_ids = set()
        self._preempted_now = out.preempted
        budget = self._schedule_running(out, self.max_num_batched_tokens, decodes=True)
        budget = self._schedule_running(out, budget, decodes=False)
        self._admit(out, budget)
        if out.prefill and not self.speculative:
            out.decode_steps = [1] * len(out.decode)
        # Track points on the steps as they run: beside a prefill a decode row runs one step,
        # and a snapshot planned at the end of its fused steps named a depth the step never
        # computed ("donated depth ... is not a multiple of ...", the whole step failed).
        for request, steps in zip(out.decode, out.decode_steps, strict=True):
            self.cache.plan_track(out, request, steps)
        # Each row's slot and pages, read once every row is scheduled.
        rows = [(c.request, c.start, c.length) for c in out.prefill]
        rows += [(r, r.num_computed_tokens, 1) for r in out.decode]
        place = self.cache.placement
        out.placement.update({r.request_id: place(r.request_id, *x) for r, *x in rows})
        self._in_flight = not out.is_empty
        return out

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
                want = self.cache.cut_at_donation(request, want)
            length = self._grow(request, want)
            if length == 0:
                continue  # it preempted itself
            self._scheduled_ids.add(rid)
            if decodes:
                budget -= 1  # the budget counts rows of work, not the fused lookahead
                out.decode.append(request)
                out.decode_steps.append(length)
                if self.speculative:
                    self._plan_drafts(out, request, length - 1)
            else:
                budget -= length
                out.prefill.append(PrefillChunk(request, request.num_computed_tokens, length))
                self.cache.plan_donation(out, request, request.num_computed_tokens + length)
        return budget

    def _decode_want(self, request: Request) -> int:
        """Decode steps the request asks for: fused steps need KV room for each step and
        never pass max_tokens (pending tokens count: 0 when they reach it)."""
        remaining = request.params.max_tokens - len(request.output_token_ids)
        remaining -= request.num_pending
        if remaining <= 0:
            return 0
        return self.cache.cut_at_track(request, min(self.num_decode_steps, remaining))

    def _plan_drafts(self, out: SchedulerOutput, request: Request, room: int) -> None:
        out.max_drafts.append(self._max_drafts(request, room))
        if out.max_drafts[-1] and request.spec_probe_after:  # set by a probe only
            out.probes.add(request.request_id)
        elif not out.max_drafts[-1]:  # it rests: a track point only where its steps reach one
            out.decode_steps[-1] = self.cache.cut_before_track(request, room + 1)
            if out.decode_steps[-1] > 1 and not request.params.has_penalty:
                out.resting[request.request_id] = out.decode_steps[-1] - 1

    def _max_drafts(self, request: Request, room: int) -> int:
        # Penalised rows do not speculate: their counts would change inside the window.
        room = 0 if request.params.has_penalty else room
        policy = self.draft_policy
        drafts, request.spec_skipped, request.spec_probe_after = policy.drafts(
            room, policy.acceptance(request), request.spec_skipped, request.spec_probe_after
        )
        return drafts

    # ---- admission -----------------------------------------------------------------------

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0:
            if len(self.running) >= self.max_num_seqs or self.cache.num_free_slots == 0:
                return
            if not self._admit_one(out, self.waiting[0], budget):
                return  # first come, first served: nobody overtakes the head
            budget -= out.prefill[-1].length

    def _admit_one(self, out: SchedulerOutput, request: Request, budget: int) -> bool:
        rid = request.request_id
        hit, request.donate_depths = self.cache.lookup(request)
        start = hit.depth if hit else 0
        request.num_computed_tokens = start
        want = min(request.num_tokens - start, self.chunk_size, budget)
        length = self.cache.cut_at_donation(request, want)
        if hit:
            self.cache.borrow(rid, hit)
        self.cache.make_room(rid, start + length)
        if not self.cache.can_allocate(rid, start + length):
            if hit:
                self.cache.unborrow(rid, hit)
            request.num_computed_tokens = 0
            return False
        self.waiting.pop(0)
        self.cache.allocate(rid, start + length)
        self.cache.acquire_slot(rid)
        if hit:
            out.restores.append((hit.checkpoint, rid))
            out.hits.append(hit)
        request.num_cached_tokens = start
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=lambda r: r.arrival)
        out.prefill.append(PrefillChunk(request, start, length))
        self.cache.plan_donation(out, request, start + length)
        return True

    # ---- room: preemption by recompute ---------------------------------------------------

    def _grow(self, request: Request, length: int) -> int:
        """Pages for `length` more tokens (shrunk to what fits, preempting if none); 0 if the
        request had to preempt itself."""
        rid, start = request.request_id, request.num_computed_tokens
        self.cache.make_room(rid, start + length)
        while True:
            fit = self.cache.room(rid, start)
            if fit >= 1:
                length = min(length, fit)
                self.cache.allocate(rid, start + length)
                return length
            victim = self._victim()
            self._preempt(victim)
            if victim is request:
                return 0

    def _victim(self) -> Request:
        """The most recently arrived running request not scheduled this step. Running
        requests are visited oldest first, so the asker is itself a candidate and no request
        already in this step's batch is ever chosen."""
        for request in reversed(self.running):
            if request.request_id not in self._scheduled_ids:
                return request
        raise AssertionError("no preemptible request")  # the asker is always a candidate

    def _preempt(self, request: Request) -> None:
        """Recompute policy: drop pages and slot, keep the tokens, re-prefill from scratch."""
        self.cache.free(request.request_id)
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        bisect.insort(self.waiting, request, key=lambda r: r.arrival)
        self._preempted_now.append(request.request_id)

    # ---- after a step --------------------------------------------------------------------

    def update(
        self,
        output: SchedulerOutput,
        sampled: Mapping[Hashable, int | Sequence[int]] | Sequence[int | None],
        num_drafts: Mapping[Hashable, int] | None = None,
        shadows: Mapping[Hashable, Sequence[bool]] | None = None,
    ) -> list[Request]:
        """Advance the step's requests and append their sampled tokens; return those finished.

        `sampled` maps request id -> token (or the tokens of fused decode steps, in order), or
        is one entry per row of `output.rows` (entries of rows that do not sample are ignored).
        Tokens after one that finishes the request are dropped; requests aborted mid-step are
        skipped. `num_drafts`: the drafts each verify row proposed (its tokens are the accepted
        ones plus one), for the adaptive speculation; `shadows`: whether each shadow draft of a
        row was the token that followed it (`Drafter.shadow`, `Drafter.take_shadows`).
        """
        self._in_flight = False
        if not isinstance(sampled, Mapping):
            rows = output.rows
            if len(sampled) != len(rows):
                raise ValueError(f"{len(sampled)} sampled entries for {len(rows)} rows")
            sampled = {r.request_id: t for r, t in zip(rows, sampled, strict=True)}
        if self.speculative:
            self.draft_policy.record_step(output.decode, sampled, num_drafts, shadows)
        self.cache.donate(output, sampled, self.requests)
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
                # comes next step).
                self.cache.release_tail(request.request_id, request.num_tokens)
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
        """The step of `output` raised before `update` finished: every request of the step
        ends with reason "error" (pages and slot freed), the checkpoint slots it reserved go
        back, and the next `schedule` may run. Returns the requests it ended."""
        self._in_flight = False
        self.cache.release_step(output)
        failed = [r for r in output.rows if not r.is_finished]
        for request in failed:
            self._finish(request, "error")
        return failed

    # ---- async scheduling: pending tokens ------------------------------------------------

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
        finish. So: nothing waits (a finish could admit it), every running request decodes
        without drafts or penalties (their counts need the tokens), all fit the budget and the
        free pages (no eviction, no preemption), and no row ends on a track point (its
        snapshot waits for a state that has no extra token in it)."""
        if self.speculative or self.waiting or len(self.running) > self.max_num_batched_tokens:
            return False
        missing, rows, interval = 0, 0, self.cache.track_interval
        for request in self.running:
            if request.num_uncomputed != 1 or request.params.has_penalty:
                return False
            steps = self._decode_want(request)
            if steps == 0:
                continue  # it ends (max_tokens) when its pending tokens arrive
            end = request.num_computed_tokens + steps
            if interval is not None and end % interval == 0:
                return False
            missing += self.cache.missing_pages(request.request_id, end)
            rows += 1
        return rows > 0 and missing <= self.cache.allocator.num_free

    def drop_finished(self, output: SchedulerOutput) -> None:
        """Remove the decode rows of requests that ended since `output` was scheduled ahead:
        what remains is the step synchronous scheduling makes now."""
        keep = [i for i, r in enumerate(output.decode) if not r.is_finished]
        output.decode = [output.decode[i] for i in keep]
        output.decode_steps = [output.decode_steps[i] for i in keep]
        output.placement = {r.request_id: output.placement[r.request_id] for r in output.decode}

    def _append_pending(self, output: SchedulerOutput, sampled) -> list[Request]:
        """`update` of an advanced step: `advance` already counted its tokens as computed. A
        row that finished meanwhile (an abort, a stop in the step before) drops them."""
        finished: list[Request] = []
        for request, steps in zip(output.decode, output.decode_steps, strict=True):
            if request.is_finished:
                continue
            request.num_pending -= steps
            if self._append_all(request, sampled.get(request.request_id), advanced=True):
                finished.append(request)
        return finished

    # ---- tokens and endings --------------------------------------------------------------

    def _append_all(self, request: Request, tokens, *, advanced: bool = False) -> bool:
        tokens = list(tokens) if isinstance(tokens, Sequence) else [tokens]
        for j, token in enumerate(tokens or [None]):  # a row that samples must get a token
            if j > 0 and not advanced:
                request.num_computed_tokens += 1  # fused step j computed the previous token
            if token is None:
                raise ValueError(f"request {request.request_id!r} sampled but got no token")
            request.output_token_ids.append(int(token))
            reason = self._stop_reason(request, int(token))
            if reason is not None:
                self._finish(request, reason)
                return True
        return False

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
        if request.status is RequestStatus.RUNNING:
            self.cache.free(request.request_id)
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
        del self.requests[request.request_id]
