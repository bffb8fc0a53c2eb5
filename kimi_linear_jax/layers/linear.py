"""Linear and embedding layers that store weights in the checkpoint's `[out, in]` layout.

Keeping the HF layout means a parameter's path *is* its checkpoint name: loading and saving
need no transposes and no name table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def init_normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, std: float = 0.02) -> jax.Array:
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
    """y = x @ weight.T, no bias (Kimi Linear has none). weight [out, in]."""

    def __init__(self, in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(init_normal(rngs, (out_features, in_features), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.weight[...]
        return jnp.einsum("...i,oi->...o", x.astype(w.dtype), w)


class Embed(nnx.Module):
    """Token embedding, weight [vocab, hidden]."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(init_normal(rngs, (vocab_size, hidden_size), dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0)
