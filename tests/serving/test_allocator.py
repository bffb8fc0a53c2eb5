"""PageAllocator: growth, padding, all-or-nothing failure, DCP-aligned tail release, no leaks."""

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from serving.core.allocator import NULL_PAGE, OutOfPagesError, PageAllocator, block_table_row


def test_allocate_grows_and_never_hands_out_null_page():
    a = PageAllocator(num_pages=8, page_size=4)
    assert a.capacity == 7 and a.num_free == 7
    assert len(a.allocate("r", 1)) == 1
    assert len(a.allocate("r", 4)) == 1  # still fits in the first page
    pages = a.allocate("r", 9)
    assert len(pages) == 3 and NULL_PAGE not in pages
    assert a.allocate("r", 2) == pages  # allocate never shrinks
    assert a.num_used == 3 and a.num_free == 4
    a.check_invariants()


def test_allocate_zero_tokens_registers_request():
    a = PageAllocator(num_pages=4, page_size=4)
    assert a.allocate("r", 0) == []
    assert a.pages("r") == []
    a.free("r")


def test_block_table_row_pads_with_null_page():
    a = PageAllocator(num_pages=8, page_size=4)
    a.allocate("x", 4)
    pages = a.allocate("r", 10)
    row = block_table_row(a.pages("r"), 6)
    assert row.dtype == np.int32
    assert row.tolist() == pages + [NULL_PAGE] * 3
    with pytest.raises(ValueError, match="width 2"):
        block_table_row(a.pages("r"), 2)


def test_out_of_pages_names_counts_and_allocates_nothing():
    a = PageAllocator(num_pages=5, page_size=4)  # 4 usable pages
    before = a.allocate("r", 8)
    assert not a.can_allocate("r", 24)
    with pytest.raises(OutOfPagesError, match=r"needs 4 more pages .* only 2 of 4 are free"):
        a.allocate("r", 24)
    assert a.pages("r") == before and a.num_free == 2
    with pytest.raises(OutOfPagesError):
        a.allocate("new", 100)
    with pytest.raises(KeyError):
        a.pages("new")  # a failed first allocation leaves no trace
    assert a.can_allocate("r", 16)
    a.check_invariants()


def test_release_tail_dcp1():
    a = PageAllocator(num_pages=10, page_size=16)
    pages = a.allocate("r", 80)  # 5 pages
    assert a.release_tail("r", 33) == pages[3:]  # 33 tokens need 3 pages
    assert a.pages("r") == pages[:3]
    assert a.release_tail("r", 48) == []  # exactly 3 pages: nothing more to free
    assert a.release_tail("r", 1000) == []
    assert a.release_tail("r", 0) == pages[:3]
    assert a.num_free == a.capacity
    a.check_invariants()


def test_release_tail_aligns_to_dcp_widened_page():
    a = PageAllocator(num_pages=10, page_size=16, dcp_size=4)
    assert a.tokens_per_page == 64
    pages = a.allocate("r", 64 * 4)
    assert len(pages) == 4
    freed = a.release_tail("r", 65)
    assert a.pages("r") == pages[:2] and freed == pages[2:]
    a.release_tail("r", 64)
    assert a.pages("r") == pages[:1]
    a.check_invariants()


def test_free_twice_and_unknown_raise_key_error():
    a = PageAllocator(num_pages=4, page_size=4)
    a.allocate("r", 5)
    a.free("r")
    with pytest.raises(KeyError, match="'r'"):
        a.free("r")
    with pytest.raises(KeyError, match="'ghost'"):
        a.free("ghost")
    with pytest.raises(KeyError):
        a.release_tail("ghost", 0)
    assert a.num_free == a.capacity


def test_freed_pages_are_reused():
    a = PageAllocator(num_pages=3, page_size=4)
    first = a.allocate("a", 8)
    a.free("a")
    assert sorted(a.allocate("b", 8)) == sorted(first)


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate / grow / release_tail / free against a model of tokens kept per request."""

    DCP = 1
    PAGE_SIZE = 4
    NUM_PAGES = 24

    def __init__(self):
        super().__init__()
        self.alloc = PageAllocator(self.NUM_PAGES, self.PAGE_SIZE, self.DCP)
        self.tokens: dict[int, int] = {}  # request -> tokens its pages must hold
        self.tpp = self.PAGE_SIZE * self.DCP
        self.max_tokens = self.tpp * 10

    def _pages_needed(self, tokens):
        return -(-tokens // self.tpp)

    @rule(rid=st.integers(0, 5), data=st.data())
    def allocate(self, rid, data):
        n = data.draw(st.integers(0, self.max_tokens), label="num_tokens")
        before = self.alloc.pages(rid) if rid in self.tokens else None
        free_before = self.alloc.num_free
        expect_ok = self.alloc.can_allocate(rid, n)
        try:
            self.alloc.allocate(rid, n)
        except OutOfPagesError:
            assert not expect_ok
            assert self.alloc.num_free == free_before
            if before is None:
                with pytest.raises(KeyError):
                    self.alloc.pages(rid)
            else:
                assert self.alloc.pages(rid) == before
            return
        assert expect_ok
        self.tokens[rid] = max(self.tokens.get(rid, 0), n)
        if before is not None:
            assert self.alloc.pages(rid)[: len(before)] == before  # growth keeps the prefix

    @rule(rid=st.integers(0, 5), data=st.data())
    def release_tail(self, rid, data):
        keep = data.draw(st.integers(0, self.max_tokens), label="keep_tokens")
        if rid not in self.tokens:
            with pytest.raises(KeyError):
                self.alloc.release_tail(rid, keep)
            return
        before = self.alloc.pages(rid)
        freed = self.alloc.release_tail(rid, keep)
        assert before == self.alloc.pages(rid) + freed
        self.tokens[rid] = min(self.tokens[rid], keep)

    @rule(rid=st.integers(0, 5))
    def free(self, rid):
        if rid not in self.tokens:
            with pytest.raises(KeyError):  # unknown or double free
                self.alloc.free(rid)
            return
        self.alloc.free(rid)
        del self.tokens[rid]

    @invariant()
    def consistent(self):
        self.alloc.check_invariants()
        expected = sum(self._pages_needed(t) for t in self.tokens.values())
        assert self.alloc.num_used == expected  # no leak, nothing freed too early
        for rid, t in self.tokens.items():
            assert len(self.alloc.pages(rid)) == self._pages_needed(t)

    def teardown(self):
        for rid in list(self.tokens):
            self.alloc.free(rid)
        self.alloc.check_invariants()
        assert self.alloc.num_free == self.alloc.capacity


class AllocatorMachineDcp4(AllocatorMachine):
    DCP = 4


_settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestAllocatorStatefulDcp1 = AllocatorMachine.TestCase
TestAllocatorStatefulDcp1.settings = _settings
TestAllocatorStatefulDcp4 = AllocatorMachineDcp4.TestCase
TestAllocatorStatefulDcp4.settings = _settings
