"""Pure-JAX MLA attention: the naive (prefill) form and the absorbed paged reference.

Both return `(o, lse)` with the natural-log log-sum-exp of the scores, so that partial
attentions (a cached prefix and a new chunk, split-K pieces, DCP ranks) merge exactly with
`merge_partials`. A row that sees no key gets `lse = -inf` and `o = 0`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _softmax_with_lse(scores: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Masked softmax over the last axis, f32; rows with no visible key give p = 0, lse = -inf."""
    scores = jnp.where(mask, scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(mask, jnp.exp(scores - m_safe), 0.0)
    s = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(s > 0, s, 1.0)
    lse = jnp.where(
        s[..., 0] > 0, m_safe[..., 0] + jnp.log(jnp.where(s > 0, s, 1.0))[..., 0], -jnp.inf
    )
    return p, lse


def mla_naive_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, sm_scale: float
) -> tuple[jax.Array, jax.Array]:
    """Multi-head attention over expanded keys.

    q [B, T, N, Dk], k [B, S, N, Dk], v [B, S, N, Dv], mask [B, T, S] (True = visible)
    -> o [B, T, N, Dv] (f32), lse [B, T, N] (f32).
    """
    acc = jnp.result_type(jnp.float32, q, k)
    scores = jnp.einsum("btnd,bsnd->bnts", q, k, preferred_element_type=acc) * sm_scale
    p, lse = _softmax_with_lse(scores, mask[:, None, :, :])
    # The reference casts the probabilities to the activation dtype before the PV product.
    o = jnp.einsum("bnts,bsnd->btnd", p.astype(v.dtype), v, preferred_element_type=acc)
    return o, jnp.transpose(lse, (0, 2, 1))


def gather_pages(cache: jax.Array, block_table: jax.Array) -> jax.Array:
    """cache [num_pages, page_size, D], block_table [B, n] -> [B, n * page_size, D]."""
    B, n = block_table.shape
    rows = cache[block_table]  # [B, n, page_size, D]
    return rows.reshape(B, n * cache.shape[1], cache.shape[2])


def mla_paged_attention_reference(
    q_lat: jax.Array,
    q_pe: jax.Array,
    cache: jax.Array,
    block_table: jax.Array,
    kv_lens: jax.Array,
    *,
    sm_scale: float,
) -> tuple[jax.Array, jax.Array]:
    """Absorbed MLA over a paged latent cache (single shared 576-wide key, 512-wide value).

    q_lat [B, T, H, L], q_pe [B, T, H, R], cache [num_pages, page_size, L + R],
    block_table [B, max_pages] int32, kv_lens [B, T] int32 (keys visible to each query row)
    -> o [B, T, H, L] f32, lse [B, T, H] f32.
    """
    L = q_lat.shape[-1]
    kv = gather_pages(cache, block_table)  # [B, S, L + R]
    c, k_pe = kv[..., :L], kv[..., L:]
    acc = jnp.result_type(jnp.float32, q_lat)
    scores = jnp.einsum("bthl,bsl->bths", q_lat, c, preferred_element_type=acc)
    scores += jnp.einsum("bthr,bsr->bths", q_pe, k_pe, preferred_element_type=acc)
    scores *= sm_scale
    S = kv.shape[1]
    mask = jnp.arange(S)[None, None, :] < kv_lens[:, :, None]  # [B, T, S]
    p, lse = _softmax_with_lse(scores, mask[:, :, None, :])
    o = jnp.einsum("bths,bsl->bthl", p, c.astype(acc))
    return o, lse


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


def merge_stacked_partials(o: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Merge partials over disjoint key sets stacked on axis 0: o [c, ..., L], lse [c, ...].

    M = max lse (0 where all are -inf); lse = M + log(sum exp(lse_r - M));
    o = sum exp(lse_r - lse) o_r; rows empty on every rank give lse = -inf, o = 0.
    """
    # Unrolled over the (static, small) partial count: XLA:CPU reduces a stacked [c, B, 1, H, L]
    # over axis 0 up to 10x slower than this sum of c fused terms (benchmarks/dcp_combine.py).
    # Split-K pieces of the kernel and DCP ranks both merge here.
    c = o.shape[0]
    m = jnp.max(lse, axis=0)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = [jnp.exp(lse[r] - m) for r in range(c)]  # exp(-inf) = 0: empty slices drop out
    total = functools.reduce(jnp.add, w)
    safe = jnp.where(total > 0, total, 1.0)
    lse_out = jnp.where(total > 0, m + jnp.log(safe), -jnp.inf)
    terms = [
        jnp.where((w[r] > 0)[..., None], (w[r] / safe)[..., None] * o[r], 0.0) for r in range(c)
    ]
    o_out = functools.reduce(jnp.add, terms)
    return o_out, lse_out


def write_latents(
    cache: jax.Array,
    rows: jax.Array,
    block_table: jax.Array,
    start: jax.Array,
    lengths: jax.Array,
) -> jax.Array:
    """Scatter rows [B, T, L + R] to positions start[b] + t of each sequence, t < lengths[b].

    Rows past a sequence's length are dropped (pointed out of bounds), so padding never
    touches a page.
    """
    num_pages, page_size, _ = cache.shape
    B, T, _ = rows.shape
    pos = start[:, None] + jnp.arange(T)[None, :]  # [B, T]
    page_idx = jnp.clip(pos // page_size, 0, block_table.shape[1] - 1)
    page = jnp.take_along_axis(block_table, page_idx, axis=1)
    valid = jnp.arange(T)[None, :] < lengths[:, None]
    page = jnp.where(valid, page, num_pages)
    return cache.at[page, pos % page_size].set(rows.astype(cache.dtype), mode="drop")
