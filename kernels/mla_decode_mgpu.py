"""Paged absorbed MLA decode and verify attention on Pallas' Mosaic GPU backend (Hopper).

The same contract as `kernels.mla_decode.mla_paged_attention` (the Triton kernel, which jax
0.11+ deprecates): the T query tokens fold with the H heads into rows (row = t * H + h), each
row with its own visible length; split-K partials (o, lse) merge by lse in jnp.

What Mosaic GPU gives that Triton does not: each page is one TMA copy (the block table picks
the page, the copy engine moves its `page_size x 576` rows into swizzled shared memory) and
both products are Hopper `wgmma` on 64-row tiles. A program is one warpgroup: 64 rows, one
split of the block table, `block_l` latent output columns (a 64 x 512 f32 accumulator would
need 256 registers a thread, so the latent is split over programs; each recomputes the
scores, whose key reads hit L2 after the first).

Needs jax >= 0.12 (the `plgpu.kernel` API and its interpret mode). bf16 only: wgmma takes f32
only as tf32, which the Triton kernel's 3-pass dots cover. Keys past a row's length, and page
rows past the block's longest row, are masked before either product, so garbage or non-finite
values in unused page slots never reach an output. Tested against
`kernels.mla_reference.mla_paged_attention_reference` in interpret mode (on a CPU); not yet
timed on a GPU. Single-buffered: the next page's copy waits for this page's products
(double-buffering is the first tuning step once a GPU measures it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels.mla_decode import _check_dims, _default_num_splits, _fold_rows
from kernels.mla_reference import merge_stacked_partials

ROWS = 64  # a warpgroup's wgmma M
KEYS = 64  # keys a step: one 64-key page, or 2 or 4 smaller ones
PAGE_SIZES = (16, 32, 64)
SWIZZLE = 128  # bytes: 64 bf16 columns a swizzle row


def available() -> bool:
    """Whether this jax has the Mosaic GPU API the kernel is written for (jax >= 0.12)."""
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except ImportError:
        return False
    return hasattr(plgpu, "InterpretGPUParams") and hasattr(plgpu, "kernel")


def _plgpu():
    if not available():
        raise NotImplementedError(
            f"the Mosaic GPU MLA kernel needs jax >= 0.12 (this is jax {jax.__version__}); "
            "use kernels.mla_decode.mla_paged_attention"
        )
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu


def _smem(plgpu, shape):
    """A bf16 shared-memory tile in the layout TMA writes and wgmma reads."""
    transforms = (plgpu.TilingTransform((8, SWIZZLE // 2)), plgpu.SwizzleTransform(SWIZZLE))
    return plgpu.SMEM(shape, jnp.bfloat16, transforms=transforms)


def _program(refs, *, plgpu, sm_scale, page_size, steps_per_split, block_l, num_pages):
    """One (split, row block, latent tile, sequence): walks the split KEYS keys a step."""
    lens_ref, table_ref, q_ref, cache_ref, o_ref, lse_ref = refs[:6]
    q_smem, k_smem, v_smem, p_smem, o_smem, lse_smem, q_barrier, kv_barriers = refs[6:]
    t, i, s, b = (lax.axis_index(n) for n in ("l", "r", "s", "b"))
    rows = pl.ds(i * ROWS, ROWS)
    wgmma = plgpu.Layout.WGMMA
    row_layout = wgmma.reduce(1)
    pages_a_step = KEYS // page_size

    plgpu.copy_gmem_to_smem(q_ref.at[b, rows], q_smem, q_barrier)
    plgpu.barrier_wait(q_barrier)
    lens = plgpu.load(lens_ref.at[b, rows], layout=row_layout, optimized=False)
    longest = jnp.max(lens)
    first = s * steps_per_split
    # Steps of this split that hold a key some row sees; later table entries are never read.
    last = jnp.minimum(first + steps_per_split, lax.div(longest + KEYS - 1, KEYS))

    def step(j, carry):
        acc, m, l = carry
        for n in range(pages_a_step):  # one TMA per page, into its rows of the step's tile
            # Clamped: a table entry past the sequence may hold anything; its keys are masked.
            page = jnp.clip(table_ref[b, j * pages_a_step + n], 0, num_pages - 1)
            keys = pl.ds(n * page_size, page_size)
            plgpu.copy_gmem_to_smem(cache_ref.at[page], k_smem.at[keys], kv_barriers.at[0])
            v_src = cache_ref.at[page, :, pl.ds(t * block_l, block_l)]
            plgpu.copy_gmem_to_smem(v_src, v_smem.at[keys], kv_barriers.at[1])
        plgpu.barrier_wait(kv_barriers.at[0])
        plgpu.barrier_wait(kv_barriers.at[1])

        def scores(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.transpose((1, 0)))
            return acc_ref[...]

        z = pl.run_scoped(scores, plgpu.ACC((ROWS, KEYS), jnp.float32)) * sm_scale
        key = j * KEYS + plgpu.broadcasted_iota(jnp.int32, z.shape, 1, layout=wgmma)
        seen = key < lax.broadcast_in_dim(lens, z.shape, [0])
        z = jnp.where(seen, z, -jnp.inf)
        m_new = jnp.maximum(m, z.max(axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that has seen nothing yet
        alpha = jnp.exp(m - m_safe)
        w = jnp.where(seen, jnp.exp(z - lax.broadcast_in_dim(m_safe, z.shape, [0])), 0.0)
        l = l * alpha + w.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        _zero_unseen_rows(v_smem, j * KEYS, longest, plgpu)
        p_smem[...] = w.astype(jnp.bfloat16)
        plgpu.commit_smem()

        def values(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_smem)
            return acc_ref[...]

        # A fresh accumulator added, not `run_state` into the running one: the interpreter
        # runs only scoped accumulators.
        acc = acc + pl.run_scoped(values, plgpu.ACC((ROWS, block_l), jnp.float32))
        return acc, m_new, l

    acc = plgpu.layout_cast(jnp.zeros((ROWS, block_l), jnp.float32), wgmma)
    m = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), row_layout)
    l = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), row_layout)
    acc, m, l = lax.fori_loop(first, jnp.maximum(first, last), step, (acc, m, l))

    seen_any = l > 0
    inv = jnp.where(seen_any, 1.0 / jnp.where(seen_any, l, 1.0), 0.0)
    o_smem[...] = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
    lse_smem[...] = jnp.where(seen_any, m + jnp.log(jnp.where(seen_any, l, 1.0)), -jnp.inf)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[s, b, rows, pl.ds(t * block_l, block_l)])

    @pl.when(t == 0)  # every latent tile computed the same lse
    def _():
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[s, b, rows])

    plgpu.wait_smem_to_gmem(0)


def _zero_unseen_rows(v_smem, start, longest, plgpu):
    """Key rows no query of the block sees become 0 (0 x NaN is NaN in the value product)."""

    @pl.when(start + KEYS > longest)
    def _():
        v = v_smem[...]
        rows = start + lax.broadcasted_iota(jnp.int32, v.shape, 0)
        v_smem[...] = jnp.where(rows < longest, v, jnp.zeros_like(v))
        plgpu.commit_smem()


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "interpret", "num_splits", "block_l", "detect_races")
)
def mla_paged_attention_mgpu(
    q_lat: jax.Array,
    q_pe: jax.Array,
    cache: jax.Array,
    block_table: jax.Array,
    kv_lens: jax.Array,
    *,
    sm_scale: float,
    interpret: bool = False,
    num_splits: int | None = None,
    block_l: int | None = None,
    detect_races: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """`kernels.mla_decode.mla_paged_attention` on Mosaic GPU: o [B, T, H, L] f32, lse [B, T, H].

    bf16 queries and cache. `block_l`: latent output columns a program (a power of two, 64 to
    L; default 128: a 64 x 128 f32 accumulator is 64 registers a thread). `num_splits`:
    splits of the block table (default: as the Triton kernel picks). `interpret=True` runs
    Mosaic GPU's interpreter (a CPU; `detect_races` checks the barriers).
    """
    plgpu = _plgpu()
    B, T, H, L = q_lat.shape
    R = q_pe.shape[-1]
    page_size, P = cache.shape[1], block_table.shape[1]
    if cache.shape[2] != L + R:
        raise ValueError(f"cache width {cache.shape[2]} != L + R = {L + R}")
    if {q_lat.dtype, q_pe.dtype, cache.dtype} != {jnp.dtype(jnp.bfloat16)}:
        raise ValueError(
            "the Mosaic GPU kernel takes bfloat16 queries and cache, got "
            f"{q_lat.dtype}, {q_pe.dtype}, {cache.dtype}"
        )
    _check_dims(L, R, page_size, ROWS)
    if page_size not in PAGE_SIZES or (L + R) % 64 or L % 64:
        raise ValueError(
            f"the Mosaic GPU kernel takes page sizes {PAGE_SIZES} and L, L + R multiples of 64, "
            f"got page_size {page_size}, L {L}, R {R}"
        )
    block_l = block_l or min(128, L)
    if not (64 <= block_l <= L and block_l & (block_l - 1) == 0):
        raise ValueError(f"block_l must be a power of two in [64, {L}], got {block_l}")
    pages_a_step = KEYS // page_size
    steps = pl.cdiv(P, pages_a_step)
    row_blocks = pl.cdiv(T * H, ROWS)
    S = num_splits or _default_num_splits(row_blocks * B * (L // block_l), steps, KEYS)
    if not 1 <= S <= steps:
        raise ValueError(f"num_splits must be in [1, {steps}] ({KEYS}-key steps), got {S}")
    steps_per_split = pl.cdiv(steps, S)
    # Whole steps: the table's tail is padded (with page 0; masked, never a key anyone sees).
    table = jnp.pad(block_table.astype(jnp.int32), ((0, 0), (0, steps * pages_a_step - P)))

    rows_pad = row_blocks * ROWS
    q_lat_r, q_pe_r, lens = _fold_rows(q_lat, q_pe, kv_lens, rows_pad, jnp.bfloat16)
    q = jnp.concatenate([q_lat_r, q_pe_r], axis=-1)  # one K = 576 product against a key row
    program = functools.partial(
        _program,
        plgpu=plgpu,
        sm_scale=float(sm_scale),
        page_size=page_size,
        steps_per_split=steps_per_split,
        block_l=block_l,
        num_pages=cache.shape[0],
    )
    call = plgpu.kernel(
        lambda *refs: program(refs),
        out_type=(
            jax.ShapeDtypeStruct((S, B, rows_pad, L), jnp.float32),
            jax.ShapeDtypeStruct((S, B, rows_pad), jnp.float32),
        ),
        scratch_types=[
            _smem(plgpu, (ROWS, L + R)),
            _smem(plgpu, (KEYS, L + R)),
            _smem(plgpu, (KEYS, block_l)),
            _smem(plgpu, (ROWS, KEYS)),  # the probabilities, bf16, for the value product
            plgpu.SMEM((ROWS, block_l), jnp.float32),
            plgpu.SMEM((ROWS,), jnp.float32),
            plgpu.Barrier(),  # the queries
            plgpu.Barrier(num_arrivals=pages_a_step, num_barriers=2),  # keys, values
        ],
        grid=(L // block_l, row_blocks, S, B),
        grid_names=("l", "r", "s", "b"),
        interpret=plgpu.InterpretGPUParams(detect_races=detect_races) if interpret else None,
    )
    o_s, lse_s = call(lens, table, q, cache)
    o, lse = merge_stacked_partials(o_s[:, :, : T * H], lse_s[:, :, : T * H])
    return o.reshape(B, T, H, L), lse.reshape(B, T, H)
