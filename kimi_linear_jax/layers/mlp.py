"""Dense SwiGLU MLP: down(silu(gate(x)) * up(x)). Under TP gate/up are column-parallel and down
row-parallel over the intermediate axis ("mlp"): the output is a partial sum that the decoder
block all-reduces (once, with the routed experts' partial when it is the shared expert)."""

from __future__ import annotations

import jax
from flax import nnx

from kimi_linear_jax.layers.linear import Linear


class MLP(nnx.Module):
    def __init__(self, hidden: int, intermediate: int, *, dtype, rngs: nnx.Rngs):
        col = dict(dtype=dtype, rngs=rngs, axes=("mlp", None))
        self.gate_proj = Linear(hidden, intermediate, **col)
        self.up_proj = Linear(hidden, intermediate, **col)
        self.down_proj = Linear(intermediate, hidden, dtype=dtype, rngs=rngs, axes=(None, "mlp"))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
