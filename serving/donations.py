"""Prefix caching's recurrent-state checkpoints in the `Scheduler`: a prefill chunk ends at each
donation depth and a fused decode at each track point, so that the request's slot holds the
state there; the step then snapshots the slot into a checkpoint slot, and after it `_donate`
inserts the snapshot into the prefix tree (a verify's track snapshot only if accepted)."""

from __future__ import annotations

from collections.abc import Sequence

from serving.request import Request
from serving.scheduler_output import SchedulerOutput
from serving.speculative.track import can_track, track_point


class DonationsMixin:
    """Where chunks end and which snapshots a step takes. Mixed into `Scheduler`; it uses
    `self.prefix_cache`, `self.track_interval`, `self.speculative` and `self.requests`."""

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
