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

Parts of the `Scheduler` live beside it, one concern a module: `admission.py`, `preemption.py`
(pages for a row), `donations.py` (prefix caching's checkpoints) and `pending_tokens.py` (async
scheduling); the step it hands the runner is in `scheduler_output.py`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from serving.admission import AdmissionMixin
from serving.donations import DonationsMixin
from serving.pending_tokens import PendingTokensMixin
from serving.preemption import PreemptionMixin
from serving.request import Request, RequestStatus, acceptance_ema
from serving.scheduler_output import Placement, PrefillChunk, SchedulerOutput

if TYPE_CHECKING:  # both modules import JAX; the scheduler only needs their host methods
    from serving.allocator import PageAllocator
    from serving.prefix_cache import PrefixCache
    from serving.state_pool import StatePool


# The longest wait between two probes of a request that stopped drafting, in probe intervals.
SPEC_MAX_PROBE_BACKOFF = 8


class Scheduler(AdmissionMixin, PreemptionMixin, DonationsMixin, PendingTokensMixin):
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
        # proposing (its step is a plain decode) except for probes: the first after
        # `spec_probe_interval` verifies, each later one twice as far (up to
        # SPEC_MAX_PROBE_BACKOFF times), back to the interval once it drafts again. A verify
        # window costs several decode steps on a CPU, so drafts that keep failing are a
        # loss. 0 turns it off.
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
        # Track points on the steps as they run: beside a prefill a decode row runs one step,
        # and a snapshot planned at the end of its fused steps named a depth the step never
        # computed ("donated depth ... is not a multiple of ...", the whole step failed).
        for request, steps in zip(out.decode, out.decode_steps, strict=True):
            self._plan_track(out, request, steps)
        self._place(out)
        self._in_flight = not out.is_empty
        return out

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
                    if out.max_drafts[-1] and request.spec_probe_after:  # set by a probe only
                        out.probes.add(rid)
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

    # ---- speculation ---------------------------------------------------------------------

    def _max_drafts(self, request: Request, room: int) -> int:
        # Penalised rows do not speculate: their counts would change inside the window.
        if room <= 0 or request.params.has_penalty:
            return 0
        if request.spec_acceptance >= self.spec_min_acceptance:
            request.spec_probe_after = 0
            return room
        request.spec_skipped += 1
        after = request.spec_probe_after or self.spec_probe_interval
        if request.spec_skipped < after:
            return 0
        # Probe; should it fail too, the next one waits twice as long.
        request.spec_skipped = 0
        cap = self.spec_probe_interval * SPEC_MAX_PROBE_BACKOFF
        request.spec_probe_after = min(2 * after, cap)
        return room

    def _record_acceptance(self, output: SchedulerOutput, sampled, num_drafts) -> None:
        """Each verify row's accepted share of its drafts into its acceptance EMA."""
        for request in output.decode:
            n = num_drafts.get(request.request_id, 0)
            if n > 0:
                rate = (len(sampled[request.request_id]) - 1) / n
                request.spec_acceptance = acceptance_ema(request.spec_acceptance, rate)

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
