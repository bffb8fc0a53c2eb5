"""Linear and embedding layers that store weights in the checkpoint's `[out, in]` layout.

Keeping the HF layout means a parameter's path *is* its checkpoint name: loading and saving
need no transposes and no name table. `axes` names each weight's logical axes (see
`kimi_linear_jax/parallel/rules.py`): a layer built for a mesh holds its shard of the weight
and computes on it as if it were the whole (column-parallel: a slice of the outputs;
row-parallel: a partial sum that the block all-reduces).
"""

from __future__ import annotations

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
        return jnp.einsum("...i,oi->...o", x.astype(w.dtype), w)


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
