"""Cached entries (prefill, decode, verify + commit) against the no-cache full forward."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_linear_jax.cache import Batch, contiguous_batch, init_cache
from kimi_linear_jax.model import (
    HashedGraph,
    commit_kda,
    decode_step,
    for_serving,
    forward,
    merge,
    prefill_step,
    set_kda_impl,
    split_flat,
)
from kimi_linear_jax.presets import preset
from kimi_linear_jax.testing import random_model
from tests.helpers import assert_close

PAGE = 16
MAX_LEN = 160
# f32 everywhere; chunked vs window recurrences and naive vs absorbed MLA differ only by
# summation order.
TOL = dict(atol=2e-4, rtol_rms=2e-5)


@pytest.fixture(scope="module")
def model():
    cfg = preset("tiny")
    # The chunked KDA prefill on purpose: on CPU 'auto' would pick the recurrent scan, and the
    # chunked form must be exercised against decode and the window path too.
    return cfg, nnx.split(set_kda_impl(random_model(cfg, seed=3), "chunked"))


def fresh_cache(cfg, B):
    n = -(-MAX_LEN // PAGE)
    return init_cache(cfg, num_slots=B + 1, num_pages=B * n, page_size=PAGE, dtype=jnp.float32)


def ids_for(B, T, seed=0):
    return np.random.default_rng(seed).integers(0, 300, (B, T)).astype(np.int32)


@pytest.mark.parametrize("N", [37, 70])
def test_prefill_then_decode_equals_full_forward(model, N):
    """prefill(N) then 5 single-token decodes == logits of the full sequence at each step."""
    cfg, (g, p) = model
    B, steps = 2, 5
    ids = ids_for(B, N + steps, seed=N)
    full = np.asarray(forward(g, p, jnp.asarray(ids)))
    cache = fresh_cache(cfg, B)
    batch = contiguous_batch(B, MAX_LEN, PAGE, lengths=[N, N])
    logits, cache = prefill_step(g, p, jnp.asarray(ids[:, :N]), cache, batch, last_only=True)
    assert_close(logits, full[:, N - 1], **TOL, name="prefill last")
    for s in range(steps):
        pos = N + s
        batch = batch._replace(start=jnp.full((B,), pos, jnp.int32), lengths=jnp.ones(B, jnp.int32))
        logits, cache = decode_step(g, p, jnp.asarray(ids[:, pos : pos + 1]), cache, batch)
        assert_close(logits[:, 0], full[:, pos], **TOL, name=f"decode step {s}")


def test_ragged_prefill_batch(model):
    """Rows of different lengths in one right-padded prefill == each row alone, and each row
    then continues correctly for one decode step. The reference is one full forward over a
    [3, 65] batch: by causality, position n of row b is the logits of its first n + 1 tokens."""
    cfg, (g, p) = model
    lengths = [5, 64, 33]
    ids = ids_for(3, 65, seed=1)
    nxt = ids_for(3, 1, seed=2)[:, 0]
    for b, n in enumerate(lengths):
        ids[b, n] = nxt[b]
    full = np.asarray(forward(g, p, jnp.asarray(ids)))
    cache = fresh_cache(cfg, 3)
    batch = contiguous_batch(3, MAX_LEN, PAGE, lengths=lengths)
    logits, cache = prefill_step(g, p, jnp.asarray(ids[:, :64]), cache, batch, last_only=True)
    batch = batch._replace(start=jnp.asarray(lengths, jnp.int32), lengths=jnp.ones(3, jnp.int32))
    step, _ = decode_step(g, p, jnp.asarray(nxt[:, None]), cache, batch)
    for b, n in enumerate(lengths):
        assert_close(logits[b], full[b, n - 1], **TOL, name=f"row {b} prefill")
        assert_close(step[b, 0], full[b, n], **TOL, name=f"row {b} decode")


def test_chunked_prefill_with_prefix(model):
    """Prefill in two chunks (the second attends to the cached prefix) == one pass."""
    cfg, (g, p) = model
    ids = ids_for(2, 100, seed=4)
    full = np.asarray(forward(g, p, jnp.asarray(ids)))
    cache = fresh_cache(cfg, 2)
    batch = contiguous_batch(2, MAX_LEN, PAGE, lengths=[45, 45])
    _, cache = prefill_step(g, p, jnp.asarray(ids[:, :45]), cache, batch, last_only=True)
    batch = batch._replace(
        start=jnp.full((2,), 45, jnp.int32), lengths=jnp.full((2,), 55, jnp.int32)
    )
    logits, _ = prefill_step(
        g, p, jnp.asarray(ids[:, 45:]), cache, batch, has_prefix=True, last_only=False
    )
    assert_close(logits, full[:, 45:], **TOL, name="second chunk")


@pytest.mark.parametrize("keep", ["states", "inputs"])
def test_window_decode_and_verify_commit(model, keep):
    """A 6-token window: logits == full forward; committing after n tokens (a gather from the
    per-step states, or a replay of the per-step inputs) == decoding n."""
    cfg, (g, p) = model
    N, T = 20, 6
    ids = ids_for(3, N + T, seed=5)
    full = np.asarray(forward(g, p, jnp.asarray(ids)))
    cache = fresh_cache(cfg, 3)
    batch = contiguous_batch(3, MAX_LEN, PAGE, lengths=[N] * 3)
    _, cache = prefill_step(g, p, jnp.asarray(ids[:, :N]), cache, batch)
    win = batch._replace(start=jnp.full((3,), N, jnp.int32), lengths=jnp.full((3,), T, jnp.int32))
    model_ = nnx.merge(g, p)
    verify = jax.jit(functools.partial(model_.verify, keep=keep))
    logits, after, per_step = verify(jnp.asarray(ids[:, N:]), cache, win)
    assert_close(logits, full[:, N:], **TOL, name="verify logits")
    n = [0, 2, T]  # reject all, accept 2, accept all
    committed = commit_kda(after, per_step, win.slots, jnp.asarray(n, jnp.int32))
    # Reference: a ragged prefill of exactly the accepted tokens of each row.
    ref = fresh_cache(cfg, 3)
    rb = contiguous_batch(3, MAX_LEN, PAGE, lengths=[N + k for k in n])
    _, ref = prefill_step(g, p, jnp.asarray(ids[:, : N + T]), ref, rb)
    for layer, (ours, theirs) in enumerate(zip(committed.kda, ref.kda)):
        for field, a, e in zip(ours._fields, ours, theirs):
            assert_close(a, e, atol=1e-5, rtol_rms=1e-5, name=f"kda {layer}.{field}")


def test_padding_rows_and_unowned_pages_untouched(model):
    """A padding row (slot 0, length 0) and pages no row owns come back bit-identical."""
    cfg, (g, p) = model
    cache = fresh_cache(cfg, 2)
    poison = jnp.float32(1e30)
    cache = jax.tree.map(lambda a: jnp.full_like(a, poison), cache)
    batch = Batch(
        slots=jnp.asarray([1, 0], jnp.int32),
        block_table=jnp.asarray([[0, 1, 2, 3], [4, 5, 6, 7]], jnp.int32),
        start=jnp.zeros(2, jnp.int32),
        lengths=jnp.asarray([10, 0], jnp.int32),
    )
    # Row 0 needs a clean state; everything else stays poisoned.
    cache = cache._replace(
        kda=tuple(
            s._replace(**{f: a.at[1].set(0) for f, a in s._asdict().items()}) for s in cache.kda
        )
    )
    before = jax.tree.map(np.asarray, cache)
    logits, out = prefill_step(g, p, jnp.asarray(ids_for(2, 16)), cache, batch)
    assert np.all(np.isfinite(np.asarray(logits[0])))
    for a, b in zip(jax.tree.leaves(out.mla), jax.tree.leaves(before.mla)):
        np.testing.assert_array_equal(np.asarray(a)[1:], b[1:])  # only page 0 was written
    for a, b in zip(jax.tree.leaves(out.kda), jax.tree.leaves(before.kda)):
        np.testing.assert_array_equal(np.asarray(a)[2:], b[2:])  # slots past 1 untouched


def test_for_serving_copy(model):
    """The engine's model (`for_serving`: W_UK / W_UV split out of kv_b_proj) decodes the same
    logits (the same products of the same values; only XLA's choice of kernel may differ)
    over the same parameter arrays, and leaves the model it copies as it
    was (only nnx.Param state, so training and Orbax restores can still split it)."""
    cfg, (g, p) = model
    original = nnx.merge(g, p)
    serving = for_serving(original)
    assert jax.tree.structure(nnx.state(original)) == jax.tree.structure(p)
    nnx.split(original, nnx.Param)  # raises if the copy's arrays leaked into the original
    assert jax.tree.structure(nnx.state(serving, nnx.Param)) == jax.tree.structure(p)
    for a, b in zip(jax.tree.leaves(nnx.state(serving, nnx.Param)), jax.tree.leaves(p)):
        assert a is b
    B, N = 2, 21
    ids = jnp.asarray(ids_for(B, N + 1, seed=7))
    batch = contiguous_batch(B, MAX_LEN, PAGE, lengths=[N, N - 4])
    step = batch._replace(start=jnp.asarray([N, N - 4], jnp.int32), lengths=jnp.ones(B, jnp.int32))
    out = []
    for graphdef, params in (nnx.split(original), nnx.split(serving)):
        _, cache = prefill_step(graphdef, params, ids[:, :N], fresh_cache(cfg, B), batch)
        out.append(np.asarray(decode_step(graphdef, params, ids[:, N:], cache, step)[0]))
    assert_close(out[1], out[0], atol=1e-6, rtol_rms=1e-7, name="decode logits")


def test_split_flat_merges_back_to_the_same_model():
    """The serving steps take the state as a flat list (`split_flat`): merged back it is the
    model, and its graph (with the state's structure) is interned apart from the bare one."""
    model = random_model(preset("tiny"), seed=1)
    graph, leaves = split_flat(model)
    assert isinstance(leaves, list) and all(isinstance(x, jax.Array) for x in leaves)
    # The same graph and the same arrays: the same model (compared without running it eagerly,
    # which cost 20 s of op-by-op dispatch).
    merged = merge(graph, leaves)
    assert nnx.graphdef(merged) == nnx.graphdef(model)
    want = jax.tree.leaves(nnx.state(model))
    got = jax.tree.leaves(nnx.state(merged))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert split_flat(random_model(preset("tiny"), seed=2))[0] is graph
    assert HashedGraph(graph.graphdef) is not graph and HashedGraph(graph.graphdef) != graph


def test_equal_graphdefs_share_one_hashed_graph():
    """jit compares a static argument with its cached key by identity, else with ==, which
    walks a whole graphdef: equal graphdefs (two engines over one model) must be one object."""
    first = nnx.split(random_model(preset("tiny"), seed=1))[0]
    same = nnx.split(random_model(preset("tiny"), seed=2))[0]  # other weights, same graph
    other = nnx.split(
        random_model(preset("tiny", num_hidden_layers=2, kda_layers=(1,), full_attn_layers=(2,)))
    )[0]
    assert first is not same and first == same
    assert HashedGraph(first) is HashedGraph(same)
    assert HashedGraph(other) is not HashedGraph(first)
    assert HashedGraph(other).graphdef is other
