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
    mla_paged_attention_reference,
)


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


def paged_attention(
    impl: str, q_lat, q_pe, cache, block_table, kv_lens, *, sm_scale: float
) -> tuple[jax.Array, jax.Array]:
    """Absorbed paged MLA by the implementation the model was built with: "kernel" (Pallas, a
    GPU), "interpret" (the same kernel on a CPU, for tests), "reference" (XLA) or "auto" (the
    kernel on a GPU). The kernel falls back to the reference for dims it does not take
    (static shapes: decided at trace)."""
    if impl == "auto":
        impl = "kernel" if jax.default_backend() == "gpu" else "reference"
    if impl != "reference":
        if kernel_supports(q_lat.shape[-1], q_pe.shape[-1], cache.shape[1]):
            interpret = impl == "interpret"
            return mla_paged_attention(
                q_lat, q_pe, cache, block_table, kv_lens, sm_scale=sm_scale, interpret=interpret
            )
    return mla_paged_attention_reference(
        q_lat, q_pe, cache, block_table, kv_lens, sm_scale=sm_scale
    )


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
