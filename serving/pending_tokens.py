"""Async scheduling in the `Scheduler`: `advance` marks a dispatched plain decode step's tokens
as pending (counted as computed and as sequence tokens, not appended), so the next step can be
scheduled before they arrive, when `can_schedule_ahead` says that step is the one synchronous
scheduling would make; `update` appends them later (`_append_pending`) and drops those of a
request that finished meanwhile."""

from __future__ import annotations

from serving.request import Request
from serving.scheduler_output import SchedulerOutput


class PendingTokensMixin:
    """The scheduler's pending tokens. Mixed into `Scheduler`; it uses `self.running`,
    `self.waiting`, `self.allocator`, the options (`speculative`, `max_num_batched_tokens`,
    `track_interval`), and the scheduler's `_decode_want`, `_append_all` and `_in_flight`."""

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
