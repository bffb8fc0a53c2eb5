"""Admission in the `Scheduler`: WAITING / PREEMPTED requests start in arrival order (first
come, first served: admission stops at the first request that does not fit) while a state
slot, `max_num_seqs`, pages for the first chunk and budget remain; a prefix-cache hit lets the
first chunk start past the cached tokens (its state restored from a checkpoint slot)."""

from __future__ import annotations

import bisect

from serving.prefix_cache import Hit, branching_depth, checkpoint_depth
from serving.request import Request, RequestStatus
from serving.scheduler_output import PrefillChunk, SchedulerOutput


class AdmissionMixin:
    """Admission and its prefix-cache lookup. Mixed into `Scheduler`; it uses `self.waiting`,
    `self.running`, `self.allocator`, `self.state_pool`, `self.prefix_cache`, the limits and
    the scheduler's `_cut_at_donation`, `_make_room` and `_plan_donation`."""

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
