"""RMSNorm (and its gated per-head variant used at the KDA output)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / sqrt(mean(x^2) + eps) over the last axis, in float32 (or float64)."""
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """w * x / rms(x): normalised in fp32, cast back to the input dtype, then scaled (as HF)."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.weight[...]
        return w * rms_normalize(x, self.eps).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """rmsnorm(o) * w * sigmoid(gate), all in fp32, per head (last axis = head dim)."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        y = rms_normalize(x, self.eps)
        y = y * self.weight[...].astype(y.dtype)
        y = y * jax.nn.sigmoid(gate.astype(y.dtype))
        return y.astype(x.dtype)
