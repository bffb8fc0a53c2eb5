"""Pages of the MLA latent cache: which request owns which page (host, plain Python).

An allocator page holds `page_size * dcp_size` tokens. Under DCP token p of a sequence lives on
rank p % dcp_size, so one allocator page id names the same physical page (of `page_size`
tokens) on every rank; together those form one virtual page. Every release is aligned to this
widened page: aligning to `page_size` alone would free a page that still holds kept tokens on
another rank, or free it twice when the request's tail is released later.

Page 0 is reserved as the null page: it is never handed out, and block-table rows of padding
(and the unused tail of real rows) point at it, so padding never touches a real request's pages.

Prefix caching: a page can belong to the prefix tree instead. A request then *borrows* it (it
is in the request's page list, so in its block table, but `free` does not return it); the tree
gets pages from a request by `adopt` and gives them back with `release_tree_page`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from kimi_linear_jax.cache import CacheLayout

NULL_PAGE = CacheLayout.NULL_PAGE


def block_table_row(pages: Sequence[int], width: int) -> np.ndarray:
    """A request's page ids padded with the null page to `width` (int32)."""
    if len(pages) > width:
        raise ValueError(f"{len(pages)} pages > block-table width {width}")
    row = np.full(width, NULL_PAGE, np.int32)
    row[: len(pages)] = pages
    return row


class OutOfPagesError(RuntimeError):
    """Not enough free pages; nothing was allocated."""


class PageAllocator:
    """Owns the free list and each request's page list, in token order."""

    def __init__(self, num_pages: int, page_size: int, dcp_size: int = 1) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        if page_size < 1 or dcp_size < 1:
            raise ValueError(f"page_size {page_size} and dcp_size {dcp_size} must be >= 1")
        self.layout = CacheLayout(num_pages, page_size, dcp_size)
        self.num_pages = num_pages
        self.page_size = page_size
        self.dcp_size = dcp_size
        # Reversed so that pop() hands out low page ids first (easier to read in tests/dumps).
        self._free: list[int] = list(range(num_pages - 1, NULL_PAGE, -1))
        self._owned: dict[Hashable, list[int]] = {}
        self._borrowed: dict[Hashable, set[int]] = {}  # tree pages in a request's list
        self._tree: set[int] = set()  # pages the prefix tree holds

    @classmethod
    def from_layout(cls, layout: CacheLayout) -> PageAllocator:
        allocator = cls(layout.num_pages, layout.page_size, layout.dcp_size)
        allocator.layout = layout
        return allocator

    @property
    def tokens_per_page(self) -> int:
        return self.layout.tokens_per_page

    @property
    def capacity(self) -> int:
        """Pages that can ever be handed out (all but the null page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - self.num_free

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return self.layout.pages_for(num_tokens)

    def _missing(self, request_id: Hashable, num_tokens: int) -> int:
        have = len(self._owned.get(request_id, ()))
        return max(0, self.pages_for(num_tokens) - have)

    def can_allocate(self, request_id: Hashable, num_tokens: int) -> bool:
        return self._missing(request_id, num_tokens) <= self.num_free

    def allocate(self, request_id: Hashable, num_tokens: int) -> list[int]:
        """Grow the request's pages to hold `num_tokens` tokens in total; return its pages.

        Never shrinks (that is `release_tail`). All or nothing: on failure no page moves.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        missing = self._missing(request_id, num_tokens)
        if missing > self.num_free:
            raise OutOfPagesError(
                f"request {request_id!r} needs {missing} more pages for {num_tokens} tokens "
                f"but only {self.num_free} of {self.capacity} are free"
            )
        pages = self._owned.setdefault(request_id, [])
        pages.extend(self._free.pop() for _ in range(missing))
        return list(pages)

    # ---- prefix tree ---------------------------------------------------------------------

    @property
    def num_tree_pages(self) -> int:
        return len(self._tree)

    @property
    def num_evictable(self) -> int:
        """Tree pages no request borrows: cached, and free to take once evicted."""
        borrowed = set().union(*self._borrowed.values()) if self._borrowed else set()
        return len(self._tree - borrowed)

    def attach_prefix(self, request_id: Hashable, pages: list[int]) -> None:
        """Start a request's page list with tree pages it borrows (a prefix-cache hit)."""
        if request_id in self._owned:
            raise ValueError(f"request {request_id!r} already holds pages")
        if not set(pages) <= self._tree:
            raise ValueError(f"pages {sorted(set(pages) - self._tree)} are not tree pages")
        self._owned[request_id] = list(pages)
        self._borrowed[request_id] = set(pages)

    def adopt(self, request_id: Hashable, page: int) -> None:
        """The tree takes one of the request's own pages; the request keeps using it."""
        if page not in self._pages_of(request_id) or page in self._tree:
            raise ValueError(f"page {page} is not an own page of request {request_id!r}")
        self._tree.add(page)
        self._borrowed.setdefault(request_id, set()).add(page)

    def release_tree_page(self, page: int) -> None:
        """The tree evicts a page no request borrows: it becomes free."""
        if page not in self._tree:
            raise ValueError(f"page {page} is not a tree page")
        if any(page in b for b in self._borrowed.values()):
            raise ValueError(f"page {page} is still borrowed by a request")
        self._tree.remove(page)
        self._free.append(page)

    def _pages_of(self, request_id: Hashable) -> list[int]:
        if request_id not in self._owned:
            raise KeyError(f"request {request_id!r} holds no pages (unknown or already freed)")
        return self._owned[request_id]

    def pages(self, request_id: Hashable) -> list[int]:
        return list(self._pages_of(request_id))

    def release_tail(self, request_id: Hashable, keep_tokens: int) -> list[int]:
        """Free the pages past those that `keep_tokens` tokens need; return the freed pages.

        A page partly used by kept tokens stays. Keeping more tokens than owned frees nothing.
        """
        if keep_tokens < 0:
            raise ValueError(f"keep_tokens must be >= 0, got {keep_tokens}")
        pages = self._pages_of(request_id)
        keep = self.pages_for(keep_tokens)
        tail = pages[keep:]
        if set(tail) & self._borrowed.get(request_id, set()):
            raise ValueError(f"release_tail would free tree pages of request {request_id!r}")
        del pages[keep:]
        self._free.extend(reversed(tail))
        return tail

    def free(self, request_id: Hashable) -> None:
        """Free all pages of the request and forget it; a second free raises KeyError."""
        pages = self._pages_of(request_id)
        del self._owned[request_id]
        borrowed = self._borrowed.pop(request_id, set())
        self._free.extend(p for p in reversed(pages) if p not in borrowed)

    def check_invariants(self) -> None:
        """Every real page is free, held by the tree, or owned by exactly one request (tree pages
        may also be borrowed); raises AssertionError."""
        owned = [
            p
            for rid, pages in self._owned.items()
            for p in pages
            if p not in self._borrowed.get(rid, ())
        ]
        if not all(b <= self._tree for b in self._borrowed.values()):
            raise AssertionError("a request borrows a page the tree does not hold")
        owned += sorted(self._tree)
        if len(set(self._free)) != len(self._free):
            raise AssertionError(f"free list has duplicates: {sorted(self._free)}")
        if len(set(owned)) != len(owned):
            raise AssertionError(f"a page is owned twice: {sorted(owned)}")
        both = set(owned) & set(self._free)
        if both:
            raise AssertionError(f"pages both owned and free: {sorted(both)}")
        every = set(owned) | set(self._free)
        if every != set(range(1, self.num_pages)):
            raise AssertionError(f"pages lost or invalid (null page handed out?): {sorted(every)}")
        if len(owned) != self.num_used:
            raise AssertionError(f"owned {len(owned)} != used {self.num_used}")
