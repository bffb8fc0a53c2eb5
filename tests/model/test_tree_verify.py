"""Tree-shaped verify windows (`ops/tree.py`, `model.verify_tree`, `model.write_latents`)
against chain windows: every node equals a chain verify of its root-to-node path from the
same cache, and a committed tree path equals the same path verified as a chain."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kernels.mla_reference import gather_pages
from kimi_linear_jax.cache import KDAState, ModelCache, contiguous_batch
from kimi_linear_jax.layers.short_conv import (
    causal_conv,
    tree_conv,
    window_after_each_node,
    window_after_each_step,
)
from kimi_linear_jax.model import commit_kda, for_serving, merge
from kimi_linear_jax.ops import kda as kda_ops
from kimi_linear_jax.ops import tree as tree_ops
from kimi_linear_jax.parallel.mesh import Parallel, make_parallel
from kimi_linear_jax.parallel.rules import init_cache, shard_model
from kimi_linear_jax.parallel.target_plan import gpu_backend
from kimi_linear_jax.presets import preset
from kimi_linear_jax.testing import random_model
from tests.helpers import abstract_gpu, assert_close
from tests.kernels.dcp_helpers import cache_from_dcp_layout

CFG = preset("tiny")
B, T, PAGE, MAX_LEN = 3, 8, 8, 48
PROMPT = np.array([11, 6, 0])  # cached tokens per row; row 2 is a padding row
# Row 0: branches 0-1-2-3, 0-4-5, 0-1-6-7. Row 1: 0-1, 0-2-3-5, 0-2-4, nodes 6, 7 padding
# (still valid parents). Row 2: padding (length 0).
PARENTS = np.array(
    [[-1, 0, 1, 2, 0, 4, 1, 6], [-1, 0, 0, 2, 2, 3, 0, 0], [-1, 0, 1, 2, 3, 4, 5, 6]], np.int32
)
LENGTHS = np.array([8, 6, 0])
CHAIN = np.broadcast_to(np.arange(T, dtype=np.int32) - 1, (B, T))
# A path of a non-first branch per row (row 2: none).
ACCEPT = [[0, 4, 5], [0, 2, 4], []]
# Chain verify vs tree: the same ops but for the MLA softmax split into prefix and window.
TOL = dict(atol=2e-5, rtol_rms=2e-6)
EXACT = dict(atol=0.0, rtol_rms=0.0)


# ---- the helpers on their own -------------------------------------------------------------


def paths(parents, n):
    """Root-to-node path of every node i < n (numpy, by definition)."""
    out = []
    for i in range(n):
        path = [i]
        while parents[path[-1]] >= 0:
            path.append(int(parents[path[-1]]))
        out.append(path[::-1])
    return out


def test_ancestors_depths_visibility():
    anc = np.asarray(tree_ops.ancestors(jnp.asarray(PARENTS)))
    dep = np.asarray(tree_ops.depths(jnp.asarray(PARENTS)))
    vis = np.asarray(tree_ops.visibility(jnp.asarray(PARENTS)))
    for b in range(B):
        for i, path in enumerate(paths(PARENTS[b], T)):
            want = path[::-1] + [-1] * (T - len(path))
            np.testing.assert_array_equal(anc[b, i], want)
            assert dep[b, i] == len(path) - 1
            np.testing.assert_array_equal(np.flatnonzero(vis[b, i]), sorted(path))


def test_tree_conv_and_kda_equal_chains():
    """Chain trees give causal_conv / window_after_each_step / kda_window exactly; each node
    of a branchy tree gives those of a chain over its path."""
    rng = np.random.default_rng(0)
    W, P_, H, K = 4, 6, 2, 4
    x = jnp.asarray(rng.standard_normal((B, T, P_)), jnp.float32)
    window = jnp.asarray(rng.standard_normal((B, W - 1, P_)), jnp.float32)
    weight = jnp.asarray(rng.standard_normal((P_, 1, W)), jnp.float32)
    unit = lambda a: a / jnp.linalg.norm(a, axis=-1, keepdims=True)
    q, k = (unit(jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.float32)) for _ in "qk")
    v = jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.01, 0.5, (B, T, H, K)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, (B, T, H)), jnp.float32)
    s0 = jnp.asarray(rng.standard_normal((B, H, K, K)), jnp.float32)
    chain = jnp.asarray(CHAIN)
    idx = tree_ops.conv_index(chain, W)
    np.testing.assert_array_equal(
        idx, np.broadcast_to(np.arange(T)[:, None] + np.arange(W), idx.shape)
    )
    np.testing.assert_array_equal(tree_conv(x, window, weight, idx), causal_conv(x, window, weight))
    np.testing.assert_array_equal(
        window_after_each_node(window, x, idx), window_after_each_step(window, x)
    )
    o_t, s_t = tree_ops.kda_tree_window(q, k, v, g, beta, s0, chain)
    o_c, s_c = kda_ops.kda_window(q, k, v, g, beta, s0)
    assert_close(o_t, o_c, atol=1e-6, rtol_rms=1e-7, name="chain o")
    assert_close(s_t, s_c, atol=1e-6, rtol_rms=1e-7, name="chain states")

    tree = jnp.asarray(PARENTS)
    idx = tree_ops.conv_index(tree, W)
    conv, wins = tree_conv(x, window, weight, idx), window_after_each_node(window, x, idx)
    o_t, s_t = tree_ops.kda_tree_window(q, k, v, g, beta, s0, tree)
    # The references in one batched call: a chain per node over its path, right padded (a
    # chain's step d does not see the steps after it), read at the node's depth.
    node_paths = [q_ for b in range(B) for q_ in paths(PARENTS[b], T)]
    rb = np.repeat(np.arange(B), T)[:, None]
    pidx = np.array([q_ + q_[-1:] * (T - len(q_)) for q_ in node_paths])
    d = np.array([len(q_) - 1 for q_ in node_paths])
    at = lambda a: np.asarray(a)[np.arange(B * T), d].reshape(B, T, *a.shape[2:])
    sel = lambda a: a[rb, pidx]
    assert_close(conv, at(causal_conv(sel(x), window[rb[:, 0]], weight)), **EXACT, name="conv")
    ref_wins = at(window_after_each_step(window[rb[:, 0]], sel(x)))
    np.testing.assert_array_equal(wins, ref_wins)
    o_c, s_c = kda_ops.kda_window(*map(sel, (q, k, v, g, beta)), s0[rb[:, 0]])
    assert_close(o_t, at(o_c), atol=1e-6, rtol_rms=1e-6, name="tree o")
    assert_close(s_t, at(s_c), atol=1e-6, rtol_rms=1e-6, name="tree states")


# ---- the model ------------------------------------------------------------------------------


@functools.cache
def base():
    return random_model(CFG, seed=3)


def ids_for(seed, shape):
    return np.random.default_rng(seed).integers(0, 300, shape).astype(np.int32)


@functools.partial(jax.jit, static_argnums=0)
def prefill(g, p, ids, cache, batch):
    return merge(g, p).prefill(ids, cache, batch)[1]


@functools.partial(jax.jit, static_argnums=0)
def tree_verify(g, p, ids, parents, cache, batch):
    return merge(g, p).verify_tree(ids, parents, cache, batch)


@functools.partial(jax.jit, static_argnums=0)
def chain_verify(g, p, ids, cache, batch):
    return merge(g, p).verify(ids, cache, batch, keep="states")


@functools.partial(jax.jit, static_argnums=0)
def decode(g, p, ids, cache, batch):
    return merge(g, p).decode(ids, cache, batch)


@functools.partial(jax.jit, static_argnums=0)
def write_latents(g, p, cache, rows, batch):
    return merge(g, p).write_latents(cache, rows, batch)


@functools.cache
def setup():
    """(graphdef, params, cache with each row's prompt, the window's batch, window ids)."""
    g, p = nnx.split(base())
    n = -(-MAX_LEN // PAGE)
    cache = init_cache(
        CFG, Parallel(), num_slots=B + 1, num_pages=B * n, page_size=PAGE, dtype=jnp.float32
    )
    batch = contiguous_batch(B, MAX_LEN, PAGE, lengths=PROMPT)
    cache = prefill(g, p, jnp.asarray(ids_for(1, (B, 16))), cache, batch)
    win = batch._replace(
        slots=jnp.asarray([1, 2, 0], jnp.int32),
        start=jnp.asarray(PROMPT, jnp.int32),
        lengths=jnp.asarray(LENGTHS, jnp.int32),
    )
    return g, p, cache, win, jnp.asarray(ids_for(2, (B, T)))


def cached_rows(cache, batch, b, n):
    """The latent rows of positions start[b] .. start[b] + n - 1 of row b, per MLA layer."""
    s = int(batch.start[b])
    return [gather_pages(m.latent, batch.block_table)[b, s : s + n] for m in cache.mla]


def test_chain_tree_equals_verify():
    g, p, cache, win, ids = setup()
    logits, same, per_step, rows = tree_verify(g, p, ids, jnp.asarray(CHAIN), cache, win)
    want, written, want_steps = chain_verify(g, p, ids, cache, win)
    assert jax.tree.all(jax.tree.map(lambda a, b: a is b or np.array_equal(a, b), same, cache))
    for b, n in enumerate(LENGTHS[:2]):
        assert_close(logits[b, :n], want[b, :n], **TOL, name=f"logits {b}")
        for layer, (ours, theirs) in enumerate(zip(per_step, want_steps)):
            for field, a, e in zip(KDAState._fields, ours, theirs):
                assert_close(a[b, :n], e[b, :n], **TOL, name=f"kda {layer}.{field} {b}")
        for layer, (r, e) in enumerate(zip(rows, cached_rows(written, win, b, n))):
            assert_close(r[b, :n], e, atol=1e-6, rtol_rms=1e-7, name=f"rows {layer} {b}")


def path_ids(ids, leaf_paths):
    """Window ids and lengths of one chain verify per row (its path, right padded)."""
    out = np.zeros((B, T), np.int32)
    for b, path in enumerate(leaf_paths):
        out[b, : len(path)] = np.asarray(ids)[b, path]
    return jnp.asarray(out), jnp.asarray([len(q) for q in leaf_paths], jnp.int32)


def leaves(b):
    """The root-to-leaf paths of row b's valid nodes."""
    n = LENGTHS[b]
    inner = {int(PARENTS[b, i]) for i in range(1, n)}
    return [q for i, q in enumerate(paths(PARENTS[b], n)) if i not in inner]


def test_branchy_tree_nodes_equal_chains_of_their_paths():
    """Every valid node of two different trees == a chain verify of its root-to-node path."""
    g, p, cache, win, ids = setup()
    logits, _, per_step, rows = tree_verify(g, p, ids, jnp.asarray(PARENTS), cache, win)
    by_row = [leaves(b) for b in range(B)]
    checked = set()
    for k in range(max(map(len, by_row))):
        chosen = [ls[k] if k < len(ls) else [] for ls in by_row]
        chain_ids, n = path_ids(ids, chosen)
        want, written, steps = chain_verify(g, p, chain_ids, cache, win._replace(lengths=n))
        for b, path in enumerate(chosen):
            for d, i in enumerate(path):
                checked.add((b, i))
                assert_close(logits[b, i], want[b, d], **TOL, name=f"logits {b}.{i}")
                for layer, (ours, theirs) in enumerate(zip(per_step, steps)):
                    for field, a, e in zip(KDAState._fields, ours, theirs):
                        assert_close(a[b, i], e[b, d], **TOL, name=f"kda {layer}.{field} {b}.{i}")
            if not path:
                continue
            mla = cached_rows(written, win, b, len(path))
            for layer, (r, e) in enumerate(zip(rows, mla)):
                assert_close(
                    r[b, np.array(path)], e, atol=1e-6, rtol_rms=1e-7, name=f"rows {layer} {b}"
                )
    assert checked == {(b, i) for b in range(B) for i in range(LENGTHS[b])}


def test_branches_do_not_see_each_other():
    """Changing one node's token changes it and its descendants only, bit for bit."""
    g, p, cache, win, ids = setup()
    parents = jnp.asarray(PARENTS)
    before = np.asarray(tree_verify(g, p, ids, parents, cache, win)[0])
    changed = {0: 4, 1: 2}  # row: node
    new = np.asarray(ids).copy()
    for b, i in changed.items():
        new[b, i] = (new[b, i] + 7) % 300
    after = np.asarray(tree_verify(g, p, jnp.asarray(new), parents, cache, win)[0])
    for b, i in changed.items():
        for j, path in enumerate(paths(PARENTS[b], LENGTHS[b])):
            if i in path:
                assert not np.allclose(after[b, j], before[b, j]), (b, j)
            else:
                np.testing.assert_array_equal(after[b, j], before[b, j], err_msg=f"{b}.{j}")


def commit_path(g, p, cache, win, ids, parents, accept):
    """verify_tree, then commit `accept` (a path per row) as the serving side does: KDA by
    commit_kda of its last node + 1, MLA by write_latents of the path's rows."""
    _, _, per_step, rows = tree_verify(g, p, ids, parents, cache, win)
    last = jnp.asarray([q[-1] + 1 if q else 0 for q in accept], jnp.int32)
    cache = commit_kda(cache, per_step, win.slots, last)
    index = np.zeros((B, T), np.int32)
    for b, q in enumerate(accept):
        index[b, : len(q)] = q
    path_rows = tuple(jnp.take_along_axis(r, jnp.asarray(index)[..., None], axis=1) for r in rows)
    n = jnp.asarray([len(q) for q in accept], jnp.int32)
    return write_latents(g, p, cache, path_rows, win._replace(lengths=n)), n


def test_committed_branch_equals_chain_then_decodes_alike():
    """Commit a non-first branch, then decode a token: the same as verifying that path as a
    chain, committing it all, and decoding the same token."""
    g, p, cache, win, ids = setup()
    ours, n = commit_path(g, p, cache, win, ids, jnp.asarray(PARENTS), ACCEPT)
    chain_ids, _ = path_ids(ids, ACCEPT)
    _, theirs = decode(g, p, chain_ids, cache, win._replace(lengths=n))
    for layer, (a, e) in enumerate(zip(jax.tree.leaves(ours), jax.tree.leaves(theirs))):
        assert_close(a, e, **TOL, name=f"cache leaf {layer}")
    nxt = jnp.asarray(ids_for(3, (B, 1)))
    step = win._replace(start=win.start + n, lengths=jnp.asarray([1, 1, 0], jnp.int32))
    got, _ = decode(g, p, nxt, ours, step)
    want, _ = decode(g, p, nxt, theirs, step)
    assert_close(got[:2], want[:2], **TOL, name="next decode")


# ---- a mesh and a GPU -----------------------------------------------------------------------

PAGE_RANK = 4  # tokens of a page on one rank


def mesh_run(model, dcp):
    """prefill, verify_tree and a committed path on `model`'s plan, with pages of
    PAGE_RANK * dcp tokens: (logits, per_step, rows, the cache after, on host, logical)."""
    page = PAGE_RANK * dcp
    n = -(-MAX_LEN // page)
    cache = init_cache(
        CFG, model.par, num_slots=B + 1, num_pages=B * n, page_size=page, dtype=jnp.float32
    )
    batch = contiguous_batch(B, MAX_LEN, page, lengths=PROMPT)
    g, p = nnx.split(model)
    _, _, _, win, ids = setup()
    win = win._replace(block_table=batch.block_table)
    cache = prefill(g, p, jnp.asarray(ids_for(1, (B, 16))), cache, batch)
    logits, _, per_step, rows = tree_verify(g, p, ids, jnp.asarray(PARENTS), cache, win)
    after, _ = commit_path(g, p, cache, win, ids, jnp.asarray(PARENTS), ACCEPT)
    c = model.par.dcp  # the one-device run keeps its pages in position order
    mla = tuple(m._replace(latent=cache_from_dcp_layout(m.latent, c)) for m in after.mla)
    return jax.device_get((logits, per_step, rows, ModelCache(after.kda, mla)))


# The query gathered over the DCP group, and (as the engine serves it, `for_serving`) the
# replicated q_proj whose window part must take this rank's own heads (`MLA._own`).
@pytest.mark.parametrize(
    ("tp", "dcp", "replicate", "serving"),
    [(4, 2, False, False), (4, 4, True, True)],
    ids=["tp4-dcp2", "tp4-dcp4-replicated-q"],
)
def test_dcp_mesh_equals_one_device(tp, dcp, replicate, serving):
    par = make_parallel(CFG, tp, dcp, replicate_q_proj=replicate)
    model = shard_model(base(), par)
    model = for_serving(model) if serving else model
    got, want = mesh_run(model, dcp), mesh_run(base(), dcp)
    valid = [(b, i) for b in range(B) for i in range(LENGTHS[b])]
    sel = lambda a: np.stack([a[b, i] for b, i in valid])
    for name, a, e in zip(("logits", "per_step", "rows"), got[:3], want[:3]):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(e)):
            assert_close(sel(x), sel(y), atol=2e-5, rtol_rms=2e-6, name=name)
    for x, y in zip(jax.tree.leaves(got[3]), jax.tree.leaves(want[3])):
        assert_close(x, y, atol=2e-5, rtol_rms=2e-6, name="cache after the commit")


def test_tree_verify_lowers_for_cuda():
    """verify_tree as a GPU traces it (the Pallas kernel for the prefix) lowers for CUDA."""
    cfg = preset("tiny", qk_rope_head_dim=16)  # L = 32, R = 16: dims the kernel takes
    model = shard_model(random_model(cfg, seed=0), Parallel(attention="kernel"))
    g, p = nnx.split(model)
    cache = init_cache(
        cfg, model.par, num_slots=B + 1, num_pages=B * 4, page_size=16, dtype=jnp.float32
    )
    batch = contiguous_batch(B, 64, 16, start=PROMPT, lengths=LENGTHS)
    fn = lambda p, *args: merge(g, p).verify_tree(*args)
    with abstract_gpu(), gpu_backend():
        args = (p, jnp.asarray(ids_for(2, (B, T))), jnp.asarray(PARENTS), cache, batch)
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    assert "xla.gpu.triton" in lowered.as_text()
