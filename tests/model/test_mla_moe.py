"""MLA forms against each other (absorbed == naive, paged reference over poisoned pages) and
every MoE dispatch (ragged, tiled) against the dense reference."""

from __future__ import annotations

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_linear_jax.layers import moe as moe_module
from kimi_linear_jax.layers.mla import MLA
from kimi_linear_jax.layers.moe import MoE
from kimi_linear_jax.ops import mla as mla_ops
from kimi_linear_jax.presets import preset
from tests.helpers import assert_close


# bfloat16: XLA:CPU has no kernel for the absorbed query product in bfloat16 from 8 rows on
# (the layer upcasts there); its tolerance is one bfloat16 ulp (the forms round differently).
@pytest.mark.parametrize(
    "q_lora_rank, dtype, tol",
    [(None, "float32", 1e-5), (24, "float32", 1e-5), (None, "bfloat16", 8e-3)],
)
def test_absorbed_equals_naive(q_lora_rank, dtype, tol):
    """Absorbed attention over a shuffled paged cache == the naive expanded form."""
    cfg = preset("tiny", q_lora_rank=q_lora_rank)
    mla = MLA(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(1))
    B, T, page = 2, 23, 8
    x = jax.random.normal(jax.random.key(0), (B, T, cfg.hidden_size)).astype(dtype)
    q_nope, q_pe = mla._query(x)
    rows = mla.latent(x)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    o_naive, lse_naive = mla._naive(q_nope, q_pe, rows, mask)
    # Scatter the rows into a shuffled set of pages, poison everything else.
    n = -(-T // page)
    perm = np.random.default_rng(0).permutation(B * n + 3)
    table = jnp.asarray(perm[: B * n].reshape(B, n), jnp.int32)
    cache = jnp.full((B * n + 3, page, cfg.latent_dim), 1e4, dtype)
    cache = mla_ops.write_latents(
        cache, rows, table, jnp.zeros(B, jnp.int32), jnp.full((B,), T, jnp.int32)
    )
    kv_lens = jnp.broadcast_to(jnp.arange(1, T + 1), (B, T))
    o_abs, lse_abs, _ = mla._absorbed(q_nope, q_pe, cache, table, kv_lens)
    assert_close(o_abs, o_naive, atol=tol, rtol_rms=tol, name="o")
    assert_close(lse_abs, lse_naive, atol=tol, rtol_rms=tol / 10, name="lse")


def test_paged_reference_edge_rows():
    """Rows seeing zero keys give lse = -inf and o = 0; unowned poisoned pages change nothing."""
    rng = np.random.default_rng(1)
    B, T, H, L, R, page = 3, 2, 3, 16, 4, 4
    q_lat = jnp.asarray(rng.standard_normal((B, T, H, L)), jnp.float32)
    q_pe = jnp.asarray(rng.standard_normal((B, T, H, R)), jnp.float32)
    cache = jnp.asarray(rng.standard_normal((10, page, L + R)), jnp.float32)
    table = jnp.asarray([[3, 1, 7], [2, 0, 9], [5, 4, 6]], jnp.int32)
    kv_lens = jnp.asarray([[0, 1], [5, 6], [11, 12]], jnp.int32)
    run = lambda c: mla_ops.mla_paged_attention_reference(
        q_lat, q_pe, c, table, kv_lens, sm_scale=0.3
    )
    o, lse = run(cache)
    assert np.all(np.asarray(lse[0, 0]) == -np.inf) and np.all(np.asarray(o[0, 0]) == 0)
    # Poison page 8 (owned by no one) and the unused tail of row 1's last page (9: len 6 of 12).
    poisoned = cache.at[8].set(1e30).at[9, 2:].set(-1e30)
    o2, lse2 = run(poisoned)
    np.testing.assert_array_equal(np.asarray(o2), np.asarray(o))
    np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))
    # Independent check of one row against a direct numpy softmax.
    rows = np.concatenate([np.asarray(cache)[p] for p in [2, 0, 9]])[:6]
    s = (np.asarray(q_lat[1, 1]) @ rows[:, :L].T + np.asarray(q_pe[1, 1]) @ rows[:, L:].T) * 0.3
    p = np.exp(s - s.max(-1, keepdims=True))
    expected = (p / p.sum(-1, keepdims=True)) @ rows[:, :L]
    assert_close(o[1, 1], expected, atol=1e-5, rtol_rms=1e-6, name="numpy row")


def test_attention_write_orders_agree():
    """The reference's order (read the old pool with the new rows put into the gathered pages,
    write after) == the kernel's (write, then read the pool): same o, lse and pool, bit for
    bit. Rows: a page boundary inside the window, a short row, a padding row (null pages), a
    position past the block table (the writer's last column)."""
    rng = np.random.default_rng(3)
    B, T, H, L, R, page = 4, 3, 2, 8, 4, 4
    q_lat = jnp.asarray(rng.standard_normal((B, T, H, L)), jnp.float32)
    q_pe = jnp.asarray(rng.standard_normal((B, T, H, R)), jnp.float32)
    rows = jnp.asarray(rng.standard_normal((B, T, L + R)), jnp.float32)
    cache = jnp.asarray(rng.standard_normal((12, page, L + R)), jnp.float32)
    table = jnp.asarray([[3, 1, 7], [2, 9, 10], [0, 0, 0], [5, 4, 6]], jnp.int32)
    start = jnp.asarray([3, 5, 0, 11], jnp.int32)
    lengths = jnp.asarray([3, 2, 0, 2], jnp.int32)
    t = jnp.arange(T)[None, :]
    kv_lens = jnp.where(
        lengths[:, None] > 0, start[:, None] + jnp.minimum(t + 1, lengths[:, None]), 0
    )
    where = mla_ops.targets(table, start, lengths, T, page)
    written = mla_ops.write_rows(cache, rows, table, *where)
    o, lse = mla_ops.mla_paged_attention_reference(
        q_lat, q_pe, written, table, kv_lens, sm_scale=0.3
    )
    o2, lse2, cache2 = jax.jit(
        lambda c: mla_ops.paged_attention_write(
            "reference", q_lat, q_pe, c, table, kv_lens, rows, *where, sm_scale=0.3
        )
    )(cache)
    np.testing.assert_array_equal(np.asarray(cache2), np.asarray(written))
    np.testing.assert_array_equal(np.asarray(o2), np.asarray(o))
    np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))
    np.testing.assert_array_equal(np.asarray(written[0]), np.asarray(cache[0]))  # null page


def test_merge_partials_equals_joint_softmax():
    """Attention over keys split in two parts, merged by lse == attention over all keys."""
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((1, 3, 2, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 10, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, 10, 2, 5)), jnp.float32)
    full = jnp.ones((1, 3, 10), bool)
    o, lse = mla_ops.mla_naive_attention(q, k, v, full, 0.5)
    a = mla_ops.mla_naive_attention(q, k[:, :4], v[:, :4], full[..., :4], 0.5)
    b = mla_ops.mla_naive_attention(q, k[:, 4:], v[:, 4:], full[..., 4:], 0.5)
    om, lsem = mla_ops.merge_partials(*a, *b)
    assert_close(om, o, atol=1e-6, rtol_rms=1e-6, name="o")
    assert_close(lsem, lse, atol=1e-6, rtol_rms=1e-6, name="lse")
    empty = jnp.zeros((1, 3, 4), bool)  # a part with no visible key contributes nothing
    e = mla_ops.mla_naive_attention(q, k[:, :4], v[:, :4], empty, 0.5)
    om, lsem = mla_ops.merge_partials(*e, o, lse)
    assert_close(om, o, atol=0, rtol_rms=0, name="o with empty part")


def _random_moe(cfg, seed, bias_scale=0.05):
    moe = MoE(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    bias = np.random.default_rng(seed + 1).standard_normal(cfg.num_experts) * bias_scale
    moe.gate.e_score_correction_bias.set_value(jnp.asarray(bias, jnp.float32))
    return moe


def _against_dense(moe, x, dispatch):
    moe.dispatch = dispatch
    y = moe(x)
    moe.dispatch = "dense"
    assert_close(y, moe(x), atol=1e-5, rtol_rms=1e-6, name=f"moe {dispatch}")


# "auto" is "tiled" on a CPU and "ragged" elsewhere (test_pick_dispatch): not repeated here.
@pytest.mark.parametrize("dispatch", ["ragged", "tiled"])
@pytest.mark.parametrize("groups,topk_group", [(1, 1), (4, 2)])
def test_grouped_dispatch_equals_dense(groups, topk_group, dispatch):
    cfg = preset("tiny", num_expert_group=groups, topk_group=topk_group, num_experts_per_token=3)
    moe = _random_moe(cfg, 2)
    x = jax.random.normal(jax.random.key(4), (3, 17, cfg.hidden_size))
    _against_dense(moe, x, dispatch)


# The ragged path (the GPU one) is slow to compile on a CPU: one case by default, the rest slow.
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    ("dispatch", "tokens", "shared"),
    [("tiled", n, s) for n in (1, 2, 8, 300) for s in (0, 2)]
    + [pytest.param("ragged", n, s, marks=SLOW) for n in (1, 2, 300) for s in (0, 2)]
    + [("ragged", 8, 0), pytest.param("ragged", 8, 2, marks=SLOW)],
)
def test_dispatch_token_counts_equal_dense(dispatch, tokens, shared):
    """Decode sizes (one tile of all N rows) and prefill sizes (N > TILE_ROWS: groups spread
    over several tiles), with and without shared experts."""
    cfg = preset("tiny", num_shared_experts=shared)
    moe = _random_moe(cfg, 7)
    x = jax.random.normal(jax.random.key(tokens), (tokens, cfg.hidden_size))
    _against_dense(moe, x, dispatch)


@pytest.mark.parametrize(
    ("dispatch", "tile_rows"),
    [("tiled", 1), ("tiled", 3), ("tiled", 128), ("ragged", 3)]
    + [pytest.param("ragged", t, marks=SLOW) for t in (1, 128)],
)
def test_dispatch_crowded_experts_equal_dense(monkeypatch, dispatch, tile_rows):
    """A router bias that sends every token to the same two experts (six stay unused, one
    group holds every row); small tiles split that group over many tiles, with a ragged last
    one. (22 tokens are decode-sized for `tile_rows`: the pair-tile rule is switched off so
    that TILE_ROWS sets the tile.)"""
    monkeypatch.setattr(moe_module, "TILE_ROWS", tile_rows)
    monkeypatch.setattr(moe_module, "PAIR_TILES_UP_TO", 0)
    cfg = preset("tiny", num_expert_group=1, topk_group=1)
    moe = _random_moe(cfg, 3, bias_scale=0.0)
    moe.gate.e_score_correction_bias.set_value(jnp.zeros(cfg.num_experts).at[5].set(9).at[2].set(8))
    x = jax.random.normal(jax.random.key(5), (2, 11, cfg.hidden_size))
    _, idx = moe.gate(x.reshape(-1, cfg.hidden_size))
    assert set(np.unique(np.asarray(idx))) == {2, 5}
    _against_dense(moe, x, dispatch)


def _compositions(total: int, parts: int):
    """Every way to put `total` pairs into `parts` experts (order matters)."""
    if parts == 1:
        yield (total,)
        return
    for first in range(total + 1):
        for rest in _compositions(total - first, parts - 1):
            yield (first, *rest)


@pytest.mark.parametrize(("pairs", "rows", "experts"), [(2, 1, 4), (7, 1, 3), (7, 3, 4), (9, 2, 5)])
def test_max_tiles_is_the_most_tiles_any_routing_fills(pairs, rows, experts):
    """The tiled loop's bound is the largest tile count over every routing of the pairs: no
    routing needs more (a pair would be dropped), and one needs exactly that many (the loop
    runs no iteration that no routing could use)."""
    counts = [sum(-(-s // rows) for s in sizes) for sizes in _compositions(pairs, experts)]
    assert moe_module.max_tiles(pairs, rows, experts) == max(counts)


def test_tiled_equals_dense_when_every_tile_of_the_bound_is_used(monkeypatch):
    """Tiles of 3 rows, and each of the 8 experts in use holds 1 mod 3 pairs (4 hold 4, 4
    hold 1): 12 tiles, the loop's bound. A shorter loop would drop the last expert's pair."""
    monkeypatch.setattr(moe_module, "TILE_ROWS", 3)
    monkeypatch.setattr(moe_module, "PAIR_TILES_UP_TO", 0)
    cfg = preset("tiny")
    experts = moe_module.Experts(cfg, dtype=jnp.float32, rngs=nnx.Rngs(1))
    per_expert = [4, 4, 4, 4, 1, 1, 1, 1]
    flat = np.repeat(np.arange(8), per_expert)  # 20 pairs: 10 tokens of 2 distinct experts
    idx = jnp.asarray(np.stack([flat[:10], flat[10:]], axis=1), jnp.int32)
    assert (np.asarray(idx)[:, 0] != np.asarray(idx)[:, 1]).all()
    assert moe_module.max_tiles(20, 3, 8) == sum(-(-s // 3) for s in per_expert) == 12
    x = jax.random.normal(jax.random.key(2), (10, cfg.hidden_size))
    w = jax.random.uniform(jax.random.key(3), (10, 2))
    assert_close(
        experts.tiled(x, w, idx), experts.dense(x, w, idx), atol=1e-5, rtol_rms=1e-6, name="tiled"
    )


def test_tile_rows_are_pairs_at_decode_sizes():
    """One (token, expert) pair per tile while the experts average at most PAIR_TILES_UP_TO
    pairs each; TILE_ROWS-row tiles (or all N rows) beyond."""
    limit = moe_module.PAIR_TILES_UP_TO
    assert moe_module.tile_rows(1, 2, 8) == 1
    assert moe_module.tile_rows(limit * 4, 2, 8) == 1
    assert moe_module.tile_rows(limit * 4 + 1, 2, 8) == limit * 4 + 1
    assert moe_module.tile_rows(1000, 2, 8) == moe_module.TILE_ROWS


def _unfused_instructions(hlo: str) -> list[str]:
    """The instructions of an optimized HLO module outside fusion bodies: each one's result is
    a buffer of its own."""
    bodies = set(re.findall(r"calls=(%[\w.\-]+)", hlo))
    current, kept = None, []
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?(%[\w.\-]+) .*\{$", line)
        if header:
            current = header.group(1)
        elif current not in bodies:
            kept.append(line.strip())
    return kept


@pytest.mark.parametrize("tokens", [1, 4])
def test_tiled_decode_reads_each_expert_in_place(tokens):
    """At decode sizes no buffer shaped like one expert's matrix is made: the products read
    the stacked weights in place. (The einsum form of the products made XLA:CPU copy the
    expert's three matrices out first, which doubled the time of a one-token MoE.)"""
    cfg = preset("tiny", moe_intermediate_size=48)  # [48, 64]: a shape nothing else has
    experts = moe_module.Experts(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    weights = (experts.w1[...], experts.w3[...], experts.w2[...])
    x = jax.random.normal(jax.random.key(0), (tokens, cfg.hidden_size))
    w = jnp.full((tokens, 2), 0.5)
    idx = jnp.tile(jnp.array([[1, 3]], jnp.int32), (tokens, 1))

    def routed(w1, w3, w2, x, w, idx):
        return moe_module.Experts.tiled(types.SimpleNamespace(w1=w1, w3=w3, w2=w2), x, w, idx)

    hlo = jax.jit(routed).lower(*weights, x, w, idx).compile().as_text()
    copies = [
        line[:160]
        for line in _unfused_instructions(hlo)
        if re.search(r"= f32\[(48,64|64,48)\]\{[\d,]+\} (?!parameter)", line)
    ]
    assert not copies, copies


def test_tiled_dispatch_under_jit_equals_dense():
    """The decode shape (N = batch) inside jit, as the decode step runs it."""
    cfg = preset("tiny")
    moe = _random_moe(cfg, 11)
    x = jax.random.normal(jax.random.key(12), (4, 1, cfg.hidden_size))
    moe.dispatch = "tiled"
    y = nnx.jit(lambda m, x: m(x))(moe, x)
    moe.dispatch = "dense"
    assert_close(y, moe(x), atol=1e-5, rtol_rms=1e-6, name="moe jit")


def test_tiled_dispatch_gradients_equal_dense():
    """The tiled loop (scan + cond) is reverse-differentiable, with the dense gradients."""
    cfg = preset("tiny")
    moe = _random_moe(cfg, 13)
    x = jax.random.normal(jax.random.key(14), (9, cfg.hidden_size))
    r = jax.random.normal(jax.random.key(15), (9, cfg.hidden_size))
    graphdef, params = nnx.split(moe)

    def grads(dispatch):
        def loss(p, x):
            m = nnx.merge(graphdef, p)
            m.dispatch = dispatch
            return jnp.sum(m(x) * r)

        return jax.grad(loss, argnums=(0, 1))(params, x)

    (gp, gx), (rp, rx) = grads("tiled"), grads("dense")
    assert_close(gx, rx, atol=1e-5, rtol_rms=1e-6, name="d x")
    for name in ("w1", "w2", "w3"):
        assert_close(
            gp["experts"][name][...],
            rp["experts"][name][...],
            atol=1e-5,
            rtol_rms=1e-6,
            name=f"d {name}",
        )


def test_pick_dispatch():
    assert moe_module.pick_dispatch("cpu") == "tiled"
    assert moe_module.pick_dispatch("gpu") == "ragged"
    assert moe_module.pick_dispatch("tpu") == "ragged"
    with pytest.raises(ValueError, match="unknown MoE dispatch"):
        MoE(preset("tiny"), dtype=jnp.float32, rngs=nnx.Rngs(0), dispatch="grouped")(
            jnp.zeros((1, 64))  # tiny hidden size
        )


def test_router_grouping_and_bias_for_selection_only():
    """Against a direct numpy restatement of the routing rule."""
    cfg = preset("tiny", num_expert_group=4, topk_group=2, num_experts_per_token=2)
    moe = MoE(cfg, dtype=jnp.float32, rngs=nnx.Rngs(5))
    rng = np.random.default_rng(6)
    bias = rng.standard_normal(cfg.num_experts).astype(np.float32) * 0.3
    moe.gate.e_score_correction_bias.set_value(jnp.asarray(bias))
    x = rng.standard_normal((20, cfg.hidden_size)).astype(np.float32)
    w, idx = moe.gate(jnp.asarray(x))
    s = 1 / (1 + np.exp(-(x @ np.asarray(moe.gate.weight[...]).T)))
    choice = s + bias
    for n in range(20):
        groups = choice[n].reshape(4, -1)
        top2 = np.sort(groups, axis=1)[:, -2:].sum(1)
        keep = np.argsort(-top2)[:2]
        masked = np.full_like(choice[n], -np.inf)
        for gidx in keep:
            masked[gidx * 2 : gidx * 2 + 2] = choice[n, gidx * 2 : gidx * 2 + 2]
        ids = np.argsort(-masked)[:2]
        assert set(np.asarray(idx[n])) == set(ids)
        weights = s[n, ids] / s[n, ids].sum() * cfg.routed_scaling_factor
        order = [list(np.asarray(idx[n])).index(i) for i in ids]
        assert_close(np.asarray(w[n])[order], weights, atol=1e-6, rtol_rms=1e-6, name=f"w{n}")


@pytest.mark.parametrize("dispatch", ["tiled", "ragged", "dense"])
def test_pairs_routed_to_other_ranks_contribute_nothing(dispatch):
    """Expert parallelism hands each rank the ids of its own experts and the out-of-range id E
    for pairs routed elsewhere: every path must equal the dense sum over the in-range pairs."""
    cfg = preset("tiny")
    experts = _random_moe(cfg, 3).experts
    E, N, k = cfg.num_experts, 9, 3
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((N, cfg.hidden_size)), jnp.float32)
    w = jnp.asarray(rng.uniform(0.1, 1.0, (N, k)), jnp.float32)
    idx = rng.integers(0, E, (N, k))
    elsewhere = rng.uniform(size=(N, k)) < 0.4
    kept = jnp.where(jnp.asarray(elsewhere), 0.0, w)
    want = experts.dense(x, kept, jnp.asarray(idx, jnp.int32))
    got = experts(x, w, jnp.asarray(np.where(elsewhere, E, idx), jnp.int32), dispatch)
    assert_close(got, want, atol=1e-5, rtol_rms=1e-5, name=dispatch)
