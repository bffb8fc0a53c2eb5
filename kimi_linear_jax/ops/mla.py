"""Pure-JAX MLA attention: the naive (prefill) form and the absorbed paged reference.

Both return `(o, lse)` with the natural-log log-sum-exp of the scores, so that partial
attentions (a cached prefix and a new chunk, split-K pieces, DCP ranks) merge exactly with
`merge_partials`. A row that sees no key gets `lse = -inf` and `o = 0`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.mla_decode import kernel_supports, mla_paged_attention
from kernels.mla_reference import (  # noqa: F401  (re-exported: the model's MLA math in one place)
    _softmax_with_lse,
    gather_pages,
    merge_stacked_partials,
    mla_latent_attention_reference,
    mla_paged_attention_reference,
)
from kimi_linear_jax.ops import order


def mla_naive_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, sm_scale: float
) -> tuple[jax.Array, jax.Array]:
    """Multi-head attention over expanded keys.

    q [B, T, N, Dk], k [B, S, N, Dk], v [B, S, N, Dv], mask [B, T, S] (True = visible)
    -> o [B, T, N, Dv] (f32), lse [B, T, N] (f32).
    """
    acc = jnp.result_type(jnp.float32, q, k)
    # Values no query sees (cache slots past every row's reach) may hold anything: 0 x NaN.
    seen = jnp.any(mask, axis=1)[:, :, None, None]  # [B, S, 1, 1]
    v = jnp.where(seen, v, jnp.zeros((), v.dtype))
    scores = jnp.einsum("btnd,bsnd->bnts", q, k, preferred_element_type=acc) * sm_scale
    p, lse = _softmax_with_lse(scores, mask[:, None, :, :])
    # The reference casts the probabilities to the activation dtype before the PV product.
    o = jnp.einsum("bnts,bsnd->btnd", p.astype(v.dtype), v, preferred_element_type=acc)
    return o, jnp.transpose(lse, (0, 2, 1))


def _resolve(impl: str, q_lat, q_pe, cache) -> str:
    """The implementation that runs: "kernel", "interpret" or "reference" (static: at trace)."""
    if impl == "auto":
        impl = "kernel" if jax.default_backend() == "gpu" else "reference"
    if impl != "reference" and not kernel_supports(q_lat.shape[-1], q_pe.shape[-1], cache.shape[1]):
        return "reference"
    return impl


def paged_attention(
    impl: str, q_lat, q_pe, cache, block_table, kv_lens, *, sm_scale: float
) -> tuple[jax.Array, jax.Array]:
    """Absorbed paged MLA by the implementation the model was built with: "kernel" (Pallas, a
    GPU), "interpret" (the same kernel on a CPU, for tests), "reference" (XLA) or "auto" (the
    kernel on a GPU). The kernel falls back to the reference for dims it does not take
    (static shapes: decided at trace)."""
    impl = _resolve(impl, q_lat, q_pe, cache)
    if impl == "reference":
        return mla_paged_attention_reference(
            q_lat, q_pe, cache, block_table, kv_lens, sm_scale=sm_scale
        )
    return mla_paged_attention(
        q_lat, q_pe, cache, block_table, kv_lens, sm_scale=sm_scale, interpret=impl == "interpret"
    )


def paged_attention_write(
    impl: str, q_lat, q_pe, cache, block_table, kv_lens, rows, col, slot, *, sm_scale: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`paged_attention` over the pool with the step's new latent rows [B, T, L + R] in it,
    and the pool with them written: (o, lse, cache). Row t of sequence b goes to column
    col[b, t] of its block table (past the table: dropped), slot slot[b, t] (`targets`).

    The pool is written in place only if XLA can order the write after every read of it. The
    kernel (a custom call) reads the pool once written. The XLA reference reads it before: it
    gathers the sequence's pages, puts the new rows into that gathered copy, attends, and
    writes the pool after the attention (a data dependence). Written first, the write can be
    folded into the page gather (XLA did, for the last MLA layer at B = 1), which then reads
    the old pool while the write updates it, and XLA copies the whole pool twice a step to
    keep both (issue 13). A sequence sees only its own new rows here, as pages written in a
    step belong to the sequence writing them (shared prefix pages are full)."""
    impl = _resolve(impl, q_lat, q_pe, cache)
    if impl != "reference":
        cache = write_rows(cache, rows, block_table, col, slot)
        o, lse = paged_attention(impl, q_lat, q_pe, cache, block_table, kv_lens, sm_scale=sm_scale)
        return o, lse, cache
    kv = gather_pages(cache, block_table)  # [B, S, L + R]
    b = jnp.broadcast_to(jnp.arange(kv.shape[0])[:, None], col.shape)
    kv = kv.at[b, col * cache.shape[1] + slot].set(rows.astype(kv.dtype), mode="drop")
    o, lse = mla_latent_attention_reference(q_lat, q_pe, kv, kv_lens, sm_scale=sm_scale)
    return o, lse, write_rows(cache, order.after(rows, o), block_table, col, slot)


def latent_attention_masked(
    q_lat: jax.Array, q_pe: jax.Array, kv: jax.Array, mask: jax.Array, *, sm_scale: float
) -> tuple[jax.Array, jax.Array]:
    """`mla_latent_attention_reference` with any mask instead of lengths: q_lat [B, T, H, L],
    q_pe [B, T, H, R], kv [B, S, L + R], mask [B, T, S] (True = visible) -> o [B, T, H, L]
    f32, lse [B, T, H] (a draft tree's window over its own rows)."""
    L = q_lat.shape[-1]
    c, k_pe = kv[..., :L], kv[..., L:]
    acc = jnp.result_type(jnp.float32, q_lat)
    scores = jnp.einsum("bthl,bsl->bths", q_lat, c, preferred_element_type=acc)
    scores += jnp.einsum("bthr,bsr->bths", q_pe, k_pe, preferred_element_type=acc)
    p, lse = _softmax_with_lse(scores * sm_scale, mask[:, :, None, :])
    return jnp.einsum("bths,bsl->bthl", p, c.astype(acc)), lse


def merge_partials(
    o_a: jax.Array, lse_a: jax.Array, o_b: jax.Array, lse_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Combine two partial attentions over disjoint key sets by their lse ([..., D] and [...])."""
    m = jnp.maximum(lse_a, lse_b)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    wa, wb = jnp.exp(lse_a - m), jnp.exp(lse_b - m)
    total = wa + wb
    lse = jnp.where(total > 0, m + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    denom = jnp.where(total > 0, total, 1.0)
    o = (wa / denom)[..., None] * o_a + (wb / denom)[..., None] * o_b
    return o, lse


def targets(
    block_table: jax.Array, start: jax.Array, lengths: jax.Array, T: int, page_size: int
) -> tuple[jax.Array, jax.Array]:
    """Where the rows of positions start[b] + t go, t < lengths[b]: (column of the sequence's
    block table, slot in that page), [B, T] each. Rows past a sequence's length get the
    column past the table, so that padding never touches a page."""
    pos = start[:, None] + jnp.arange(T)[None, :]  # [B, T]
    n = block_table.shape[1]
    col = jnp.clip(pos // page_size, 0, n - 1)
    valid = jnp.arange(T)[None, :] < lengths[:, None]
    return jnp.where(valid, col, n), pos % page_size


def write_rows(
    cache: jax.Array, rows: jax.Array, block_table: jax.Array, col: jax.Array, slot: jax.Array
) -> jax.Array:
    """Scatter rows [B, T, L + R] to page block_table[b, col[b, t]], slot slot[b, t]; a column
    past the table drops the row."""
    n = block_table.shape[1]
    page = jnp.take_along_axis(block_table, jnp.minimum(col, n - 1), axis=1)
    page = jnp.where(col < n, page, cache.shape[0])  # out of bounds: dropped
    return cache.at[page, slot].set(rows.astype(cache.dtype), mode="drop")


def write_latents(
    cache: jax.Array,
    rows: jax.Array,
    block_table: jax.Array,
    start: jax.Array,
    lengths: jax.Array,
) -> jax.Array:
    """Scatter rows [B, T, L + R] to positions start[b] + t of each sequence, t < lengths[b]."""
    where = targets(block_table, start, lengths, rows.shape[1], cache.shape[1])
    return write_rows(cache, rows, block_table, *where)
