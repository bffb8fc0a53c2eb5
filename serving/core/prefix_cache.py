"""Prefix caching for the hybrid model: a radix tree over token ids, one node per tree page
(tree page = allocator page = page_size * dcp_size tokens), whose nodes own KV pages and, some
of them, a recurrent-state checkpoint (a slot of the KDA state arrays holding the KDA state and
the conv windows of every KDA layer after the node's depth).

A KV page alone is useless to a recurrent model: a request can skip tokens only if the state
after them exists. So a lookup returns min(KV-hit depth, deepest checkpoint on the path), which
is the deepest checkpoint, since checkpoints sit on matched nodes. The request borrows the tree's
pages up to there, the checkpoint is copied into its own slot (copy on write: the tree's copy
never changes) and only the remaining tokens are prefilled, so no token passes the KDA layers
twice.

Checkpoints sit on the grid `lcm(state_chunk, tree_page)` (`checkpoint_depth`): depths the tree
can name and where the prefill has a state (the scheduler ends a chunk there).

Eviction is LRU over leaves whose pages no running request borrows (KV lock count 0), and,
separately, over checkpoints not being restored this step (checkpoint lock count 0): a node can
lose its checkpoint and keep its KV pages.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Hashable

from serving.core.allocator import PageAllocator
from serving.core.track import KDA_CHUNK


def checkpoint_depth(prefix_len: int, extend_len: int, state_chunk: int, tree_page: int):
    """Where a finished prefill of `extend_len` tokens after a `prefix_len` hit donates its
    state: the deepest multiple of lcm(state_chunk, tree_page) within the sequence, or None when
    that is not past the prefix (nothing new to donate)."""
    grid = math.lcm(state_chunk, tree_page)
    depth = (prefix_len + extend_len) // grid * grid
    return depth if depth > prefix_len else None


def branching_depth(full_kv_hit: int, state_chunk: int, tree_page: int) -> int:
    """For a KV hit deeper than the checkpoint hit: the grid depth where a new checkpoint lets
    later requests branch off the shared KV."""
    grid = math.lcm(state_chunk, tree_page)
    return full_kv_hit // grid * grid


@dataclasses.dataclass(eq=False)
class Node:
    key: tuple[int, ...]
    page: int
    depth: int  # tokens from the root through this node
    parent: Node | None
    children: dict[tuple[int, ...], Node] = dataclasses.field(default_factory=dict)
    checkpoint: int | None = None  # state slot
    kv_locks: int = 0  # running requests borrowing this page
    ckpt_locks: int = 0  # restores of this checkpoint scheduled in the current step
    last_used: int = 0


@dataclasses.dataclass
class Hit:
    depth: int  # tokens the request skips
    pages: list[int]  # tree pages covering them
    checkpoint: int | None  # slot to copy into the request's slot
    kv_depth: int  # full KV match (>= depth)
    nodes: list[Node]


class PrefixCache:
    def __init__(self, allocator: PageAllocator, checkpoint_slots: range) -> None:
        self.allocator = allocator
        self.tree_page = allocator.tokens_per_page
        self.state_chunk = max(KDA_CHUNK, allocator.page_size)
        self.grid = allocator.layout.checkpoint_grid
        self.root = Node((), 0, 0, None)
        self._free_slots = list(reversed(checkpoint_slots))
        self.num_checkpoint_slots = len(checkpoint_slots)
        self._clock = itertools.count(1)
        self._borrowers: dict[Hashable, list[Node]] = {}
        self.stats = dict(queries=0, query_tokens=0, hit_tokens=0, donated=0, evicted_pages=0)
        self.stats.update(evicted_checkpoints=0)

    # ---- lookup and borrowing ------------------------------------------------------------

    def _walk(self, tokens: list[int]) -> list[Node]:
        nodes, node, tp = [], self.root, self.tree_page
        for start in range(0, len(tokens) - tp + 1, tp):
            node = node.children.get(tuple(tokens[start : start + tp]))
            if node is None:
                break
            nodes.append(node)
        return nodes

    def lookup(self, tokens: list[int]) -> Hit:
        """The hit for a sequence; at least its last token is left to compute (its logits are
        needed). Touches the path (LRU) and locks the checkpoint until `end_step`."""
        path = self._walk(tokens[: len(tokens) - 1])
        now = next(self._clock)
        for node in path:
            node.last_used = now
        best = max((i for i, n in enumerate(path) if n.checkpoint is not None), default=-1)
        self.stats["queries"] += 1
        self.stats["query_tokens"] += len(tokens)
        if best < 0:
            kv = path[-1].depth if path else 0
            return Hit(0, [], None, kv, [])
        used = path[: best + 1]
        used[-1].ckpt_locks += 1
        self.stats["hit_tokens"] += used[-1].depth
        return Hit(
            used[-1].depth, [n.page for n in used], used[-1].checkpoint, path[-1].depth, used
        )

    def borrow(self, request_id: Hashable, hit: Hit) -> None:
        """The request's block table starts with the hit's pages, locked while it runs."""
        self.allocator.attach_prefix(request_id, hit.pages)
        for node in hit.nodes:
            node.kv_locks += 1
        self._borrowers[request_id] = list(hit.nodes)

    def release(self, request_id: Hashable) -> None:
        """The request finished or was preempted: unlock what it borrowed (call before the
        allocator frees it)."""
        for node in self._borrowers.pop(request_id, []):
            node.kv_locks -= 1

    def end_step(self, hits: list[Hit]) -> None:
        """The step's restores are done: their checkpoints may be evicted again."""
        for hit in hits:
            if hit.nodes:
                hit.nodes[-1].ckpt_locks -= 1

    # ---- donation ------------------------------------------------------------------------

    def acquire_slot(self) -> int | None:
        """A free checkpoint slot, evicting the LRU unlocked checkpoint if none; None if all
        are locked."""
        if not self._free_slots and not self._evict_checkpoint():
            return None
        return self._free_slots.pop()

    def release_slot(self, slot: int) -> None:
        self._free_slots.append(slot)

    def insert(self, request_id: Hashable, tokens: list[int], slot: int | None) -> None:
        """Donate the request's first len(tokens) tokens (a multiple of the tree page): nodes
        that do not exist yet adopt the request's pages; the last node gets `slot` as its
        checkpoint (a duplicate checkpoint goes back to the pool)."""
        if len(tokens) % self.tree_page:
            raise ValueError(f"donated depth {len(tokens)} is not a multiple of {self.tree_page}")
        pages = self.allocator.pages(request_id)
        borrowed = self._borrowers.setdefault(request_id, [])
        node, now = self.root, next(self._clock)
        for i in range(len(tokens) // self.tree_page):
            key = tuple(tokens[i * self.tree_page : (i + 1) * self.tree_page])
            child = node.children.get(key)
            if child is None:
                child = Node(key, pages[i], node.depth + self.tree_page, node)
                node.children[key] = child
                self.allocator.adopt(request_id, pages[i])
                child.kv_locks += 1
                borrowed.append(child)
            child.last_used = now
            node = child
        if slot is None:
            return
        if node is self.root or node.checkpoint is not None:
            self.release_slot(slot)
        else:
            node.checkpoint = slot
            self.stats["donated"] += 1

    # ---- eviction ------------------------------------------------------------------------

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def _evict_checkpoint(self) -> bool:
        candidates = [n for n in self._nodes() if n.checkpoint is not None and n.ckpt_locks == 0]
        if not candidates:
            return False
        victim = min(candidates, key=lambda n: n.last_used)
        self._free_slots.append(victim.checkpoint)
        victim.checkpoint = None
        self.stats["evicted_checkpoints"] += 1
        return True

    def evict_pages(self, num_pages: int) -> int:
        """Free up to `num_pages` pages by evicting LRU unlocked leaves (with their
        checkpoints); returns how many were freed."""
        freed = 0
        while freed < num_pages:
            leaves = [
                n for n in self._nodes() if not n.children and n.kv_locks == 0 and n.ckpt_locks == 0
            ]
            if not leaves:
                break
            victim = min(leaves, key=lambda n: n.last_used)
            del victim.parent.children[victim.key]
            if victim.checkpoint is not None:
                self._free_slots.append(victim.checkpoint)
            self.allocator.release_tree_page(victim.page)
            freed += 1
        self.stats["evicted_pages"] += freed
        return freed

    def clear(self) -> int:
        """Evict everything unlocked; returns the pages freed."""
        return self.evict_pages(self.allocator.capacity)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)
