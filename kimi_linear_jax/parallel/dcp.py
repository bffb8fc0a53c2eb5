"""Decode context parallelism (DCP): a sequence's MLA latent cache spread over a 'dcp' mesh axis.

Placement (interleave I = 1): token p of a sequence lives on rank ``p % c`` at rank-local
position ``p // c``. The allocator works in virtual pages of ``page_size * c`` tokens and one
block table, the same on every rank. The global cache array is
``[num_pages, page_size * c, L + R]`` sharded ``P(None, 'dcp', None)``, so each device holds a
physical ``[num_pages, page_size, L + R]``. Inside a virtual page, in-page position ``i`` lives
on rank ``r = i % c`` at local slot ``j = i // c``, stored at global array index
``r * page_size + j``: the contiguous block of device r then holds exactly
the positions with ``p % c == r``, and rank r's local sequence is a plain paged sequence
(page ids from the shared block table, page size ``page_size``, local position ``p // c``).

Attention: every rank holds all H heads' queries (replicated), attends to its local slice with
rank-local lengths, and the partials ``(o_r, lse_r)`` are combined by log-sum-exp. Verify under
DCP: row t of a T-token window sees ``ctx - T + 1 + t`` global keys, so its rank-local length is
``local_len(ctx - T + 1 + t, r)`` -- never ``local_len(ctx, r) - (T - 1 - t)``.

The model uses these rank-local pieces (`write_local`, `gather_heads`, the combines) inside
its own shard_map over the TP x DCP mesh (`kimi_linear_jax/parallel/mesh.py`): the absorbed query
of the group's `H * dcp / tp` heads is all-gathered over 'dcp', each rank attends its tokens, and
the partials return to the rank's `H / tp` head shard. The same pieces on a 1-D 'dcp' mesh with
every head on every rank, the host metadata and the layout converters are test harness
(`tests/kernels/dcp_helpers.py`).

Nothing here sizes scratch from local heads or a fixed T: every buffer (partials [B, T, H, L],
gathered lse [c, B, T, H], gathered o [c, B, T, H, L] for the all-gather combine) takes the full
H and the real T from the query it is given. Nothing here is jitted itself: it runs inside a
jitted step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.mla_reference import merge_stacked_partials
from kimi_linear_jax.ops.mla import write_rows
from kimi_linear_jax.parallel.mesh import DCP_AXIS

# --------------------------------------------------------------------------- placement


def local_len(n: jax.Array, r: jax.Array | int, c: int) -> jax.Array:
    """Keys of a length-n prefix that live on rank r: ``n // c + (r < n % c)`` (0 for n <= 0)."""
    n = jnp.maximum(jnp.asarray(n), 0)
    return (n // c + (jnp.asarray(r) < n % c)).astype(jnp.int32)


def dcp_coords(pos, page_size: int, c: int):
    """Global sequence position(s) -> (virtual page index, owner rank, local slot in the page).

    Works on ints, numpy and jax arrays. The rank-local position is
    ``vpage * page_size + slot == pos // c``.
    """
    vpage, i = pos // (page_size * c), pos % (page_size * c)
    return vpage, i % c, i // c


# --------------------------------------------------------------------------- combine


def combine_all_gather(o: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inside shard_map over 'dcp': all-gather (o, lse) of every rank, then the same local merge
    on every rank. One collective phase, but each rank receives (c - 1) * |o|."""
    o_all = jax.lax.all_gather(o, DCP_AXIS)  # [c, B, T, H, L]
    lse_all = jax.lax.all_gather(lse, DCP_AXIS)  # [c, B, T, H]
    return merge_stacked_partials(o_all, lse_all)


def combine_lse_psum(o: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inside shard_map over 'dcp': all-gather the lse only ([c, B, T, H], tiny), merge it locally
    (identical on every rank), rescale the own partial by exp(lse_r - lse), all-reduce o.

    The default combine. Against all-gather of (o, lse) + local merge and all-to-all over heads +
    local merge (+ all-gather of the merged heads, to give the replicated output the W_UV / o_proj
    that follow want): it moves ~2 (c - 1) / c * |o| per rank like the all-to-all, not
    (c - 1) * |o| like the all-gather, works for any H (the all-to-all needs H % c == 0; odd head
    counts are a test case), and was the fastest of the three at every measured size on 8
    emulated CPU devices (`python -m benchmarks kernel --only dcp_combine`; c = 8, B = 32, T = 1,
    H = 32, L = 512:
    5.1 ms vs 35 ms all-gather, 11 ms all-to-all + all-gather; at c = 2, B = 1 all within
    0.15 ms). Its cost: two dependent collectives, so at tiny B*T on a real interconnect, where
    latency dominates, the one-phase all-gather may win: measure there.
    """
    lse_all = jax.lax.all_gather(lse, DCP_AXIS)  # [c, B, T, H]
    m = jnp.max(lse_all, axis=0)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    total = jnp.sum(jnp.exp(lse_all - m), axis=0)
    safe = jnp.where(total > 0, total, 1.0)
    lse_out = jnp.where(total > 0, m + jnp.log(safe), -jnp.inf)
    w = jnp.exp(lse - m) / safe  # 0 for an empty slice (and for rows empty everywhere)
    o_scaled = jnp.where((w > 0)[..., None], w[..., None] * o, 0.0)
    return jax.lax.psum(o_scaled, DCP_AXIS), lse_out


# --------------------------------------------------------------------------- rank-local pieces


def local_targets(block_table, start, lengths, T: int, page_size: int, r, c: int):
    """Rank r's part of a DCP write, as `ops.mla.targets`: of the rows at positions
    start[b] + t (t < lengths[b]) the tokens it owns go to (column of the block table, slot in
    the local page), [B, T] each; the rest, and rows past the block table, to the column past
    the table (dropped)."""
    pos = start[:, None] + jnp.arange(T)[None, :]  # [B, T]
    vpage, owner, slot = dcp_coords(pos, page_size, c)
    n_vp = block_table.shape[1]
    valid = (jnp.arange(T)[None, :] < lengths[:, None]) & (owner == r) & (vpage < n_vp)
    return jnp.where(valid, vpage, n_vp), slot


def write_local(cache_l, rows, block_table, start, lengths, r, c: int) -> jax.Array:
    """Rank r's part of a DCP write: of rows [B, T, L + R] at positions start[b] + t
    (t < lengths[b]) it stores the tokens it owns into its local pages
    cache_l [num_pages, page_size, L + R]. Rows past a length or the block table are dropped."""
    where = local_targets(block_table, start, lengths, rows.shape[1], cache_l.shape[1], r, c)
    return write_rows(cache_l, rows, block_table, *where)


def gather_heads(x: jax.Array) -> jax.Array:
    """[B, T, H', ...] head shard -> [B, T, H' * c, ...] of the whole DCP group (rank order)."""
    return jax.lax.all_gather(x, DCP_AXIS, axis=2, tiled=True)


def combine_ag_rs(o: jax.Array, lse: jax.Array, c: int) -> tuple[jax.Array, jax.Array]:
    """vLLM's combine: all-gather the lse [c, B, T, Hg] (small), rescale the own partial by
    exp(lse_r - lse), reduce-scatter o over heads. o [B, T, Hg, L] -> [B, T, Hg / c, L]."""
    lse_all = jax.lax.all_gather(lse, DCP_AXIS)
    m = jnp.max(lse_all, axis=0)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    total = jnp.sum(jnp.exp(lse_all - m), axis=0)
    safe = jnp.where(total > 0, total, 1.0)
    lse_out = jnp.where(total > 0, m + jnp.log(safe), -jnp.inf)
    w = jnp.exp(lse - m) / safe  # 0 for an empty slice
    o = jnp.where((w > 0)[..., None], w[..., None] * o, 0.0)
    # Across CPU processes gloo's reduce-scatter gives up after 30 s (jax-ml/jax#40831); it
    # never waits here: its input needs the all-gather above, at which the processes meet.
    o = jax.lax.psum_scatter(o, DCP_AXIS, scatter_dimension=2, tiled=True)
    return o, _own_heads(lse_out, c)


def combine_a2a(o: jax.Array, lse: jax.Array, c: int) -> tuple[jax.Array, jax.Array]:
    """sglang's / tpu-inference's combine: one all-to-all sends head block j of every rank's
    (o, lse) to rank j, which merges its c partials locally. o [B, T, Hg, L] -> [B, T, Hg/c, L].
    (o and lse travel as one array: the lse rides as an extra column.)"""
    B, T, Hg, L = o.shape
    packed = jnp.concatenate([o, lse[..., None]], axis=-1).reshape(B, T, c, Hg // c, L + 1)
    packed = jnp.moveaxis(packed, 2, 0)  # [c, B, T, H', L + 1], block j goes to rank j
    got = jax.lax.all_to_all(packed, DCP_AXIS, split_axis=0, concat_axis=0, tiled=True)
    return merge_stacked_partials(got[..., :L], got[..., L])


def _own_heads(x: jax.Array, c: int) -> jax.Array:
    """This DCP rank's block of the head axis (axis 2) of a group-wide array."""
    n = x.shape[2] // c
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(DCP_AXIS) * n, n, axis=2)


HEAD_COMBINES = {"ag_rs": combine_ag_rs, "a2a": combine_a2a}
