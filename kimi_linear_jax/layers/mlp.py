"""Dense SwiGLU MLP: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import jax
from flax import nnx

from kimi_linear_jax.layers.linear import Linear


class MLP(nnx.Module):
    def __init__(self, hidden: int, intermediate: int, *, dtype, rngs: nnx.Rngs):
        self.gate_proj = Linear(hidden, intermediate, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(hidden, intermediate, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(intermediate, hidden, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
