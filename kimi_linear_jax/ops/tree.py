"""Tree-shaped verify windows (speculative decoding with a draft tree), in pure JAX.

A window of T nodes per row: node 0 is the root (the row's last committed token), and
parents [B, T] int32 has parents[:, 0] = -1 and 0 <= parents[b, i] < i for i >= 1. Node i's
sequence is the cache followed by its root-to-node path, so every per-node quantity is the one
a chain window over that path would give at its last step. A chain (parents = i - 1) is the
plain verify window. T is static and small (a draft tree, T <= 17): the helpers below unroll
or scan over it.

References beside the tree paths: `ancestors` by definition, `conv_index` against the chain's
`causal_conv` taps, `kda_tree_window` against `kda_window` over each root-to-node path
(tests/model/test_tree_verify.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kimi_linear_jax.ops.kda import _prepare, _window_update


def _ancestor_columns(parents: jax.Array, n: int) -> jax.Array:
    """[B, T, n]: column j is the j-th ancestor of each node (0: itself), -1 past the root."""
    B, T = parents.shape
    cols = [jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))]
    for _ in range(n - 1):
        prev = cols[-1]
        up = jnp.take_along_axis(parents.astype(jnp.int32), jnp.maximum(prev, 0), axis=1)
        cols.append(jnp.where(prev >= 0, up, -1))
    return jnp.stack(cols, axis=2)


def ancestors(parents: jax.Array) -> jax.Array:
    """anc [B, T, T]: anc[b, i, j] = the j-th ancestor of node i (j = 0: i), -1 past the root."""
    return _ancestor_columns(parents, parents.shape[1])


def depths(parents: jax.Array) -> jax.Array:
    """[B, T] int32: each node's distance from the root (root 0); its position past the cache."""
    return (jnp.sum(ancestors(parents) >= 0, axis=2) - 1).astype(jnp.int32)


def visibility(parents: jax.Array) -> jax.Array:
    """[B, T, T] bool: key node j is an ancestor of query node i, or i itself."""
    T = parents.shape[1]
    anc = ancestors(parents)
    return jnp.any(anc[..., :, None] == jnp.arange(T)[None, None, None, :], axis=2)


def conv_index(parents: jax.Array, width: int) -> jax.Array:
    """[B, T, W] int32 into `[window (W-1 inputs before the root), x (T nodes)]`: tap j of node
    i (tap W-1 the node itself) reads the input W-1-j steps back on its root-to-node path,
    or the window once the path runs out. A chain gives i + j: `causal_conv`'s taps."""
    lag = width - 1 - jnp.arange(width)  # [W]: steps back per tap
    anc = _ancestor_columns(parents, width)[:, :, lag]  # [B, T, W]
    d = depths(parents)
    # Past the root (lag > depth) the tap falls into the window: index W-1 + depth - lag >= 0.
    return jnp.where(anc >= 0, width - 1 + anc, width - 1 + d[..., None] - lag).astype(jnp.int32)


def kda_tree_window(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None,
    parents: jax.Array,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`kda_window` over a tree: node i's state is its parent's state (the root's:
    initial_state) advanced by node i's inputs, by the window's own step (`_window_update`),
    so a chain equals `kda_window` (tested).

    q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; initial_state [B, H, K, V];
    parents [B, T] -> o [B, T, H, V], states [B, T, H, K, V] (states[:, i]: after node i).
    A scan over nodes in index order that carries every node's state: a parent (index < i)
    is always done before its children."""
    q, k, v, g, beta, state, scale = _prepare(q, k, v, g, beta, initial_state, scale)
    B, T = parents.shape
    rows = jnp.arange(B)

    def step(states, xs):
        i, p, q_t, k_t, v_t, g_t, b_t = xs
        prev = states[rows, jnp.maximum(p, 0)]  # [B, H, K, V]
        s = jnp.where((p < 0)[:, None, None, None], state, prev)
        s, o_t = _window_update(s, k_t, v_t, g_t, b_t, q_t * scale)
        return lax.dynamic_update_index_in_dim(states, s, i, axis=1), o_t

    steps = (jnp.arange(T), jnp.moveaxis(parents.astype(jnp.int32), 1, 0))
    xs = (*steps, *(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta)))
    states = jnp.zeros((B, T, *state.shape[1:]), state.dtype)
    states, o = lax.scan(step, states, xs)
    return jnp.moveaxis(o, 0, 1), states
