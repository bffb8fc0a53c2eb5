"""Paged absorbed MLA decode and verify attention: a Pallas kernel for the GPU Triton backend.

Absorbed MLA is single-KV-head attention: every query row scores against the same 576-wide
latent rows (L = 512 latent + R = 64 rope) and reads back the first L columns as values. As in
FlashMLA, the T query tokens of a verify window are folded with the H heads into one row
dimension (row = t * H + h) and each row carries its own visible length, so decode (T = 1) and
verify (T = k + 1) are the same kernel.

Split-K flash decoding: the grid runs over (latent tiles, row blocks, splits, B); each program
walks the pages of its split (page ids read from the block table) a key tile at a time, keeps an
online softmax in f32 and writes a normalised partial (o, lse) of its latent columns. The splits
are merged by lse in plain jnp. bf16 runs one latent tile (the whole 512); f32 cuts the latent
so that its tiles fit an H200's registers and shared memory.

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
# Tile choices below were read off deviceless H200 compiles (`make gpu-compile`, the registers,
# spills and shared memory in benchmarks/RESULTS.md): every default compiles with no spill.


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


def _default_block_h(rows: int, dtype) -> int:
    """32 rows at most, except bf16 with 64 or more rows: Hopper's wgmma wants 64-row tiles,
    and 64 rows read each page once for twice the rows (a 64 x 512 f32 accumulator still fits
    beside half-page key tiles; see `_default_key_tiles`)."""
    if jnp.dtype(dtype).itemsize == 2 and rows >= 64:
        return 64
    return min(32, max(16, pl.next_power_of_2(rows)))


def _default_num_splits(programs: int, max_pages: int, page_size: int) -> int:
    """Split the sequence only as far as needed to fill the GPU, never below a useful length."""
    want = pl.cdiv(_TARGET_PROGRAMS, programs)
    most = max(1, max_pages // max(1, _MIN_SPLIT_TOKENS // page_size))
    return max(1, min(want, most))


def _default_key_tiles(
    dtype, cache_dtype, L: int, page_size: int, block_h: int
) -> tuple[int, int, int]:
    """(block_n, block_l, block_k). bf16 keeps the whole latent in one program, so one load of
    a key tile serves scores and values: a whole page at up to 32 rows (H200, page 64: 178
    registers, 112 KiB), 32 keys at 64 rows (255 registers, 144 KiB; a whole page spills).
    f32 operands take twice the registers and shared memory, and the 3-pass TF32 products
    more again: 16 keys, 64 latent columns an output tile and a score chunk (176 registers,
    188 KiB; 128-wide tiles spill, a whole 64-key page asks more than the 227 KiB there are).
    f32 queries over a bf16 cache (the bf16 model: its absorbed queries are f32) convert each
    loaded tile in registers: 32-wide output tiles (180 registers; 64-wide spill at 32 rows)."""
    if jnp.dtype(dtype).itemsize >= 4:
        block_l = 64 if jnp.dtype(cache_dtype).itemsize >= 4 else 32
        return min(page_size, 16), min(L, block_l), min(L, 64)
    if block_h >= 64:
        return min(page_size, 32), L, L
    return page_size, L, L


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
    o_ref,  # [block_h, block_l] f32: this split's normalised output, latent columns of this tile
    lse_ref,  # [block_h] f32: this split's log-sum-exp (-inf when it saw nothing)
    *,
    sm_scale: float,
    pages_per_split: int,
    block_n: int,
    block_k: int,
    precision,
):
    """One (latent tile, row block, split, sequence): online softmax over the split's pages.

    The scores need all L + R columns of a key, the output only this program's `block_l`: the
    scores are summed over `block_k`-wide column chunks (each chunk of the queries and the page
    loaded as it is used, so neither lives whole in registers), and the value product reads the
    program's own columns. With one tile and one chunk the page is loaded once for both.
    """
    lt, split, b = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    block_h, block_l = o_ref.shape
    L = q_lat_ref.shape[-1]
    R = q_pe_ref.shape[-1]
    num_pages, page_size, _ = cache_ref.shape
    dtype = q_lat_ref.dtype
    whole = block_l == L and block_k == L

    lens = lens_ref[...]
    max_len = jnp.max(lens)
    first_page = split * pages_per_split
    # Pages at or past the longest row of this block are never touched: stale or poisoned
    # block-table entries there cannot leak into the result.
    n_pages = jnp.clip(pl.cdiv(max_len, page_size) - first_page, 0, pages_per_split)
    per_page = page_size // block_n  # key tiles a page
    dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=precision)

    def body(j, carry):
        acc, m, l = carry
        # lax's div and rem: j >= 0, and jnp's sign fix-up does not lower to Triton.
        page = jnp.clip(table_ref[b, first_page + lax.div(j, per_page)], 0, num_pages - 1)
        row = lax.rem(j, per_page) * block_n
        pos = first_page * page_size + j * block_n + jnp.arange(block_n)
        # The tail of the last page is masked off at the load (zeros come back), so whatever
        # sits there, NaN included, never meets a zero probability in the value product.
        key_ok = (pos < max_len)[:, None]

        def load(col, width):
            rows = cache_ref.at[page, pl.ds(row, block_n), pl.ds(col, width)]
            return plgpu_triton.load(rows, mask=key_ok, other=0).astype(dtype)

        k_pe = load(L, R)
        s = dot(q_pe_ref[...], k_pe.T)
        for col in range(0, L, block_k):
            c = load(col, block_k)
            s += dot(q_lat_ref[:, pl.ds(col, block_k)], c.T)
        s = jnp.where(pos[None, :] < lens[:, None], s * sm_scale, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        # Rows that have seen no key yet keep m = -inf; shift them by 0 so exp gives 0, not NaN.
        m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m - m_shift)
        p = jnp.exp(s - m_shift[:, None])
        l = alpha * l + jnp.sum(p, axis=-1)
        v = c if whole else load(lt * block_l, block_l)
        acc = alpha[:, None] * acc + dot(p.astype(dtype), v)
        return acc, m_new, l

    init = (
        jnp.zeros((block_h, block_l), jnp.float32),
        jnp.full((block_h,), -jnp.inf, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
    )
    acc, m, l = lax.fori_loop(0, n_pages * per_page, body, init)
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    o_ref[...] = jnp.where(seen[:, None], acc / l_safe[:, None], 0.0)
    # Every latent tile computes the same lse; the first one's is kept.
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
    block_n: int  # keys a step of the page loop (a page or a part of one)
    block_l: int  # latent output columns a program
    block_k: int  # latent columns a score chunk


def _tiles(
    B: int, rows: int, max_pages: int, page_size: int, L: int, dtype, cache_dtype, knobs
) -> _Tiles:
    """Resolve the tile knobs; the splits cover the table, the last one possibly short."""
    if max_pages == 0:
        raise ValueError("block_table needs at least one column")
    pages_per_split, num_splits = knobs["pages_per_split"], knobs["num_splits"]
    if pages_per_split is not None and num_splits is not None:
        raise ValueError("give pages_per_split or num_splits, not both")
    block_h = knobs["block_h"] or _default_block_h(rows, dtype)
    block_n, block_l, block_k = _default_key_tiles(dtype, cache_dtype, L, page_size, block_h)
    block_n = knobs["block_n"] or block_n
    block_l, block_k = knobs["block_l"] or block_l, knobs["block_k"] or block_k
    for name, n, most in (
        ("block_n", block_n, page_size),
        ("block_l", block_l, L),
        ("block_k", block_k, L),
    ):
        if not _is_pow2(n) or not 16 <= n <= most:
            raise ValueError(f"{name} = {n} must be a power of two in [16, {most}]")
    row_blocks = pl.cdiv(rows, block_h)
    if pages_per_split is None:
        programs = B * row_blocks * (L // block_l)
        num_splits = num_splits or _default_num_splits(programs, max_pages, page_size)
        pages_per_split = pl.cdiv(max_pages, min(num_splits, max_pages))
    num_splits = pl.cdiv(max_pages, pages_per_split)
    return _Tiles(block_h, row_blocks, pages_per_split, num_splits, block_n, block_l, block_k)


def launch_tiles(
    B: int, T: int, H: int, L: int, page_size: int, P: int, dtype, cache_dtype, **knobs
) -> tuple[_Tiles, int]:
    """(tiles, num_warps) the kernel launches with for these shapes and knobs (the
    deviceless compile check enumerates the engine's launches by these)."""
    names = ("pages_per_split", "num_splits", "block_h", "block_n", "block_l", "block_k")
    picked = {n: knobs.get(n) for n in names}
    tiles = _tiles(B, T * H, P, page_size, L, dtype, cache_dtype, picked)
    return tiles, knobs.get("num_warps") or _default_num_warps(tiles.block_h)


def _default_num_warps(block_h: int) -> int:
    return 4 if block_h <= 16 else 8


def _split_call(
    lens, table, q_lat, q_pe, cache, *, sm_scale, tiles, num_warps, num_stages, interpret
):
    """The pallas_call: per-split partials o [S, B, rows, L], lse [S, B, rows] (rows padded)."""
    B, rows_pad, L = q_lat.shape
    R = q_pe.shape[-1]
    block_h, block_l, S = tiles.block_h, tiles.block_l, tiles.num_splits
    LT = L // block_l
    kernel = functools.partial(
        _split_kernel,
        sm_scale=float(sm_scale),
        pages_per_split=tiles.pages_per_split,
        block_n=tiles.block_n,
        block_k=tiles.block_k,
        precision=_dot_precision(q_lat.dtype, interpret),
    )
    # Latent tiles, then row blocks, vary fastest in the launch order, so the programs that read
    # the same pages run side by side and the later readers find them in L2.
    grid = (LT, tiles.row_blocks, S, B)
    o_s, lse_s = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None, block_h), lambda t, i, s, b: (b, i)),
            pl.BlockSpec(table.shape, lambda t, i, s, b: (0, 0)),  # whole: read by scalar
            pl.BlockSpec((None, block_h, L), lambda t, i, s, b: (b, i, 0)),
            pl.BlockSpec((None, block_h, R), lambda t, i, s, b: (b, i, 0)),
            pl.BlockSpec(cache.shape, lambda t, i, s, b: (0, 0, 0)),  # whole: paged by the kernel
        ],
        out_specs=[
            pl.BlockSpec((None, None, block_h, block_l), lambda t, i, s, b: (s, b, i, t)),
            pl.BlockSpec((None, None, None, block_h), lambda t, i, s, b: (t, s, b, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((S, B, rows_pad, L), jnp.float32),
            jax.ShapeDtypeStruct((LT, S, B, rows_pad), jnp.float32),
        ],
        compiler_params=plgpu_triton.CompilerParams(
            num_warps=num_warps or _default_num_warps(block_h), num_stages=num_stages
        ),
        interpret=interpret,
        name=f"mla_paged_attention_{tiles.block_h}_{tiles.block_n}_{block_l}_{tiles.block_k}",
    )(lens, table, q_lat, q_pe, cache)
    return o_s, lse_s[0]  # every latent tile computed the same lse


_KNOBS = (
    "pages_per_split",
    "num_splits",
    "block_h",
    "block_n",
    "block_l",
    "block_k",
    "num_warps",
    "num_stages",
)


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret", *_KNOBS))
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
    block_n: int | None = None,
    block_l: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> tuple[jax.Array, jax.Array]:
    """Absorbed MLA over a paged latent cache, for decode (T = 1) and verify (T = k + 1).

    q_lat [B, T, H, L] (already absorbed), q_pe [B, T, H, R], cache [num_pages, page_size, L + R],
    block_table [B, P] int32, kv_lens [B, T] int32 (keys visible to each query row)
    -> o [B, T, H, L] f32, lse [B, T, H] f32 (natural log; a row that sees nothing: 0, -inf).

    Dots run in the promoted dtype of the queries and the cache, accumulating in f32;
    probabilities are cast to that dtype for the value product. bf16 queries over a bf16 cache
    get bf16 tensor cores; the bf16 engine today passes f32 absorbed queries (the absorption
    accumulates in f32), so its dots promote to f32 over the bf16 cache (3-pass tf32 on a
    GPU). Casting the absorbed queries to bf16 would take the faster path: a numerics choice,
    left to measure against the reference first.
    L, R and page_size must be powers of two >= 16 (the release L = 512, R = 64 are).

    Tuning knobs (static): `block_h` rows a program (power of two >= 16; default: the folded
    rows T * H rounded up, at most 32; 64 for bf16 with 64+ rows), `block_n` keys a step of the
    page loop (a power of two <= page_size), `block_l` latent output columns a program and
    `block_k` latent columns a score chunk (powers of two <= L; defaults by dtype and rows,
    see `_default_key_tiles`), `num_splits` splits of the block table (default: enough programs
    to fill the GPU, each split >= 256 tokens) or `pages_per_split` instead, `num_warps`
    (default 4 for 16 rows, else 8), `num_stages` of the page-load pipeline.
    """
    B, T, H, L = q_lat.shape
    R = q_pe.shape[-1]
    page_size, P = cache.shape[1], block_table.shape[1]
    if cache.shape[2] != L + R:
        raise ValueError(f"cache width {cache.shape[2]} != L + R = {L + R}")
    dtype = jnp.promote_types(jnp.promote_types(q_lat.dtype, q_pe.dtype), cache.dtype)
    knobs = dict(
        pages_per_split=pages_per_split,
        num_splits=num_splits,
        block_h=block_h,
        block_n=block_n,
        block_l=block_l,
        block_k=block_k,
    )
    tiles = _tiles(B, T * H, P, page_size, L, dtype, cache.dtype, knobs)
    _check_dims(L, R, page_size, tiles.block_h)

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
