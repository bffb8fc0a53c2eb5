"""Decode context parallelism (DCP): a sequence's MLA latent cache spread over a 'dcp' mesh axis.

Placement (interleave I = 1): token p of a sequence lives on rank ``p % c`` at rank-local
position ``p // c``. The allocator works in virtual pages of ``page_size * c`` tokens and one
block table, the same on every rank. The global cache array is
``[num_pages, page_size * c, L + R]`` sharded ``P(None, 'dcp', None)``, so each device holds a
physical ``[num_pages, page_size, L + R]``. Inside a virtual page, in-page position ``i`` lives
on rank ``r = i % c`` at local slot ``j = i // c``, stored at global array index
``r * page_size + j`` (``to_dcp_layout``): the contiguous block of device r then holds exactly
the positions with ``p % c == r``, and rank r's local sequence is a plain paged sequence
(page ids from the shared block table, page size ``page_size``, local position ``p // c``).

Attention: every rank holds all H heads' queries (replicated), attends to its local slice with
rank-local lengths, and the partials ``(o_r, lse_r)`` are combined by log-sum-exp. Verify under
DCP: row t of a T-token window sees ``ctx - T + 1 + t`` global keys, so its rank-local length is
``local_len(ctx - T + 1 + t, r)`` -- never ``local_len(ctx, r) - (T - 1 - t)``.

The model uses the rank-local pieces (`write_local`, `gather_heads`, `combine_to_heads`) inside
its own shard_map over the TP x DCP mesh (`kimi_linear_jax/parallel/mesh.py`): the absorbed query
of the group's `H * dcp / tp` heads is all-gathered over 'dcp', each rank attends its tokens, and
the partials return to the rank's `H / tp` head shard. `dcp_attention` / `dcp_write_latents`
below are the same pieces on a 1-D 'dcp' mesh with every head on every rank.

Nothing here sizes scratch from local heads or a fixed T: every buffer (partials [B, T, H, L],
gathered lse [c, B, T, H], gathered o [c, B, T, H, L] for the all-gather combine) takes the full
H and the real T from the query it is given. The entry points are not jitted themselves: they
are meant to run inside a jitted step (tests jit them with the mesh static).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kernels.mla_reference import merge_stacked_partials, mla_paged_attention_reference
from kimi_linear_jax.parallel.mesh import DCP_AXIS, shard_map

CACHE_SPEC = P(None, DCP_AXIS, None)

# backend(q_lat, q_pe, cache, block_table, kv_lens, *, sm_scale) -> (o, lse), the signature of
# mla_paged_attention_reference: natural-log lse, -inf (and o = 0) for rows that see no key.
AttentionBackend = Callable[..., tuple[jax.Array, jax.Array]]


# --------------------------------------------------------------------------- placement


def local_len(n: jax.Array, r: jax.Array | int, c: int) -> jax.Array:
    """Keys of a length-n prefix that live on rank r: ``n // c + (r < n % c)`` (0 for n <= 0)."""
    n = jnp.maximum(jnp.asarray(n), 0)
    return (n // c + (jnp.asarray(r) < n % c)).astype(jnp.int32)


def local_len_np(n: np.ndarray, r: np.ndarray | int, c: int) -> np.ndarray:
    """Host twin of :func:`local_len` (for scheduler metadata built in numpy)."""
    n = np.maximum(np.asarray(n), 0)
    return (n // c + (np.asarray(r) < n % c)).astype(np.int32)


def dcp_coords(pos, page_size: int, c: int):
    """Global sequence position(s) -> (virtual page index, owner rank, local slot in the page).

    Works on ints, numpy and jax arrays. The rank-local position is
    ``vpage * page_size + slot == pos // c``.
    """
    vpage, i = pos // (page_size * c), pos % (page_size * c)
    return vpage, i % c, i // c


def to_dcp_layout(positions, page_size: int, c: int):
    """In-page positions i of a virtual page -> index on the global in-page axis of the cache."""
    return (positions % c) * page_size + positions // c


def from_dcp_layout(index, page_size: int, c: int):
    """Inverse of :func:`to_dcp_layout`: global in-page index -> the in-page position it holds."""
    return (index % page_size) * c + index // page_size


def cache_to_dcp_layout(cache: jax.Array, c: int) -> jax.Array:
    """A plain paged cache [num_pages, page_size * c, D] (in-page axis in position order) -> the
    DCP layout (unsharded; ``jax.device_put`` it with :func:`cache_sharding`)."""
    page_size = cache.shape[1] // c
    return cache[:, from_dcp_layout(np.arange(page_size * c), page_size, c)]


def cache_from_dcp_layout(cache: jax.Array, c: int) -> jax.Array:
    """Inverse of :func:`cache_to_dcp_layout`: DCP layout -> plain position order."""
    page_size = cache.shape[1] // c
    return cache[:, to_dcp_layout(np.arange(page_size * c), page_size, c)]


def cache_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of the global DCP cache: the in-page token axis split over 'dcp'."""
    return NamedSharding(mesh, CACHE_SPEC)


def dcp_size(mesh: Mesh) -> int:
    return int(mesh.shape[DCP_AXIS])


# --------------------------------------------------------------------------- metadata


class ForwardMode(enum.Enum):
    DECODE = "decode"
    TARGET_VERIFY = "target_verify"


@dataclasses.dataclass(frozen=True)
class DcpMetadata:
    """kv_lens [B, T] global keys per query row; local_kv_lens [c, B, T] per-rank keys."""

    kv_lens: np.ndarray
    local_kv_lens: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.kv_lens.shape[1])


def num_query_tokens(mode: ForwardMode | str, num_draft: int) -> int:
    """T: 1 for DECODE (draft tokens are never added), num_draft + 1 for TARGET_VERIFY."""
    mode = ForwardMode(mode)
    return 1 if mode is ForwardMode.DECODE else num_draft + 1


def dcp_metadata(mode: ForwardMode | str, ctx, num_draft: int, c: int) -> DcpMetadata:
    """Host-side KV lengths for one step.

    ``ctx[b]``: keys visible to the last query row of sequence b, i.e. the sequence length with
    this step's T tokens already written (padding rows: 0). Row t sees ``ctx - T + 1 + t`` global
    keys (clipped at 0) and ``local_len(ctx - T + 1 + t, r)`` of them live on rank r.
    """
    T = num_query_tokens(mode, num_draft)
    ctx = np.asarray(ctx, np.int64)
    kv = np.maximum(ctx[:, None] - (T - 1) + np.arange(T)[None, :], 0)
    local = local_len_np(kv[None], np.arange(c)[:, None, None], c)
    return DcpMetadata(kv_lens=kv.astype(np.int32), local_kv_lens=local)


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
    emulated CPU devices (benchmarks/dcp_combine.py; c = 8, B = 32, T = 1, H = 32, L = 512:
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


# Combines to a replicated output (every head on every rank), for `dcp_attention`.
REPLICATED_COMBINES = {"lse_psum": combine_lse_psum, "all_gather": combine_all_gather}


# --------------------------------------------------------------------------- shard_map entry points


def _has_explicit_axes(mesh: Mesh) -> bool:
    types = getattr(mesh, "axis_types", None) or ()
    return any(str(t).endswith("Explicit") for t in types)


def _place(mesh: Mesh, args, specs):
    """With explicit mesh axes shard_map wants inputs already typed with the in_specs."""
    if not _has_explicit_axes(mesh):
        return args
    return tuple(
        jax.sharding.reshard(a, NamedSharding(mesh, s)) for a, s in zip(args, specs, strict=True)
    )


def write_local(cache_l, rows, block_table, start, lengths, r, c: int) -> jax.Array:
    """Rank r's part of a DCP write: of rows [B, T, L + R] at positions start[b] + t
    (t < lengths[b]) it stores the tokens it owns into its local pages
    cache_l [num_pages, page_size, L + R]. Rows past a length or the block table are dropped."""
    num_pages, page_size, _ = cache_l.shape
    T = rows.shape[1]
    pos = start[:, None] + jnp.arange(T)[None, :]  # [B, T]
    vpage, owner, slot = dcp_coords(pos, page_size, c)
    n_vp = block_table.shape[1]
    valid = (jnp.arange(T)[None, :] < lengths[:, None]) & (owner == r) & (vpage < n_vp)
    page = jnp.take_along_axis(block_table, jnp.clip(vpage, 0, n_vp - 1), axis=1)
    page = jnp.where(valid, page, num_pages)  # out of bounds: dropped
    return cache_l.at[page, slot].set(rows.astype(cache_l.dtype), mode="drop")


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


def dcp_write_latents(
    cache: jax.Array,
    rows: jax.Array,
    block_table: jax.Array,
    start: jax.Array,
    lengths: jax.Array,
    mesh: Mesh,
) -> jax.Array:
    """DCP twin of ``write_latents``: rows [B, T, L + R] go to positions start[b] + t,
    t < lengths[b]; each token is written only by its owning rank, into its local page slice.

    cache: global [num_pages, page_size * c, L + R] in DCP layout, sharded ``P(None,'dcp',None)``;
    block_table [B, max_pages] virtual page ids (replicated). Rows past a length, or past the
    block table, are dropped.
    """
    c = dcp_size(mesh)

    def body(cache_l, rows, block_table, start, lengths):
        r = jax.lax.axis_index(DCP_AXIS)
        return write_local(cache_l, rows, block_table, start, lengths, r, c)

    specs = (CACHE_SPEC, P(), P(), P(), P())
    args = _place(mesh, (cache, rows, block_table, start, lengths), specs)
    fn = shard_map(body, mesh, specs, CACHE_SPEC)
    return fn(*args)


def dcp_attention(
    q_lat: jax.Array,
    q_pe: jax.Array,
    cache: jax.Array,
    block_table: jax.Array,
    kv_lens: jax.Array,
    *,
    sm_scale: float,
    mesh: Mesh,
    backend: AttentionBackend = mla_paged_attention_reference,
    local_kv_lens: jax.Array | None = None,
    combine: str = "lse_psum",
) -> tuple[jax.Array, jax.Array]:
    """Absorbed paged MLA with the latent cache sharded over 'dcp'.

    q_lat [B, T, H, L], q_pe [B, T, H, R] (all heads, replicated), cache global
    [num_pages, page_size * c, L + R] in DCP layout sharded ``P(None,'dcp',None)``,
    block_table [B, max_pages] virtual pages, kv_lens [B, T] global keys per query row
    -> o [B, T, H, L] f32, lse [B, T, H] f32 (replicated), equal to the single-device
    attention over the plain cache with page size page_size * c.

    Rank r attends with ``local_len(kv_lens, r)`` keys, unless ``local_kv_lens`` [c, B, T]
    (host metadata, e.g. :func:`dcp_metadata`) is given: then rank r uses row r of it as is.
    ``backend`` has the signature of ``mla_paged_attention_reference``; ``combine`` names the
    collective merge of the partials (a key of ``REPLICATED_COMBINES``; see
    :func:`combine_lse_psum`).
    """
    c = dcp_size(mesh)
    combine_fn = REPLICATED_COMBINES[combine]

    def attend(q_lat, q_pe, cache_l, block_table, lens):
        o, lse = backend(q_lat, q_pe, cache_l, block_table, lens, sm_scale=sm_scale)
        return combine_fn(o.astype(jnp.float32), lse.astype(jnp.float32))

    if local_kv_lens is None:

        def body(q_lat, q_pe, cache_l, block_table, kv_lens):
            lens = local_len(kv_lens, jax.lax.axis_index(DCP_AXIS), c)
            return attend(q_lat, q_pe, cache_l, block_table, lens)

        lens_arg, lens_spec = kv_lens, P()
    else:

        def body(q_lat, q_pe, cache_l, block_table, local_lens):
            return attend(q_lat, q_pe, cache_l, block_table, local_lens[0])

        lens_arg, lens_spec = local_kv_lens, P(DCP_AXIS)

    specs = (P(), P(), CACHE_SPEC, P(), lens_spec)
    args = _place(mesh, (q_lat, q_pe, cache, block_table, lens_arg), specs)
    fn = shard_map(body, mesh, specs, (P(), P()))
    return fn(*args)
