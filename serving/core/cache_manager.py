"""The one owner of the slot and page layout: the KV page pool (`PageAllocator`), the recurrent
state slots (`StatePool`), and, with prefix caching, the prefix tree and its checkpoint slots
(`PrefixCache`). The scheduler asks it for room, slots and hits and tells it what to free; it
never reads a pool itself. Host-side Python; no JAX here.

Prefix caching's checkpoints are planned here too: a prefill chunk ends at each donation depth
and a fused decode at each track point, so that the request's slot holds the state there; the
step snapshots the slot into a checkpoint slot, and after it `donate` inserts the snapshot into
the tree (a verify's track snapshot only if its step was accepted).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING

from serving.core.allocator import PageAllocator
from serving.core.prefix_cache import Hit, PrefixCache, branching_depth, checkpoint_depth
from serving.core.request import Request
from serving.core.scheduler_output import Placement, SchedulerOutput
from serving.core.state_pool import StatePool
from serving.core.track import can_track, track_point

if TYPE_CHECKING:
    from kimi_linear_jax.cache import CacheLayout


class CacheManager:
    """Pages, state slots and the prefix tree, behind the few questions a scheduler asks."""

    def __init__(
        self,
        allocator: PageAllocator,
        state_pool: StatePool,
        prefix_cache: PrefixCache | None = None,
        *,
        track_interval: int | None = None,
        speculative: bool = False,
    ) -> None:
        self.allocator = allocator
        self.state_pool = state_pool
        self.prefix_cache = prefix_cache
        # Plain decodes end their fused steps on a track point; speculative windows track
        # inside the verify instead (`plan_track`).
        self.track_interval = track_interval if prefix_cache is not None else None
        self.speculative = speculative

    @classmethod
    def from_layout(
        cls, layout: CacheLayout, *, track_interval: int | None = None, speculative: bool = False
    ) -> CacheManager:
        """The pools of `layout`; a prefix tree when it has checkpoint slots (they follow the
        request slots in the same KDA arrays, so a restore or snapshot is one device copy)."""
        allocator = PageAllocator.from_layout(layout)
        tree = None
        if layout.num_checkpoint_slots > 0:
            tree = PrefixCache(allocator, layout.checkpoint_slots)
        pool = StatePool(layout.request_slots.stop)
        return cls(allocator, pool, tree, track_interval=track_interval, speculative=speculative)

    # ---- pages -----------------------------------------------------------------------------

    def pages_for(self, num_tokens: int) -> int:
        return self.allocator.pages_for(num_tokens)

    def pages(self, request_id: Hashable) -> list[int]:
        return self.allocator.pages(request_id)

    def can_allocate(self, request_id: Hashable, num_tokens: int) -> bool:
        return self.allocator.can_allocate(request_id, num_tokens)

    def allocate(self, request_id: Hashable, num_tokens: int) -> None:
        self.allocator.allocate(request_id, num_tokens)

    def release_tail(self, request_id: Hashable, keep_tokens: int) -> None:
        """Pages past `keep_tokens` (a verify window's unaccepted slots) go back."""
        self.allocator.release_tail(request_id, keep_tokens)

    def make_room(self, request_id: Hashable, num_tokens: int) -> None:
        """Evict unlocked prefix-tree pages so the request's pages can hold num_tokens."""
        if self.prefix_cache is None:
            return
        have = len(self.allocator.pages(request_id)) if self._holds_pages(request_id) else 0
        missing = self.allocator.pages_for(num_tokens) - have - self.allocator.num_free
        if missing > 0:
            self.prefix_cache.evict_pages(missing)

    def room(self, request_id: Hashable, num_computed: int) -> int:
        """Most new tokens the request's pages plus the free pages can hold."""
        owned = len(self.allocator.pages(request_id))
        return (owned + self.allocator.num_free) * self.allocator.tokens_per_page - num_computed

    def missing_pages(self, request_id: Hashable, num_tokens: int) -> int:
        """Pages the request lacks to hold num_tokens (0 when it has them)."""
        return max(0, self.allocator.pages_for(num_tokens) - len(self.allocator.pages(request_id)))

    def _holds_pages(self, request_id: Hashable) -> bool:
        try:
            self.allocator.pages(request_id)
        except KeyError:
            return False
        return True

    # ---- slots -----------------------------------------------------------------------------

    @property
    def num_free_slots(self) -> int:
        return self.state_pool.num_free

    def acquire_slot(self, request_id: Hashable) -> None:
        self.state_pool.acquire(request_id)

    def placement(self, request_id: Hashable, start: int, length: int) -> Placement:
        """Where a row of the step lives: its slot and pages, fixed as scheduled."""
        pages = tuple(self.allocator.pages(request_id))
        return Placement(self.state_pool.slot(request_id), pages, start, length)

    def free(self, request_id: Hashable) -> None:
        """A running request finished or was preempted: its borrowed tree pages unlocked,
        its pages and its state slot freed."""
        self._free_pages(request_id)
        self.state_pool.release(request_id)

    def _free_pages(self, request_id: Hashable) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.release(request_id)  # unlock borrowed tree pages first
        self.allocator.free(request_id)

    # ---- prefix hits -----------------------------------------------------------------------

    def lookup(self, request: Request) -> tuple[Hit | None, tuple[int, ...]]:
        """(the prefix hit of a request about to start from token 0, or None; the depths its
        prefill donates a checkpoint at). A request that asks for prompt logprobs takes no
        hit: the skipped positions would have no logits (vLLM's rule too); it still donates."""
        cache = self.prefix_cache
        if cache is None:
            return None, ()
        n = request.num_tokens
        if request.params.prompt_logprobs is not None:
            depth = checkpoint_depth(0, n, cache.state_chunk, cache.tree_page)
            return None, (depth,) if depth else ()
        hit = cache.lookup(request.all_token_ids)
        depths = {checkpoint_depth(hit.depth, n - hit.depth, cache.state_chunk, cache.tree_page)}
        if hit.kv_depth > hit.depth:
            depths.add(branching_depth(hit.kv_depth, cache.state_chunk, cache.tree_page))
        donate = tuple(sorted(d for d in depths if d and d > hit.depth))
        return (hit if hit.depth > 0 else None), donate

    def borrow(self, request_id: Hashable, hit: Hit) -> None:
        self.prefix_cache.borrow(request_id, hit)

    def unborrow(self, request_id: Hashable, hit: Hit) -> None:
        """An admission that did not fit gives its hit back."""
        self._free_pages(request_id)
        self.prefix_cache.end_step([hit])

    # ---- checkpoints -----------------------------------------------------------------------

    def cut_at_donation(self, request: Request, length: int) -> int:
        """End the chunk at the next donation depth, so the slot holds the state there."""
        start = request.num_computed_tokens
        for depth in request.donate_depths:
            if start < depth < start + length:
                return depth - start
        return length

    def plan_donation(self, out: SchedulerOutput, request: Request, end: int) -> None:
        if self.prefix_cache is not None and end in request.donate_depths:
            self._snapshot(out, request, end)

    def cut_at_track(self, request: Request, steps: int) -> int:
        """Plain decode: end the fused steps on a track point (the state there is then in the
        slot after the step)."""
        if self.track_interval is None or self.speculative:
            return steps
        return min(steps, self._to_track_point(request))

    def cut_before_track(self, request: Request, steps: int) -> int:
        """Speculative, a row that drafts nothing: it computes one token, or up to `steps` in
        a draftless run. Its steps end short of the next track point, or on it (one step), so
        that only the step reaching the point plans it. Over its whole reserved window, each of
        the k steps before the point planned one, and ran the verify program for it."""
        if self.track_interval is None:
            return steps
        to_point = self._to_track_point(request)
        return 1 if to_point == 1 else min(steps, to_point - 1)

    def _to_track_point(self, request: Request) -> int:
        """Steps from the request's computed tokens to the next multiple of the interval."""
        start, interval = request.num_computed_tokens, self.track_interval
        return (start // interval + 1) * interval - start

    def plan_track(self, out: SchedulerOutput, request: Request, steps: int) -> None:
        interval = self.track_interval
        if interval is None:
            return
        start = request.num_computed_tokens
        if not self.speculative:
            if (start + steps) % interval == 0:
                self._snapshot(out, request, start + steps)
            return
        tp = track_point(start, start + steps, interval)
        if tp.to_track:
            slot = self.prefix_cache.acquire_slot()
            if slot is not None:
                out.track[request.request_id] = (slot, tp)

    def _snapshot(self, out: SchedulerOutput, request: Request, depth: int) -> None:
        slot = self.prefix_cache.acquire_slot()
        if slot is not None:
            out.snapshots.append((request.request_id, slot, depth))

    def donate(self, output: SchedulerOutput, sampled, requests: Mapping[Hashable, Request]):
        """Insert the step's snapshots into the tree (before any request of the step finishes
        and frees its pages). A verify's track snapshot counts only if its step was accepted.
        `sampled`: the step's new tokens by request id, not appended yet (a fused decode's
        snapshot depth or a window's track point may lie among them)."""
        cache = self.prefix_cache
        if cache is None:
            return

        def live(rid):
            request = requests.get(rid)
            return None if request is None or request.is_finished else request

        def sequence(request):
            new = sampled.get(request.request_id)
            return request.all_token_ids + (list(new) if isinstance(new, Sequence) else [new])

        for rid, slot, depth in output.snapshots:
            request = live(rid)
            if request is None:
                cache.release_slot(slot)
            else:
                cache.insert(rid, sequence(request)[:depth], slot)
        for rid, (slot, tp) in output.track.items():
            request, new = live(rid), sampled.get(rid)
            commit_lens = len(new) if isinstance(new, Sequence) else 0
            if request is None or not can_track(tp, commit_lens):
                cache.release_slot(slot)
            else:
                cache.insert(rid, sequence(request)[: tp.point], slot)
        cache.end_step(output.hits)

    def release_step(self, output: SchedulerOutput) -> None:
        """A step that failed: the checkpoint slots it reserved go back, its restores end."""
        cache = self.prefix_cache
        if cache is None:
            return
        for _, slot, _ in output.snapshots:
            cache.release_slot(slot)
        for slot, _ in output.track.values():
            cache.release_slot(slot)
        cache.end_step(output.hits)
