"""The draft model's trees (`DraftModelDrafter.propose_tree`): the layout of its top-k trees
and what its rollback after a tree verify reads from the accepted path.

The draft runs its greedy chain c_1 .. c_D as for a chain window (fused decode steps, one
more than D so that the state after c_D exists) and takes each step's `topk` best tokens: at
depth d the top-1 is c_d, which the chain continues from, and the other `topk - 1` are
leaves. Nodes go depth by depth, the chain node first at each: node j + 1 (j from 0) is rank
j % topk of depth j // topk + 1, so a row of m nodes is the first m nodes of the full tree,
its last depth trimmed, and D = ceil(m / topk).

An accepted path is then a prefix of the chain `[last, c_1 .. c_h]`, whose states the draft's
per-step states hold, and at most one leaf after it, which only a pass over that token can
write (`held_on_chain`, `window_tail`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def depth_for(nodes: int, topk: int) -> int:
    """The chain's length for a tree of `nodes` nodes."""
    return -(-nodes // topk)


def tree_parents(num: np.ndarray, n: int, topk: int) -> np.ndarray:
    """[B, n] parents of rows with num[b] nodes of the top-k tree (padding: parent j)."""
    j = np.arange(n)
    # Depth 1 hangs off the root; depth d + 1 off depth d's chain node, node (d - 1)k + 1.
    parent = np.where(j < topk, 0, (j // topk - 1) * topk + 1)
    return np.where(j[None, :] < num[:, None], parent[None, :], j[None, :]).astype(np.int32)


@functools.partial(jax.jit, static_argnames=("n",))
def tree_drafts(top, num, rows, other, *, n: int):
    """[B, n] drafts: for the rows `rows`, the top-k tree of top [B, D, topk] (each step's
    best tokens, the picked one first) cut to num[b] nodes, padding 0; others' from `other`."""
    b = top.shape[0]
    flat = top.reshape(b, -1)[:, :n]
    flat = jnp.pad(flat, ((0, 0), (0, n - flat.shape[1])))
    valid = jnp.arange(n)[None, :] < num[:, None]
    return jnp.where(rows[:, None], jnp.where(valid, flat, 0), other).astype(jnp.int32)


def held_on_chain(window, chain, commit_lens):
    """[B] how many leading tokens of each row's accepted path `window[b, :commit_lens[b]]`
    are `[last, c_1 ..]` of its chain [B, D] (so the draft's per-step states hold them):
    the root, then the chain tokens the path takes (distinct siblings: a token equal to
    c_d is the node c_d)."""
    k = min(chain.shape[1], window.shape[1] - 1)
    taken = jnp.arange(k)[None, :] < (commit_lens - 1)[:, None]
    on = (window[:, 1 : 1 + k] == chain[:, :k]) & taken
    held = 1 + jnp.cumprod(on.astype(jnp.int32), axis=-1).sum(-1)
    return jnp.minimum(held, commit_lens)


def window_tail(window, held, commit_lens, width: int):
    """(ids [B, width], lengths [B]): the accepted tokens of each row after its first held[b],
    the ones its per-step states do not hold, left-aligned (zeros after)."""
    t = window.shape[1]
    at = held[:, None] + jnp.arange(width)[None, :]
    lengths = jnp.clip(commit_lens - held, 0, width)
    ids = jnp.take_along_axis(window, jnp.minimum(at, t - 1), axis=1)
    return jnp.where(jnp.arange(width)[None, :] < lengths[:, None], ids, 0), lengths
