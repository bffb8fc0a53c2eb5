"""Paged absorbed MLA decode and verify attention: a Pallas kernel for the GPU Triton backend.

Absorbed MLA is single-KV-head attention: every query row scores against the same 576-wide
latent rows (L = 512 latent + R = 64 rope) and reads back the first L columns as values. As in
FlashMLA, the T query tokens of a verify window are folded with the H heads into one row
dimension (row = t * H + h) and each row carries its own visible length, so decode (T = 1) and
verify (T = k + 1) are the same kernel.

Split-K flash decoding: the grid runs over (row blocks, splits, B); each program walks the pages
of its split (page ids read from the block table), keeps an online softmax in f32 and writes a
normalised partial (o, lse). The splits are merged by lse in plain jnp.

The reference is `kernels.mla_reference.mla_paged_attention_reference`; run with
`interpret=True` to execute on a CPU.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from kernels.mla_reference import merge_stacked_partials

# Enough programs to fill an H200 (132 SMs) about twice when the batch alone cannot.
_TARGET_PROGRAMS = 256
# A split shorter than this many tokens costs more in partial writes than it gains in parallelism.
_MIN_SPLIT_TOKENS = 256
# A 32 x 512 f32 accumulator takes 64 registers a thread at 8 warps; at 64 rows the accumulator
# alone would take 128, so Triton would likely spill (not measured).
_MAX_BLOCK_H = 32


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_dims(L: int, R: int, page_size: int, block_h: int) -> None:
    """Triton wants power-of-two tiles and dot operands of at least 16 on every side."""
    for name, n in (("L", L), ("R", R), ("page_size", page_size), ("block_h", block_h)):
        if not _is_pow2(n) or n < 16:
            raise ValueError(f"{name} = {n} must be a power of two >= 16")


def kernel_supports(L: int, R: int, page_size: int) -> bool:
    """Whether the Triton kernel takes these dims (the release's 512 / 64 with pages of 16+)."""
    return all(_is_pow2(n) and n >= 16 for n in (L, R, page_size))


def _default_block_h(rows: int) -> int:
    return min(_MAX_BLOCK_H, max(16, pl.next_power_of_2(rows)))


def _default_num_splits(programs: int, max_pages: int, page_size: int) -> int:
    """Split the sequence only as far as needed to fill the GPU, never below a useful length."""
    want = pl.cdiv(_TARGET_PROGRAMS, programs)
    most = max(1, max_pages // max(1, _MIN_SPLIT_TOKENS // page_size))
    return max(1, min(want, most))


def _dot_precision(dtype, interpret: bool):
    """f32 caches get f32-accurate dots: 3-pass TF32 on the GPU (CPU XLA lacks that preset)."""
    if dtype != jnp.float32:
        return None
    return lax.Precision.HIGHEST if interpret else lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def _split_kernel(
    lens_ref,  # [block_h] int32: keys visible to each row
    table_ref,  # [B, P_pad] int32: the whole block table
    q_lat_ref,  # [block_h, L]
    q_pe_ref,  # [block_h, R]
    cache_ref,  # [num_pages, page_size, L + R]: the whole cache
    o_ref,  # [block_h, L] f32: this split's normalised output
    lse_ref,  # [block_h] f32: this split's log-sum-exp (-inf when it saw nothing)
    *,
    sm_scale: float,
    pages_per_split: int,
    precision,
):
    """One (row block, split, sequence): online softmax over the split's pages."""
    split, b = pl.program_id(1), pl.program_id(2)
    block_h, L = q_lat_ref.shape
    R = q_pe_ref.shape[-1]
    num_pages, page_size, _ = cache_ref.shape
    dtype = q_lat_ref.dtype

    lens = lens_ref[...]
    max_len = jnp.max(lens)
    first_page = split * pages_per_split
    # Pages at or past the longest row of this block are never touched: stale or poisoned
    # block-table entries there cannot leak into the result.
    n_pages = jnp.clip(pl.cdiv(max_len, page_size) - first_page, 0, pages_per_split)
    q_lat = q_lat_ref[...]
    q_pe = q_pe_ref[...]
    dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=precision)

    def body(j, carry):
        acc, m, l = carry
        page = jnp.clip(table_ref[b, first_page + j], 0, num_pages - 1)
        pos = (first_page + j) * page_size + jnp.arange(page_size)
        # The tail of the last page is masked off at the load (zeros come back), so whatever
        # sits there, NaN included, never meets a zero probability in the value product.
        key_ok = (pos < max_len)[:, None]
        c = plgpu_triton.load(cache_ref.at[page, :, pl.ds(0, L)], mask=key_ok, other=0)
        k_pe = plgpu_triton.load(cache_ref.at[page, :, pl.ds(L, R)], mask=key_ok, other=0)
        c, k_pe = c.astype(dtype), k_pe.astype(dtype)
        s = (dot(q_lat, c.T) + dot(q_pe, k_pe.T)) * sm_scale  # [block_h, page_size]
        s = jnp.where(pos[None, :] < lens[:, None], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        # Rows that have seen no key yet keep m = -inf; shift them by 0 so exp gives 0, not NaN.
        m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m - m_shift)
        p = jnp.exp(s - m_shift[:, None])
        l = alpha * l + jnp.sum(p, axis=-1)
        acc = alpha[:, None] * acc + dot(p.astype(dtype), c)
        return acc, m_new, l

    init = (
        jnp.zeros((block_h, L), jnp.float32),
        jnp.full((block_h,), -jnp.inf, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
    )
    acc, m, l = lax.fori_loop(0, n_pages, body, init)
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    o_ref[...] = jnp.where(seen[:, None], acc / l_safe[:, None], 0.0)
    lse_ref[...] = jnp.where(seen, m + jnp.log(l_safe), -jnp.inf)


def _fold_rows(q_lat, q_pe, kv_lens, rows_pad: int, dtype):
    """[B, T, H, *] queries -> [B, rows_pad, *] with row = t * H + h; padding rows see no key."""
    B, T, H, L = q_lat.shape
    pad = ((0, 0), (0, rows_pad - T * H), (0, 0))
    q_lat = jnp.pad(q_lat.reshape(B, T * H, L).astype(dtype), pad)
    q_pe = jnp.pad(q_pe.reshape(B, T * H, -1).astype(dtype), pad)
    lens = jnp.repeat(kv_lens.astype(jnp.int32), H, axis=1)
    return q_lat, q_pe, jnp.pad(lens, ((0, 0), (0, rows_pad - T * H)))


class _Tiles(NamedTuple):
    block_h: int
    row_blocks: int
    pages_per_split: int
    num_splits: int


def _tiles(B: int, rows: int, max_pages: int, page_size: int, block_h, pages_per_split, num_splits):
    """Resolve the tile knobs; the splits cover the table, the last one possibly short."""
    if max_pages == 0:
        raise ValueError("block_table needs at least one column")
    if pages_per_split is not None and num_splits is not None:
        raise ValueError("give pages_per_split or num_splits, not both")
    block_h = block_h or _default_block_h(rows)
    row_blocks = pl.cdiv(rows, block_h)
    if pages_per_split is None:
        num_splits = num_splits or _default_num_splits(B * row_blocks, max_pages, page_size)
        pages_per_split = pl.cdiv(max_pages, min(num_splits, max_pages))
    return _Tiles(block_h, row_blocks, pages_per_split, pl.cdiv(max_pages, pages_per_split))


def _split_call(
    lens, table, q_lat, q_pe, cache, *, sm_scale, tiles, num_warps, num_stages, interpret
):
    """The pallas_call: per-split partials o [S, B, rows, L], lse [S, B, rows] (rows padded)."""
    B, rows_pad, L = q_lat.shape
    R = q_pe.shape[-1]
    block_h, S = tiles.block_h, tiles.num_splits
    kernel = functools.partial(
        _split_kernel,
        sm_scale=float(sm_scale),
        pages_per_split=tiles.pages_per_split,
        precision=_dot_precision(q_lat.dtype, interpret),
    )
    # Row blocks vary fastest in the launch order, so the programs that read the same pages run
    # side by side and the second reader finds them in L2.
    grid = (tiles.row_blocks, S, B)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None, block_h), lambda i, s, b: (b, i)),
            pl.BlockSpec(table.shape, lambda i, s, b: (0, 0)),  # whole: read by scalar
            pl.BlockSpec((None, block_h, L), lambda i, s, b: (b, i, 0)),
            pl.BlockSpec((None, block_h, R), lambda i, s, b: (b, i, 0)),
            pl.BlockSpec(cache.shape, lambda i, s, b: (0, 0, 0)),  # whole: paged by the kernel
        ],
        out_specs=[
            pl.BlockSpec((None, None, block_h, L), lambda i, s, b: (s, b, i, 0)),
            pl.BlockSpec((None, None, block_h), lambda i, s, b: (s, b, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((S, B, rows_pad, L), jnp.float32),
            jax.ShapeDtypeStruct((S, B, rows_pad), jnp.float32),
        ],
        compiler_params=plgpu_triton.CompilerParams(
            num_warps=num_warps or (4 if block_h <= 16 else 8), num_stages=num_stages
        ),
        interpret=interpret,
        name=f"mla_paged_attention_{block_h=}_pages_per_split={tiles.pages_per_split}",
    )(lens, table, q_lat, q_pe, cache)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "interpret",
        "pages_per_split",
        "num_splits",
        "block_h",
        "num_warps",
        "num_stages",
    ),
)
def mla_paged_attention(
    q_lat: jax.Array,
    q_pe: jax.Array,
    cache: jax.Array,
    block_table: jax.Array,
    kv_lens: jax.Array,
    *,
    sm_scale: float,
    interpret: bool = False,
    pages_per_split: int | None = None,
    num_splits: int | None = None,
    block_h: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> tuple[jax.Array, jax.Array]:
    """Absorbed MLA over a paged latent cache, for decode (T = 1) and verify (T = k + 1).

    q_lat [B, T, H, L] (already absorbed), q_pe [B, T, H, R], cache [num_pages, page_size, L + R],
    block_table [B, P] int32, kv_lens [B, T] int32 (keys visible to each query row)
    -> o [B, T, H, L] f32, lse [B, T, H] f32 (natural log; a row that sees nothing: 0, -inf).

    Dots run in the promoted dtype of the queries and the cache (bf16 tensor cores for a bf16
    model), accumulating in f32; probabilities are cast to that dtype for the value product.
    L, R and page_size must be powers of two >= 16 (the release L = 512, R = 64 are).

    Tuning knobs (static): `block_h` rows a program (power of two >= 16; default: the folded
    rows T * H rounded up, at most 32), `num_splits` splits of the block table (default: enough
    programs to fill the GPU, each split >= 256 tokens) or `pages_per_split` instead,
    `num_warps` (default 4 for 16 rows, else 8), `num_stages` of the page-load pipeline.
    """
    B, T, H, L = q_lat.shape
    R = q_pe.shape[-1]
    page_size, P = cache.shape[1], block_table.shape[1]
    if cache.shape[2] != L + R:
        raise ValueError(f"cache width {cache.shape[2]} != L + R = {L + R}")
    tiles = _tiles(B, T * H, P, page_size, block_h, pages_per_split, num_splits)
    _check_dims(L, R, page_size, tiles.block_h)

    dtype = jnp.promote_types(jnp.promote_types(q_lat.dtype, q_pe.dtype), cache.dtype)
    rows_pad = tiles.row_blocks * tiles.block_h
    q_lat_r, q_pe_r, lens = _fold_rows(q_lat, q_pe, kv_lens, rows_pad, dtype)
    # Entries past the real table are never read (the page loop stops at the longest row).
    table = jnp.pad(
        block_table.astype(jnp.int32), ((0, 0), (0, tiles.num_splits * tiles.pages_per_split - P))
    )
    o_s, lse_s = _split_call(
        lens,
        table,
        q_lat_r,
        q_pe_r,
        cache,
        sm_scale=sm_scale,
        tiles=tiles,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
    )
    o, lse = merge_stacked_partials(o_s[:, :, : T * H], lse_s[:, :, : T * H])
    return o.reshape(B, T, H, L), lse.reshape(B, T, H)
