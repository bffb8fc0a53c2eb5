"""DCP test harness: the host metadata of a step (global and per-rank KV lengths), the cache
layout converters, and the library's rank-local DCP pieces run on a 1-D 'dcp' mesh with every
head on every rank (`dcp_write_latents`, `dcp_attention`), to test them against the
single-device paged reference. The model never uses these: it calls the pieces inside its own
shard_map (`kimi_linear_jax/parallel/dcp.py`)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kernels.mla_reference import mla_paged_attention_reference
from kimi_linear_jax.parallel.dcp import (
    combine_all_gather,
    combine_lse_psum,
    local_len,
    write_local,
)
from kimi_linear_jax.parallel.mesh import DCP_AXIS, shard_map

CACHE_SPEC = P(None, DCP_AXIS, None)

# backend(q_lat, q_pe, cache, block_table, kv_lens, *, sm_scale) -> (o, lse), the signature of
# mla_paged_attention_reference: natural-log lse, -inf (and o = 0) for rows that see no key.
AttentionBackend = Callable[..., tuple[jax.Array, jax.Array]]


def local_len_np(n: np.ndarray, r: np.ndarray | int, c: int) -> np.ndarray:
    """Host twin of `local_len` (for metadata built in numpy)."""
    n = np.maximum(np.asarray(n), 0)
    return (n // c + (np.asarray(r) < n % c)).astype(np.int32)


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


# Combines to a replicated output (every head on every rank), for `dcp_attention`.
REPLICATED_COMBINES = {"lse_psum": combine_lse_psum, "all_gather": combine_all_gather}


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
