"""Pure-JAX references of the paged MLA kernel: the absorbed attention over a paged latent cache
and the log-sum-exp merge of partials (split-K pieces, DCP ranks). Imports nothing but jax.

Both return / take `(o, lse)` with the natural-log log-sum-exp of the scores; a row that sees
no key gets `lse = -inf` and `o = 0`.
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
    kv = gather_pages(cache, block_table)
    return mla_latent_attention_reference(q_lat, q_pe, kv, kv_lens, sm_scale=sm_scale)


def mla_latent_attention_reference(
    q_lat: jax.Array, q_pe: jax.Array, kv: jax.Array, kv_lens: jax.Array, *, sm_scale: float
) -> tuple[jax.Array, jax.Array]:
    """The same over each row's gathered latent rows kv [B, S, L + R] (`gather_pages`)."""
    L = q_lat.shape[-1]
    S = kv.shape[1]
    # Rows no query of the sequence sees (a last page's tail, free pages in the table) may
    # hold anything: zeroed, as the kernel never loads them, since 0 x NaN in the value
    # product would be NaN.
    seen = jnp.arange(S)[None, :, None] < jnp.max(kv_lens, axis=1)[:, None, None]
    kv = jnp.where(seen, kv, jnp.zeros((), kv.dtype))
    c, k_pe = kv[..., :L], kv[..., L:]
    acc = jnp.result_type(jnp.float32, q_lat)
    scores = jnp.einsum("bthl,bsl->bths", q_lat, c, preferred_element_type=acc)
    scores += jnp.einsum("bthr,bsr->bths", q_pe, k_pe, preferred_element_type=acc)
    scores *= sm_scale
    mask = jnp.arange(S)[None, None, :] < kv_lens[:, :, None]  # [B, T, S]
    p, lse = _softmax_with_lse(scores, mask[:, :, None, :])
    o = jnp.einsum("bths,bsl->bthl", p, c.astype(acc))
    return o, lse


def merge_stacked_partials(o: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Merge partials over disjoint key sets stacked on axis 0: o [c, ..., L], lse [c, ...].

    M = max lse (0 where all are -inf); lse = M + log(sum exp(lse_r - M));
    o = sum exp(lse_r - lse) o_r; rows empty on every rank give lse = -inf, o = 0.
    """
    # Unrolled over the (static, small) partial count: XLA:CPU reduces a stacked [c, B, 1, H, L]
    # over axis 0 up to 10x slower than this sum of c fused terms
    # (`python -m benchmarks kernel --only dcp_combine`).
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
