"""DCP over an emulated 'dcp' mesh: placement, local lengths, writes, attention and the lse
combine against the single-device paged reference, and the host metadata (DECODE and
TARGET_VERIFY), including the verify-under-DCP local-length trap."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kimi_linear_jax.ops import mla as mla_ops
from kimi_linear_jax.parallel import dcp
from kimi_linear_jax.parallel.mesh import shard_map
from tests.helpers import assert_close
from tests.kernels import dcp_helpers as harness

_dcp_write = jax.jit(harness.dcp_write_latents, static_argnums=5)
_plain_write = jax.jit(mla_ops.write_latents)
_reference = jax.jit(mla_ops.mla_paged_attention_reference, static_argnames="sm_scale")


@functools.cache
def _mesh(c: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:c]), ("dcp",))


def _rank_of(mesh: Mesh, device) -> int:
    return list(mesh.devices.flat).index(device)


def _assert_attn_close(o, lse, o_ref, lse_ref, *, atol, name):
    """o and the finite lse with assert_close; rows that see no key: lse -inf and o = 0 on both."""
    o, lse, o_ref, lse_ref = (np.asarray(x) for x in (o, lse, o_ref, lse_ref))
    empty = np.isneginf(lse_ref)
    np.testing.assert_array_equal(np.isneginf(lse), empty, err_msg=f"{name}: empty rows")
    assert not np.any(np.isposinf(lse)) and not np.any(np.isnan(lse)), name
    assert np.all(o[empty] == 0), f"{name}: o of empty rows"
    assert_close(o, o_ref, atol=atol, rtol_rms=atol, name=f"{name} o")
    assert_close(
        np.where(empty, 0, lse), np.where(empty, 0, lse_ref), atol=atol, rtol_rms=atol, name=name
    )


# --------------------------------------------------------------------------- placement


@pytest.mark.parametrize("c", [2, 4])
def test_layout_ownership(c):
    """Device r holds exactly the positions p with p % c == r, at local slot (p % (ps*c)) // c."""
    mesh, page_size, num_pages, D = _mesh(c), 3, 5, 2
    vps = page_size * c
    i = np.arange(vps)
    np.testing.assert_array_equal(
        harness.from_dcp_layout(harness.to_dcp_layout(i, page_size, c), 3, c), i
    )
    # Sequence 0 owns virtual pages 3, 0, 4 (in that order); its token p carries p + 1.
    table = jnp.asarray([[3, 0, 4]], jnp.int32)
    n = 3 * vps
    rows = np.broadcast_to((np.arange(n, dtype=np.float32) + 1)[None, :, None], (1, n, D))
    cache = jax.device_put(np.zeros((num_pages, vps, D), np.float32), harness.cache_sharding(mesh))
    cache = _dcp_write(cache, rows, table, np.zeros(1, np.int32), np.asarray([n], np.int32), mesh)
    shards = cache.addressable_shards
    assert len(shards) == c
    for shard in shards:
        r = _rank_of(mesh, shard.device)
        data = np.asarray(shard.data)
        assert data.shape == (num_pages, page_size, D)
        held = data[..., 0][data[..., 0] > 0].astype(int) - 1
        np.testing.assert_array_equal(np.sort(held), np.arange(r, n, c))
        for k, page in enumerate([3, 0, 4]):
            expect = k * vps + np.arange(page_size) * c + r + 1  # slot j holds j*c + r
            np.testing.assert_array_equal(data[page, :, 0], expect)
    # The plain (position-ordered) view of the same cache is the single-device layout.
    plain = np.asarray(harness.cache_from_dcp_layout(np.asarray(cache), c))
    np.testing.assert_array_equal(plain[[3, 0, 4], :, 0].reshape(-1), np.arange(n) + 1)
    np.testing.assert_array_equal(harness.cache_to_dcp_layout(plain, c), np.asarray(cache))


def test_local_len_matches_brute_force():
    n = np.arange(-2, 70)
    for c in range(1, 9):
        for r in range(c):
            brute = np.array([np.sum(np.arange(max(k, 0)) % c == r) for k in n])
            np.testing.assert_array_equal(harness.local_len_np(n, r, c), brute)
            np.testing.assert_array_equal(np.asarray(dcp.local_len(jnp.asarray(n), r, c)), brute)
        # Vectorised over ranks too, and the ranks partition the prefix.
        ranks = np.arange(c)[:, None]
        both = np.asarray(dcp.local_len(jnp.asarray(n)[None], jnp.asarray(ranks), c))
        np.testing.assert_array_equal(both, harness.local_len_np(n[None], ranks, c))
        np.testing.assert_array_equal(both.sum(0), np.maximum(n, 0))


def test_dcp_coords():
    page_size, c = 4, 3
    p = np.arange(100)
    vpage, owner, slot = dcp.dcp_coords(p, page_size, c)
    np.testing.assert_array_equal(owner, p % c)
    np.testing.assert_array_equal(vpage * page_size + slot, p // c)
    assert slot.max() == page_size - 1


def test_merge_stacked_partials():
    """Against pairwise merge_partials, with empty (-inf) slices, some rows empty everywhere."""
    rng = np.random.default_rng(0)
    c, B, H, L = 4, 5, 3, 8
    o = jnp.asarray(rng.standard_normal((c, B, H, L)), jnp.float32)
    lse = rng.standard_normal((c, B, H)).astype(np.float32) * 5
    lse[1:, 0] = -np.inf  # only rank 0 has keys
    lse[:, 1] = -np.inf  # nobody has keys
    lse[0, 2] = -np.inf
    lse[2, 3, 1] = -np.inf
    empty = jnp.isneginf(jnp.asarray(lse))[..., None]
    lse = jnp.asarray(lse)
    o_ref = jnp.where(empty, 0.0, o)
    lse_ref = lse[0]
    o_ref, o_ref_stack = o_ref[0], o_ref
    for r in range(1, c):
        o_ref, lse_ref = mla_ops.merge_partials(o_ref, lse_ref, o_ref_stack[r], lse[r])
    # Whatever a backend leaves in the o of an empty slice (here NaN) must not leak.
    o_m, lse_m = dcp.merge_stacked_partials(jnp.where(empty, jnp.nan, o), lse)
    _assert_attn_close(o_m, lse_m, o_ref, lse_ref, atol=1e-6, name="merge")
    assert np.all(np.isneginf(np.asarray(lse_m[1])))


def _merge_reference(o, lse):
    """float64 numpy merge of partials o [c, ..., L], lse [c, ...] (natural log, -inf = empty)."""
    o, lse = np.asarray(o, np.float64), np.asarray(lse, np.float64)
    m = lse.max(axis=0)
    safe_m = np.where(np.isfinite(m), m, 0.0)
    w = np.exp(lse - safe_m)  # exact in float64 for these spreads; empty slices give 0
    total = w.sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse_out = np.where(total > 0, safe_m + np.log(total), -np.inf)
        o_out = np.where(total[..., None] > 0, np.einsum("c...,c...l->...l", w, o), 0.0)
        o_out /= np.where(total > 0, total, 1.0)[..., None]
    return o_out, lse_out


def _large_lse_partials(c, B=2, T=3, H=4, L=8, seed=0):
    """Partials whose lse lie around 500 (exp overflows float32 past 88.7) with spreads of a
    few units and up to 60, some slices empty (-inf), and one row empty on every rank."""
    rng = np.random.default_rng(seed)
    o = rng.standard_normal((c, B, T, H, L)).astype(np.float32)
    lse = (500 + rng.normal(0, 3, (c, B, T, H))).astype(np.float32)
    lse[0, 0, 0] -= 60  # one rank far below the others
    lse[1:, 0, 1] = -np.inf  # only rank 0 saw keys
    lse[:, 1, 2, 0] = -np.inf  # nobody saw keys
    lse[c - 1, 1, 0] = -np.inf
    return o, lse


@functools.cache
def _combine_fn(c: int, name: str):
    """jit(shard_map) of the named dcp combine over partials stacked on axis 0 (one per rank)."""
    mesh = _mesh(c)
    if name in harness.REPLICATED_COMBINES:
        fn, out = harness.REPLICATED_COMBINES[name], (P(), P())
        body = lambda o, lse: fn(o[0], lse[0])
    else:
        fn, out = dcp.HEAD_COMBINES[name], (P(None, None, "dcp"), P(None, None, "dcp"))
        body = lambda o, lse: fn(o[0], lse[0], c)
    return mesh, jax.jit(shard_map(body, mesh, (P("dcp"), P("dcp")), out))


MERGES = sorted(harness.REPLICATED_COMBINES) + sorted(dcp.HEAD_COMBINES) + ["stacked", "pairwise"]


@pytest.mark.parametrize("name", MERGES)
def test_lse_merges_do_not_overflow(name):
    """Every lse combine subtracts the max: lse around 500 in float32 merges to the float64
    result (a merge computing exp(lse) directly overflows to inf / NaN)."""
    c = 4
    o, lse = _large_lse_partials(c)
    o_ref, lse_ref = _merge_reference(o, lse)
    if name == "stacked":
        got = dcp.merge_stacked_partials(jnp.asarray(o), jnp.asarray(lse))
    elif name == "pairwise":
        empty = np.isneginf(lse)[..., None]
        got = (jnp.asarray(np.where(empty[0], 0.0, o[0])), jnp.asarray(lse[0]))
        for r in range(1, c):
            part = jnp.asarray(np.where(empty[r], 0.0, o[r])), jnp.asarray(lse[r])
            got = mla_ops.merge_partials(*got, *part)
    else:
        mesh, fn = _combine_fn(c, name)
        sharded = NamedSharding(mesh, P("dcp"))
        got = fn(jax.device_put(o, sharded), jax.device_put(lse, sharded))
    # float32 carries lse ~ 500 to one ulp (3e-5); a few ulps of error are expected.
    _assert_attn_close(*got, o_ref, lse_ref, atol=1e-4, name=name)


# --------------------------------------------------------------------------- write + attention


def _setup(c, ctx, T, H, L, R, dtype, *, page_size=4, seed=0, mesh=None):
    """Writes ctx[b] tokens of each sequence (prefix, then the window, in two calls) into a DCP
    cache and into a plain cache of page size page_size * c with the same block table; both
    start from the same garbage. Returns the inputs of dcp_attention and the plain cache."""
    mesh = mesh or _mesh(c)
    rng = np.random.default_rng(seed)
    ctx = np.asarray(ctx)
    B, vps = len(ctx), page_size * c
    n_pages = max(-(-int(ctx.max()) // vps), 1)
    num_pages = B * n_pages + 3
    table = rng.permutation(num_pages)[: B * n_pages].reshape(B, n_pages).astype(np.int32)
    garbage = rng.uniform(-30, 30, (num_pages, vps, L + R)).astype(jnp.dtype(dtype))
    plain = jnp.asarray(garbage)
    cache = jax.device_put(harness.cache_to_dcp_layout(garbage, c), harness.cache_sharding(mesh))
    n_rows = max(int(ctx.max()), 1)
    rows = rng.standard_normal((B, n_rows, L + R)).astype(np.float32)
    prefix = np.maximum(ctx - T, 0)
    for start, length in ((np.zeros_like(ctx), prefix), (prefix, ctx - prefix)):
        # Row t of each call is the token at position start + t.
        idx = np.minimum(start[:, None] + np.arange(n_rows), n_rows - 1)
        part = jnp.asarray(rows[np.arange(B)[:, None], idx])
        args = (part, table, np.asarray(start, np.int32), np.asarray(length, np.int32))
        cache = _dcp_write(cache, *args, mesh)
        plain = _plain_write(plain, *args)
    np.testing.assert_array_equal(
        np.asarray(harness.cache_from_dcp_layout(np.asarray(cache), c)), np.asarray(plain)
    )
    q_lat = jnp.asarray(rng.standard_normal((B, T, H, L)).astype(np.float32))
    q_pe = jnp.asarray(rng.standard_normal((B, T, H, R)).astype(np.float32))
    return mesh, q_lat, q_pe, cache, table, plain


@functools.cache
def _attn(mesh, sm_scale, with_local, combine="lse_psum"):
    @jax.jit
    def run(q_lat, q_pe, cache, table, kv_lens, local_kv_lens):
        return harness.dcp_attention(
            q_lat,
            q_pe,
            cache,
            table,
            kv_lens,
            sm_scale=sm_scale,
            mesh=mesh,
            local_kv_lens=local_kv_lens if with_local else None,
            combine=combine,
        )

    return run


CASES = [
    # (c, mode, num_draft, ctx, H, L, R, cache dtype)
    (1, "decode", 0, [0, 1, 2, 3, 9, 23], 3, 64, 16, jnp.float32),
    (2, "decode", 0, [0, 1, 2, 3, 9, 23], 3, 64, 16, jnp.float32),
    (4, "decode", 0, [0, 1, 2, 3, 5, 17, 40, 67], 3, 64, 16, jnp.float32),
    (4, "decode", 3, [0, 1, 2, 3, 5, 17, 40, 67], 5, 64, 16, jnp.bfloat16),
    (2, "target_verify", 2, [3, 4, 5, 12, 31], 4, 64, 16, jnp.bfloat16),
    (4, "target_verify", 7, [8, 9, 10, 11, 21, 50], 5, 64, 16, jnp.float32),
    (4, "target_verify", 15, [0, 3, 16, 17, 18, 19, 45, 77], 3, 64, 16, jnp.float32),
    (4, "target_verify", 15, [16, 19, 45], 2, 64, 16, jnp.bfloat16),
    (4, "decode", 0, [0, 2, 3, 70], 4, 512, 64, jnp.float32),
    (4, "target_verify", 7, [8, 11, 70], 4, 512, 64, jnp.bfloat16),
]


def _case_id(case):
    c, mode, nd, _, H, L, R, dt = case
    return f"c{c}-{mode}-T{harness.num_query_tokens(mode, nd)}-H{H}-L{L}-R{R}-{jnp.dtype(dt).name}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(k) for k in CASES])
def test_write_and_attention_match_single_device(case):
    c, mode, num_draft, ctx, H, L, R, dtype = case
    meta = harness.dcp_metadata(mode, ctx, num_draft, c)
    T = meta.num_tokens
    mesh, q_lat, q_pe, cache, table, plain = _setup(c, ctx, T, H, L, R, dtype)
    sm_scale = (L + R) ** -0.5
    kv_lens = jnp.asarray(meta.kv_lens)
    o_ref, lse_ref = _reference(q_lat, q_pe, plain, table, kv_lens, sm_scale=sm_scale)
    atol = 1e-5 if L <= 64 else 2e-5
    # Both local-length paths and both combines, without compiling all four pairs.
    for with_local, combine in ((False, "lse_psum"), (True, "all_gather")):
        o, lse = _attn(mesh, sm_scale, with_local, combine)(
            q_lat, q_pe, cache, table, kv_lens, jnp.asarray(meta.local_kv_lens)
        )
        assert o.shape == (len(ctx), T, H, L) and lse.shape == (len(ctx), T, H)
        _assert_attn_close(o, lse, o_ref, lse_ref, atol=atol, name=f"{with_local=} {combine}")


def test_explicit_axis_mesh():
    """jax.make_mesh gives explicit axes in jax 0.10: inputs are resharded to the in_specs."""
    c, ctx, H, L, R = 2, [0, 1, 6, 13], 3, 32, 8
    mesh = jax.make_mesh((c,), ("dcp",))
    meta = harness.dcp_metadata("decode", ctx, 0, c)
    mesh, q_lat, q_pe, cache, table, plain = _setup(c, ctx, 1, H, L, R, jnp.float32, mesh=mesh)
    o_ref, lse_ref = _reference(q_lat, q_pe, plain, table, meta.kv_lens, sm_scale=0.1)
    o, lse = _attn(mesh, 0.1, True)(q_lat, q_pe, cache, table, meta.kv_lens, meta.local_kv_lens)
    _assert_attn_close(o, lse, o_ref, lse_ref, atol=1e-5, name="explicit mesh")


# --------------------------------------------------------------------------- metadata


def test_metadata_decode_adds_no_draft_tokens():
    ctx = np.array([0, 1, 5, 9, 64])
    for num_draft in (0, 3, 7):
        meta = harness.dcp_metadata(harness.ForwardMode.DECODE, ctx, num_draft, 4)
        assert meta.num_tokens == 1
        np.testing.assert_array_equal(meta.kv_lens, ctx[:, None])
        assert meta.local_kv_lens.shape == (4, 5, 1)
        np.testing.assert_array_equal(meta.local_kv_lens.sum(0), meta.kv_lens)
        np.testing.assert_array_equal(meta.local_kv_lens[:, :, 0].T[1], [1, 0, 0, 0])
        np.testing.assert_array_equal(meta.local_kv_lens[:, :, 0].T[2], [2, 1, 1, 1])
    assert harness.dcp_metadata("decode", ctx, 3, 4).kv_lens.shape == (5, 1)


def test_metadata_target_verify_splits_window():
    c, num_draft = 4, 3
    meta = harness.dcp_metadata(harness.ForwardMode.TARGET_VERIFY, [10, 2, 0], num_draft, c)
    assert meta.num_tokens == 4
    np.testing.assert_array_equal(meta.kv_lens, [[7, 8, 9, 10], [0, 0, 1, 2], [0, 0, 0, 0]])
    # [rank, row t] for ctx = 10: keys 0..6, 0..7, 0..8, 0..9 split round-robin.
    np.testing.assert_array_equal(
        meta.local_kv_lens[:, 0], [[2, 2, 3, 3], [2, 2, 2, 3], [2, 2, 2, 2], [1, 2, 2, 2]]
    )
    np.testing.assert_array_equal(
        meta.local_kv_lens[:, 1].T, [[0] * 4, [0] * 4, [1, 0, 0, 0], [1, 1, 0, 0]]
    )
    np.testing.assert_array_equal(meta.local_kv_lens[:, 2], 0)
    np.testing.assert_array_equal(meta.local_kv_lens.sum(0), meta.kv_lens)
    assert meta.kv_lens.dtype == np.int32 and meta.local_kv_lens.dtype == np.int32


def test_wrong_verify_local_length_is_wrong():
    """local_len(ctx, r) - (T - 1 - t) is not the local length of row t; local_len(ctx - T + 1
    + t, r) is. The wrong one must give outputs far from the single-device reference."""
    c, num_draft, H, L, R = 4, 7, 3, 64, 16
    ctx = [10, 13, 30, 37]
    meta = harness.dcp_metadata("target_verify", ctx, num_draft, c)
    T = meta.num_tokens
    ranks, t = np.arange(c)[:, None, None], np.arange(T)[None, None, :]
    wrong = harness.local_len_np(np.asarray(ctx)[None, :, None], ranks, c) - (T - 1 - t)
    assert np.any(np.maximum(wrong, 0) != meta.local_kv_lens)
    mesh, q_lat, q_pe, cache, table, plain = _setup(c, ctx, T, H, L, R, jnp.float32, seed=3)
    sm_scale = (L + R) ** -0.5
    kv_lens = jnp.asarray(meta.kv_lens)
    o_ref, lse_ref = _reference(q_lat, q_pe, plain, table, kv_lens, sm_scale=sm_scale)
    run = _attn(mesh, sm_scale, True)
    o, lse = run(q_lat, q_pe, cache, table, kv_lens, jnp.asarray(meta.local_kv_lens))
    _assert_attn_close(o, lse, o_ref, lse_ref, atol=1e-5, name="right")
    o_bad, _ = run(q_lat, q_pe, cache, table, kv_lens, jnp.asarray(np.maximum(wrong, 0)))
    assert float(np.abs(np.asarray(o_bad) - np.asarray(o_ref)).max()) > 0.1
    with pytest.raises(AssertionError):
        assert_close(o_bad, o_ref, atol=1e-2, rtol_rms=1e-2, name="wrong")
