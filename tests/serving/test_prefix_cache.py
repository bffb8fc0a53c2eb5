"""Prefix caching for the hybrid model: the checkpoint grid, the radix tree's bookkeeping
(host only), and engine outputs with the cache on == off for shared-prefix workloads, with the
hit counted (a test that never hits fails).

Engine tests share one set of shapes (SHAPES) so the jitted steps compile once.
"""

from __future__ import annotations

import pytest

from kimi_linear_jax.cache import CacheLayout
from kimi_linear_jax.presets import preset
from kimi_linear_jax.testing import random_model
from serving.core.allocator import PageAllocator
from serving.core.prefix_cache import PrefixCache, branching_depth, checkpoint_depth
from serving.core.sampling import SamplingParams
from serving.core.track import checkpoint_grid, resolve_track_interval
from serving.engine import LLM

# ---- the checkpoint grid -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tree_page", "depth"),
    [(64, 20416), (256, 20224), (512, 19968)],  # the last: dcp 8, page 64
)
def test_checkpoint_depth_worked_example(tree_page, depth):
    assert checkpoint_depth(16384, 4066, 64, tree_page) == depth


def test_checkpoint_depth_none_when_not_past_the_prefix():
    assert checkpoint_depth(128, 50, 64, 64) is None  # 178 -> 128, not past the prefix
    assert checkpoint_depth(0, 63, 64, 16) is None
    assert checkpoint_depth(0, 64, 64, 16) == 64
    assert branching_depth(300, 64, 256) == 256 and branching_depth(250, 64, 16) == 192


def _smallest_common_multiple(a: int, b: int) -> int:
    return next(d for d in range(max(a, b), a * b + 1) if d % a == 0 and d % b == 0)


@pytest.mark.parametrize(("page_size", "dcp"), [(48, 3), (48, 1), (96, 3), (16, 4)])
def test_checkpoint_grid_for_sizes_not_powers_of_two(page_size, dcp):
    """The grid is the least common multiple of the state chunk (max(64, page_size)) and the
    tree page (page_size * dcp), not the larger of the two: page 48 at dcp 3 gives
    lcm(64, 144) = 576, where 144 (a tree page) has no chunked-prefill state."""
    want = _smallest_common_multiple(max(64, page_size), page_size * dcp)
    assert CacheLayout(2, page_size, dcp).checkpoint_grid == want
    assert checkpoint_grid(page_size, dcp) == want
    assert resolve_track_interval(None, page_size, dcp) == want
    assert PrefixCache(PageAllocator(4, page_size, dcp), range(1, 2)).grid == want
    if (page_size, dcp) == (48, 3):
        assert want == 576  # 2**6 * 3**2


# ---- the tree on the host ----------------------------------------------------------------------


def tree(num_pages=16, slots=2):
    alloc = PageAllocator(num_pages, page_size=4)
    return alloc, PrefixCache(alloc, range(10, 10 + slots))


def donate(alloc, cache, rid, tokens, depth):
    """A request computed `tokens`, donates [0, depth) with a checkpoint, then finishes."""
    alloc.allocate(rid, len(tokens))
    cache.insert(rid, tokens[:depth], cache.acquire_slot())
    cache.release(rid)
    alloc.free(rid)


def test_lookup_returns_the_deepest_checkpoint_and_borrows_pages():
    alloc, cache = tree()
    seq = list(range(100, 120))
    donate(alloc, cache, "a", seq, 8)
    donate(alloc, cache, "b", seq, 16)  # the first 8 tokens' nodes exist: b's pages stay b's
    alloc.check_invariants()
    assert alloc.num_tree_pages == 4 and alloc.num_free == 15 - 4
    hit = cache.lookup(seq[:18])
    assert (hit.depth, hit.kv_depth, len(hit.pages)) == (16, 16, 4)
    cache.borrow("c", hit)
    alloc.allocate("c", 20)
    alloc.check_invariants()
    assert alloc.pages("c")[:4] == hit.pages
    assert cache.evict_pages(4) == 0  # locked while "c" runs
    cache.end_step([hit])
    cache.release("c")
    alloc.free("c")
    alloc.check_invariants()
    assert alloc.num_free == 15 - 4  # c's own page came back, the tree's stayed
    # The last token is always left to compute: a 16-token prompt hits depth 8 at most.
    assert cache.lookup(seq[:16]).depth == 8


def peek(cache, tokens):
    """A lookup whose restore is done at once (unlocks the checkpoint again)."""
    hit = cache.lookup(tokens)
    cache.end_step([hit])
    return hit


def test_checkpoint_eviction_keeps_kv_and_lru_page_eviction():
    alloc, cache = tree(slots=2)
    a, b, c = (list(range(s, s + 8)) for s in (0, 50, 200))
    donate(alloc, cache, "a", a, 8)
    donate(alloc, cache, "b", b, 8)
    locked = cache.lookup(a + [1])  # touch a: b is now least recently used
    donate(alloc, cache, "c", c, 8)  # no free slot: b's checkpoint goes, its KV stays
    assert cache.stats["evicted_checkpoints"] == 1
    assert peek(cache, b + [1]).depth == 0 and peek(cache, b + [1]).kv_depth == 8
    assert peek(cache, a + [1]).depth == 8
    # A checkpoint being restored this step is not evicted; after end_step it may be.
    assert cache.acquire_slot() is not None  # evicts c's (a's is locked)
    assert peek(cache, c + [1]).depth == 0 and peek(cache, a + [1]).depth == 8
    cache.end_step([locked])
    # Pages: LRU leaves go first (b's chain was touched by the lookups just now, then a).
    assert cache.evict_pages(2) == 2
    alloc.check_invariants()
    assert cache.clear() == 4 and alloc.num_free == alloc.capacity
    assert cache.num_free_slots == 1  # the other was taken by acquire_slot above


# ---- the engine: cache on == cache off ----------------------------------------------------------

SYSTEM = [(7 * i) % 250 + 1 for i in range(150)]
QUESTIONS = [[200 + q, 201, 202 + q] for q in range(3)]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SHAPES = dict(
    num_pages=64,
    page_size=4,
    max_num_seqs=4,
    batch_buckets=(4,),
    token_buckets=(64,),
    max_num_batched_tokens=64,
    chunk_size=64,
)


@pytest.fixture(scope="module")
def model():
    return random_model(preset("tiny"))


@pytest.fixture(scope="module")
def reference(model):
    """Each prompt alone on an engine without prefix caching."""
    llm = LLM(model, enable_prefix_caching=False, **SHAPES)
    prompts = [SYSTEM + q for q in QUESTIONS]
    return {tuple(p): llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in prompts}


def ref_of(llm_off_cache, prompt):
    llm_off_cache.reset_prefix_cache()
    return llm_off_cache.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids


def assert_drained(llm):
    assert llm.reset_prefix_cache()
    assert llm.cache.allocator.num_free == llm.cache.allocator.capacity
    llm.cache.allocator.check_invariants()
    assert llm.cache.state_pool.num_free == llm.cache.state_pool.num_slots - 1


def test_shared_system_prompt_hits_and_matches(model, reference):
    llm = LLM(model, **SHAPES)
    prompts = [SYSTEM + q for q in QUESTIONS]
    (first,) = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    assert first.num_cached_tokens == 0
    before = llm.metrics()["prefill_tokens"]
    outs = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert [first.token_ids] + [o.token_ids for o in outs] == [reference[tuple(p)] for p in prompts]
    # 153 tokens donate a checkpoint at 128 (grid lcm(64, 4)); each hit prefills the rest.
    assert [o.num_cached_tokens for o in outs] == [128, 128]
    assert llm.metrics()["prefill_tokens"] - before == sum(len(p) - 128 for p in prompts[1:])
    m = llm.metrics()
    assert m["prefix_cache_hit_tokens"] == 256 and m["prefix_cache_hit_rate"] > 0
    # Idle: the cached prefix pages are counted apart, not as used (issue 36): no request
    # holds a page, and the cached ones are what the allocator does not have free.
    assert m["pages_used"] == 0 and m["pages_cached"] == m["prefix_cache_pages"] > 0
    assert m["pages_cached"] == llm.cache.allocator.capacity - llm.cache.allocator.num_free
    assert_drained(llm)


def test_multi_turn_chat_hits_the_decode_snapshot(model):
    """Turn 2 = turn 1's prompt + its output + a new message. The first turn's sequence passes
    192 tokens while decoding: the decode-time snapshot at 192 (track interval 64) is hit."""
    llm = LLM(model, **SHAPES)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    turn1 = SYSTEM
    (out1,) = llm.generate([turn1], params, use_tqdm=False)
    turn2 = turn1 + out1.token_ids + [9, 8, 7]
    (out2,) = llm.generate([turn2], GREEDY, use_tqdm=False)
    assert out2.num_cached_tokens == 192
    assert out2.token_ids == ref_of(llm, turn2)
    assert_drained(llm)


# 28 s; the default run has prefix hits with DCP and n-gram speculation on a mesh
# (test_engine_parallel).
@pytest.mark.heavy
def test_dcp4_and_speculation_with_cache(model, reference):
    prompts = [SYSTEM + q for q in QUESTIONS]
    expected = [reference[tuple(p)] for p in prompts]
    for kw in (dict(dcp_size=4), dict(speculative={"method": "ngram", "num_draft_tokens": 4})):
        llm = LLM(model, **{**SHAPES, **kw})
        got = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
        assert [o.token_ids for o in got] == expected, kw
        assert [o.num_cached_tokens for o in got] == [0, 128, 128], kw
        assert_drained(llm)


def test_fused_decode_beside_a_prefill_donates_where_its_step_ends(model):
    """Fused decode (4 steps) plans a snapshot where its steps end on a track point; a step
    that also prefills runs one decode step per row. A (60 tokens) and C (63) decode while
    B's 80 tokens prefill in chunks: A's fused steps would end on 64, a depth that step does
    not reach (keeping its snapshot failed the step, and every request in it), while C's one
    step does end on 64 and keeps its snapshot. Both donate a checkpoint at 64."""
    llm = LLM(model, num_scheduler_steps=4, **SHAPES)
    a = [(7 * i) % 250 + 3 for i in range(60)]
    c = [(13 * i) % 230 + 4 for i in range(63)]
    b = [(11 * i) % 240 + 5 for i in range(80)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([a, c, b], params, use_tqdm=False)
    assert [o.error for o in outs] == [None, None, None]
    plain = LLM(model, enable_prefix_caching=False, **SHAPES)
    assert [o.token_ids for o in outs] == [
        o.token_ids for o in plain.generate([a, c, b], params, use_tqdm=False)
    ]
    for prompt, out in zip((a, c), outs, strict=False):
        hit = llm.cache.prefix_cache.lookup(prompt + out.token_ids)
        llm.cache.prefix_cache.end_step([hit])  # a look only: unlock its checkpoint
        assert hit.depth == 64 and hit.checkpoint is not None, len(prompt)
    assert_drained(llm)


def test_eviction_under_a_small_pool_keeps_outputs(model):
    """Two 200-token prompts: the first donates 48 pages of 63, the second needs 51, so the
    tree gives pages back; outputs stay those of a cold engine."""
    llm = LLM(model, **SHAPES)
    a = [(3 * i) % 240 + 1 for i in range(200)]
    b = [(5 * i) % 230 + 2 for i in range(200)]
    out_a = llm.generate([a], GREEDY, use_tqdm=False)[0].token_ids
    out_b = llm.generate([b], GREEDY, use_tqdm=False)[0].token_ids
    assert llm.metrics()["prefix_cache_evicted_pages"] > 0
    llm.cache.allocator.check_invariants()
    assert out_a == ref_of(llm, a) and out_b == ref_of(llm, b)
    assert_drained(llm)


# `tiny` with counts that TP 3 divides (DCP is a subgroup of TP, so dcp 3 needs tp 3).
TP3 = dict(
    vocab_size=324,
    num_attention_heads=6,
    linear_num_heads=6,
    num_experts=6,
    intermediate_size=96,
    moe_intermediate_size=24,
)


@pytest.mark.slow  # a fresh TP 3 x DCP 3 engine: about 17 s of compiling on CPU
def test_decode_snapshot_hit_on_the_grid_at_page_48_dcp_3():
    """page_size 48, dcp 3: tree page 144, grid lcm(64, 144) = 576. Turn 1 (700 prompt tokens)
    donates its prefill state at 576 and decodes past 720, a tree-page boundary but not a grid
    depth, so no decode snapshot; turn 2 (turn 1 + its output + 3 tokens) hits at 576 and its
    output equals a cold run's."""
    model = random_model(preset("tiny", **TP3))
    llm = LLM(
        model,
        page_size=48,
        tensor_parallel_size=3,
        dcp_size=3,
        num_pages=16,
        max_num_seqs=1,
        batch_buckets=(1,),
        token_buckets=(256,),
        max_num_batched_tokens=256,
        chunk_size=256,
    )
    assert llm.track_interval == 576
    turn1 = [(7 * i) % 250 + 1 for i in range(700)]
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    (out1,) = llm.generate([turn1], params, use_tqdm=False)
    turn2 = turn1 + out1.token_ids + [9, 8, 7]
    assert len(turn2) > 720
    (out2,) = llm.generate([turn2], GREEDY, use_tqdm=False)
    assert out2.num_cached_tokens == 576
    assert out2.token_ids == ref_of(llm, turn2)
    assert_drained(llm)
