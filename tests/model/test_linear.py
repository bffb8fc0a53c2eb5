"""`Linear`'s two ways to multiply: one product, or one matrix-vector product per row (a few
rows, a small matrix, on a CPU), which must agree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_linear_jax.layers import linear
from kimi_linear_jax.layers.linear import Linear, row_products


def _layer(inp: int, out: int) -> Linear:
    return Linear(inp, out, dtype=jnp.float32, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("shape", [(2, 64), (5, 64), (1, 3, 64), (6, 64), (1, 64)])
def test_row_products_equal_one_product(shape):
    layer = _layer(64, 48)
    x = jnp.asarray(np.random.default_rng(0).standard_normal(shape), jnp.float32)
    want = jnp.einsum("...i,oi->...o", x, layer.weight[...])
    got = jax.jit(lambda x: layer(x))(x)
    assert got.shape == (*shape[:-1], 48)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def _loops(layer: Linear, rows: int) -> bool:
    jaxpr = jax.make_jaxpr(lambda x: layer(x))(jnp.zeros((rows, 64), jnp.float32))
    return any(e.primitive.name == "scan" for e in jaxpr.jaxpr.eqns)


def test_row_products_rule():
    layer = _layer(64, 48)
    w = layer.weight[...]
    rows = [n for n in range(1, 9) if row_products(jnp.zeros((n, 64)), w)]
    assert rows == list(range(2, linear.ROW_PRODUCTS_UP_TO + 1))
    assert [_loops(layer, n) for n in (1, 2, 5, 6)] == [False, True, True, False]
    # A matrix larger than the limit always takes one product.
    big = jnp.zeros((linear.ROW_PRODUCT_MAX_BYTES // 4 // 64 + 1, 64), jnp.float32)
    assert not row_products(jnp.zeros((3, 64)), big)


def test_row_products_gradient_equals_one_product():
    layer = _layer(16, 8)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 16)), jnp.float32)

    graphdef, state = nnx.split(layer)

    def loss(state, x):
        return (nnx.merge(graphdef, state)(x) ** 2).sum()

    g_state, g_x = jax.grad(loss, argnums=(0, 1))(state, x)
    w = layer.weight[...]
    want = jax.grad(lambda w, x: ((x @ w.T) ** 2).sum(), argnums=(0, 1))(w, x)
    for g, r in zip((g_state["weight"][...], g_x), want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)
