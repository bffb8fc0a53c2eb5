"""Pages for a row in the `Scheduler`, and preemption by recompute when none are left.

A chunk first shrinks to the tokens that its own pages and the free pages can hold (unlocked
prefix-tree pages are evicted for it first). When not even one token fits, the most recently
arrived running request that is not yet scheduled this step (possibly the one asking) is
preempted: its pages are freed, its state slot is released, `num_computed_tokens` goes back to
0 and it waits again in arrival order, to be prefilled again from scratch."""

from __future__ import annotations

import bisect
from collections.abc import Hashable

from serving.request import Request, RequestStatus


class PreemptionMixin:
    """Room in the page pool. Mixed into `Scheduler`; it uses `self.allocator`,
    `self.state_pool`, `self.prefix_cache`, `self.running`, `self.waiting` and the step being
    built (`_scheduled_ids`, `_preempted_now`)."""

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
