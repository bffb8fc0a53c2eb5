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


def _taps(xw: jax.Array, idx: jax.Array) -> jax.Array:
    """xw [B, S, P] at idx [B, T, n] -> [B, T, n, P]."""
    return xw[jnp.arange(xw.shape[0])[:, None, None], idx]


def tree_conv(x: jax.Array, window: jax.Array, weight: jax.Array, idx: jax.Array) -> jax.Array:
    """`causal_conv` over a draft tree: node i's taps are idx[:, i] into `[window, x]`
    (`ops.tree.conv_index`), the last W inputs of its root-to-node path. x [B, T, P],
    window [B, W-1, P], idx [B, T, W] -> [B, T, P]; the chain's products in the chain's
    order, so a chain tree gives `causal_conv` exactly."""
    W = weight.shape[-1]
    xw = jnp.concatenate([window.astype(weight.dtype), x.astype(weight.dtype)], axis=1)
    taps = _taps(xw, idx)  # [B, T, W, P]
    w = weight[:, 0, :]
    return sum(taps[:, :, j] * w[:, j] for j in range(W))


def window_after_each_node(window: jax.Array, x: jax.Array, idx: jax.Array) -> jax.Array:
    """Conv windows after each node of a tree: [B, T, W-1, P], the last W-1 inputs of its
    path (what a commit of that node stores); a chain gives `window_after_each_step`."""
    xw = jnp.concatenate([window, x.astype(window.dtype)], axis=1)
    return _taps(xw, idx[:, :, 1:])


class ShortConv(nnx.Module):
    """silu(causal_conv(x)). weight [P, 1, W] as in the checkpoint."""

    def __init__(self, channels: int, kernel_size: int, *, dtype, rngs: nnx.Rngs):
        w = init_normal(rngs, (channels, 1, kernel_size), dtype, std=0.2)
        self.weight = param(w, ("heads", None, None))  # depthwise: channels follow the heads

    def __call__(self, x: jax.Array, window: jax.Array) -> jax.Array:
        return jax.nn.silu(causal_conv(x, window, self.weight[...])).astype(x.dtype)

    def tree(self, x: jax.Array, window: jax.Array, idx: jax.Array) -> jax.Array:
        """The same over a draft tree (`tree_conv`)."""
        return jax.nn.silu(tree_conv(x, window, self.weight[...], idx)).astype(x.dtype)
