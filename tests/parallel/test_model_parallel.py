"""The model on a TP x DCP mesh (8 emulated CPU devices) equals the model on one device.

One config whose head, expert, vocab and MLP counts make every sharding non-trivial up to
tp = 8 (8 MLA heads, 8 KDA heads, 16 experts). Each (tp, dcp) runs one jitted function: a
first prefill chunk, a second chunk over the cached prefix, a 3-token verify window and a
1-token decode, all float32, all compared with the same steps on one device.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_linear_jax.cache import contiguous_batch
from kimi_linear_jax.model import commit_kda, for_serving, merge
from kimi_linear_jax.parallel.mesh import make_parallel
from kimi_linear_jax.parallel.rules import init_cache, shard_model
from kimi_linear_jax.presets import preset
from kimi_linear_jax.testing import random_model
from tests.helpers import assert_close

CONFIG = preset("tiny-tp8")
B, N1, N2, W, PAGE = 2, 13, 6, 3, 4  # rows, chunk 1, chunk 2, verify window, page a rank
LENS1, LENS2 = np.array([13, 9]), np.array([6, 4])  # ragged rows
PLANS = [(2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (4, 4), (8, 2), (8, 8)]
# The default run keeps pure TP and the full mesh (the combine tests below run tp 4 x dcp 2 as
# the engine serves it); tp 4 x dcp 2 here is heavy, the rest are marked slow.
PLAN_MARKS = {(2, 1): (), (8, 8): (), (4, 2): pytest.mark.heavy}


@functools.cache
def base_model():
    return random_model(CONFIG, seed=3)


@functools.cache
def ids():
    return np.random.default_rng(5).integers(0, CONFIG.vocab_size, (B, N1 + N2 + W + 1))


def run_steps(model):
    """(prefill logits, prefix-chunk logits, verify logits, decode logits), on host."""
    par = model.par
    page = PAGE * par.dcp
    total = N1 + N2 + W + 1
    n_pages = B * -(-total // page) + 1
    cache = init_cache(
        CONFIG, par, num_slots=B + 1, num_pages=n_pages, page_size=page, dtype=jnp.float32
    )
    batch = contiguous_batch(B, total, page, lengths=LENS1)
    # Page ids shuffled across rows: the block table, not the layout, must find each page.
    table = np.random.default_rng(1).permutation(n_pages)[: batch.block_table.size]
    batch = batch._replace(block_table=jnp.asarray(table.reshape(batch.block_table.shape)))
    graphdef, params = nnx.split(model)
    x = jnp.asarray(ids(), jnp.int32)

    @jax.jit
    def steps(params, cache, x):
        m = merge(graphdef, params)
        a, cache = m.prefill(x[:, :N1], cache, batch)
        b1 = batch._replace(start=jnp.asarray(LENS1, jnp.int32), lengths=jnp.asarray(LENS2))
        b, cache = m.prefill(x[:, N1 : N1 + N2], cache, b1, has_prefix=True)
        start = jnp.asarray(LENS1 + LENS2, jnp.int32)
        bv = batch._replace(start=start, lengths=jnp.asarray([W, W - 1], jnp.int32))
        # The verify keeps its per-step inputs (as a speculative verify does) and the replay
        # commit writes the sharded state the decode below reads.
        c, cache, inputs = m.verify(x[:, N1 + N2 : N1 + N2 + W], cache, bv, keep="inputs")
        cache = commit_kda(cache, inputs, bv.slots, bv.lengths, after=c)
        bd = batch._replace(start=start + bv.lengths, lengths=jnp.ones(B, jnp.int32))
        d, cache = m.decode(x[:, -1:], cache, bd)
        return a, b, c, d

    return jax.device_get(steps(params, cache, x))


@functools.cache
def single():
    return run_steps(base_model())


def _compare(got, want):
    names = ("prefill", "prefix chunk", "verify", "decode")
    for g, w, name in zip(got, want, names, strict=True):
        # Padded positions carry no meaning; compare the rows' valid tokens only.
        assert_close(g, w, atol=2e-5, rtol_rms=2e-6, name=name)


@pytest.mark.parametrize(
    "tp,dcp",
    [
        pytest.param(
            t,
            d,
            id=f"tp{t}-dcp{d}",
            marks=PLAN_MARKS.get((t, d), pytest.mark.slow),
        )
        for t, d in PLANS
    ],
)
def test_logits_equal_one_device(tp, dcp):
    model = shard_model(base_model(), make_parallel(CONFIG, tp, dcp))
    _compare(run_steps(model), single())


# As the engine runs it (`for_serving`): W_UK / W_UV split out of kv_b_proj and placed by its
# rules, the head block of W_UV taken per rank under replicate_q_proj.
# a2a with a replicated q_proj is heavy: each of its parts runs in one of the other two.
@pytest.mark.parametrize(
    "combine,replicate",
    [("a2a", False), ("ag_rs", True), pytest.param("a2a", True, marks=pytest.mark.heavy)],
)
def test_combines_and_replicated_q_proj_equal_one_device(combine, replicate):
    par = make_parallel(CONFIG, 4, 2, combine=combine, replicate_q_proj=replicate)
    _compare(run_steps(for_serving(shard_model(base_model(), par))), single())


def test_no_cache_forward_and_gradient_equal_one_device():
    """The research entry (`model(ids)`) and its gradient, sharded at tp 4 / dcp 2."""
    model = base_model()
    sharded = shard_model(model, make_parallel(CONFIG, 4, 2))
    x = jnp.asarray(ids()[:, :9], jnp.int32)

    def loss(m):
        return jnp.mean(jax.nn.logsumexp(m(x), axis=-1))

    want_l, want_g = nnx.jit(nnx.value_and_grad(loss))(model)
    got_l, got_g = nnx.jit(nnx.value_and_grad(loss))(sharded)
    assert_close(got_l, want_l, atol=1e-5, rtol_rms=1e-6, name="loss")
    want = dict(nnx.to_flat_state(want_g))
    for path, g in nnx.to_flat_state(got_g):
        assert_close(g[...], want[path][...], atol=1e-5, rtol_rms=1e-4, name=str(path))
