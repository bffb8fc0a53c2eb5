"""Causal depthwise short convolution (kernel W = 4) with its decode window.

The window holds the last W - 1 *pre-conv* inputs of a sequence: it is all the conv needs to
continue a sequence, so prefill, decode and verify share one function over `[window, x]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_linear_jax.layers.linear import init_normal, param


def causal_conv(x: jax.Array, window: jax.Array, weight: jax.Array) -> jax.Array:
    """Depthwise causal conv, no activation.

    x [B, T, P], window [B, W-1, P] (the inputs before x), weight [P, 1, W] -> [B, T, P].
    Computed in the weight's dtype, as the reference does.
    """
    T = x.shape[1]
    W = weight.shape[-1]
    xw = jnp.concatenate([window.astype(weight.dtype), x.astype(weight.dtype)], axis=1)
    taps = weight[:, 0, :]  # [P, W]; tap W-1 multiplies the current token
    return sum(xw[:, j : j + T] * taps[:, j] for j in range(W))


def next_window(window: jax.Array, x: jax.Array, lengths: jax.Array | None = None) -> jax.Array:
    """The last W-1 inputs of `[window, x[:lengths]]` per row: [B, W-1, P].

    `lengths` [B] counts the valid tokens of each row (right padding); None means all T.
    """
    Wm1 = window.shape[1]
    xw = jnp.concatenate([window, x.astype(window.dtype)], axis=1)
    if lengths is None:
        return xw[:, xw.shape[1] - Wm1 :]
    idx = lengths[:, None] + jnp.arange(Wm1)[None, :]  # [B, W-1] into xw
    return jnp.take_along_axis(xw, idx[:, :, None], axis=1)


def window_after_each_step(window: jax.Array, x: jax.Array) -> jax.Array:
    """Conv windows after each step t of x: [B, T, W-1, P] (what a verify commits from)."""
    Wm1 = window.shape[1]
    T = x.shape[1]
    xw = jnp.concatenate([window, x.astype(window.dtype)], axis=1)
    idx = jnp.arange(T)[:, None] + 1 + jnp.arange(Wm1)[None, :]  # [T, W-1]
    return xw[:, idx]


class ShortConv(nnx.Module):
    """silu(causal_conv(x)). weight [P, 1, W] as in the checkpoint."""

    def __init__(self, channels: int, kernel_size: int, *, dtype, rngs: nnx.Rngs):
        w = init_normal(rngs, (channels, 1, kernel_size), dtype, std=0.2)
        self.weight = param(w, ("heads", None, None))  # depthwise: channels follow the heads

    def __call__(self, x: jax.Array, window: jax.Array) -> jax.Array:
        return jax.nn.silu(causal_conv(x, window, self.weight[...])).astype(x.dtype)
