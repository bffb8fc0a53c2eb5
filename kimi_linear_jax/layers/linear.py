"""Linear and embedding layers that store weights in the checkpoint's `[out, in]` layout.

Keeping the HF layout means a parameter's path *is* its checkpoint name: loading and saving
need no transposes and no name table. `axes` names each weight's logical axes (see
`kimi_linear_jax/parallel/rules.py`): a layer built for a mesh holds its shard of the weight
and computes on it as if it were the whole (column-parallel: a slice of the outputs;
row-parallel: a partial sum that the block all-reduces).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi_linear_jax.parallel.mesh import SINGLE, Parallel

Logical = tuple[str | None, ...] | None


def acc_dtype(*xs) -> jnp.dtype:
    """The accumulation dtype: float32, or float64 when the inputs are float64 (the gradient
    checks run the model in float64)."""
    return jnp.result_type(jnp.float32, *xs)


def _host_rng(key: jax.Array) -> np.random.Generator | None:
    """A numpy generator seeded from a concrete key; None under a trace (eval_shape, jit)."""
    try:
        return np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel())
    except jax.errors.TracerArrayConversionError:
        return None


def init_normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, std: float = 0.02) -> jax.Array:
    """N(0, std^2) weights. Eagerly the draw happens in numpy: an eager jax.random call
    compiles once per shape, which made building even the tiny model take ~20 s on a CPU."""
    key = rngs.params()
    host = _host_rng(key)
    if host is None:
        return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    return jnp.asarray(std * host.standard_normal(shape, np.float32), dtype)


def init_uniform(rngs: nnx.Rngs, shape: tuple[int, ...], low: float, high: float) -> jax.Array:
    """U(low, high) float32 values, drawn like `init_normal`."""
    key = rngs.params()
    host = _host_rng(key)
    if host is None:
        return jax.random.uniform(key, shape, jnp.float32, low, high)
    return jnp.asarray(host.uniform(low, high, shape), jnp.float32)


class Linear(nnx.Module):
    """y = x @ weight.T, no bias (Kimi Linear has none). weight [out, in]."""

    def __init__(
        self, in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs, axes: Logical = None
    ):
        self.weight = param(init_normal(rngs, (out_features, in_features), dtype), axes)

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.weight[...]
        x = x.astype(w.dtype)
        if row_products(x, w):
            rows = x.reshape(-1, x.shape[-1])
            out = jax.lax.map(lambda row: w @ row, rows)
            return out.reshape(*x.shape[:-1], w.shape[0])
        return jnp.einsum("...i,oi->...o", x, w)


# XLA:CPU hands a product of two or more rows to YNNPACK, whose fixed cost per call (0.05 to
# 0.1 ms on the 2-core development machine) is larger than the product itself for a small
# matrix; a matrix-vector product per row does not pay it while the matrix stays in cache.
# A verify window of 2 to 5 rows of the built-in model costs 1.24-1.46 plain steps this way
# instead of 1.48-1.70 (benchmarks/RESULTS.md, "row products"); from about 6 rows on, and for
# matrices the cache does not hold, one product is faster.
ROW_PRODUCTS_UP_TO = 5
ROW_PRODUCT_MAX_BYTES = 2 << 20


def row_products(x: jax.Array, w: jax.Array) -> bool:
    """Whether `Linear` computes x @ w.T one row at a time (see ROW_PRODUCTS_UP_TO)."""
    rows = math.prod(x.shape[:-1])
    small = w.size * w.dtype.itemsize <= ROW_PRODUCT_MAX_BYTES
    return 2 <= rows <= ROW_PRODUCTS_UP_TO and small and jax.default_backend() == "cpu"


class Embed(nnx.Module):
    """Token embedding, weight [vocab, hidden], vocab-sharded under TP: each rank looks up the
    ids in its row range, zeros the rest, and one all-reduce sums the ranks."""

    def __init__(
        self, vocab_size: int, hidden_size: int, *, dtype, rngs: nnx.Rngs, par: Parallel = SINGLE
    ):
        self.par = par
        self.weight = param(init_normal(rngs, (vocab_size, hidden_size), dtype), ("vocab", None))

    def __call__(self, ids: jax.Array) -> jax.Array:
        w = self.weight[...]
        if self.par.tp == 1:
            return jnp.take(w, ids, axis=0)
        local = ids - self.par.tp_rank() * w.shape[0]
        mine = (local >= 0) & (local < w.shape[0])
        x = jnp.take(w, jnp.where(mine, local, 0), axis=0)
        return self.par.psum(jnp.where(mine[..., None], x, jnp.zeros((), w.dtype)))


def param(value: jax.Array, axes: Logical = None) -> nnx.Param:
    """A parameter tagged with its logical axes (None: replicated)."""
    return nnx.Param(value) if axes is None else nnx.Param(value, logical=tuple(axes))
