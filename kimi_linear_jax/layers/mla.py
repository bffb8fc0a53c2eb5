"""Multi-head Latent Attention (NoPE: the 64 "rope" dims exist but nothing is rotated).

Naive form (expand the latent through kv_b_proj) for the no-cache forward and for prefill;
absorbed form (q through W_UK, attention over the 576-wide latent rows, W_UV after) for decode
and verify over the paged cache. The paged attention call is a pluggable backend returning
`(o_lat, lse)`: the XLA reference here, the Pallas kernel on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_linear_jax.cache import MLACache
from kimi_linear_jax.config import KimiLinearConfig
from kimi_linear_jax.layers.linear import Linear, acc_dtype
from kimi_linear_jax.layers.norm import RMSNorm
from kimi_linear_jax.ops import mla as mla_ops

# (q_lat, q_pe, cache, block_table, kv_lens, *, sm_scale) -> (o_lat, lse)
AttentionBackend = Callable[..., tuple[jax.Array, jax.Array]]


class MLA(nnx.Module):
    def __init__(self, config: KimiLinearConfig, *, dtype, rngs: nnx.Rngs):
        D, N = config.hidden_size, config.num_attention_heads
        self.num_heads = N
        self.nope, self.rope, self.vdim = (
            config.qk_nope_head_dim,
            config.qk_rope_head_dim,
            config.v_head_dim,
        )
        self.rank = config.kv_lora_rank
        self.sm_scale = config.qk_head_dim**-0.5
        qdim = N * config.qk_head_dim
        if config.q_lora_rank is None:
            self.q_proj = Linear(D, qdim, dtype=dtype, rngs=rngs)
        else:
            self.q_a_proj = Linear(D, config.q_lora_rank, dtype=dtype, rngs=rngs)
            # The reference builds this norm with its default eps (1e-6), not rms_norm_eps.
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, 1e-6, dtype=dtype)
            self.q_b_proj = Linear(config.q_lora_rank, qdim, dtype=dtype, rngs=rngs)
        self.kv_a_proj_with_mqa = Linear(D, config.latent_dim, dtype=dtype, rngs=rngs)
        self.kv_a_layernorm = RMSNorm(self.rank, config.kv_a_layernorm_eps, dtype=dtype)
        self.kv_b_proj = Linear(self.rank, N * (self.nope + self.vdim), dtype=dtype, rngs=rngs)
        self.o_proj = Linear(N * self.vdim, D, dtype=dtype, rngs=rngs)

    # ---- pieces ----------------------------------------------------------------------------
    def _query(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(*x.shape[:-1], self.num_heads, self.nope + self.rope)
        return q[..., : self.nope], q[..., self.nope :]

    def latent(self, x: jax.Array) -> jax.Array:
        """The cached row of each token: [c (normed latent, L), k_pe (R)] -> [B, T, L + R]."""
        kv = self.kv_a_proj_with_mqa(x)
        c = self.kv_a_layernorm(kv[..., : self.rank])
        return jnp.concatenate([c, kv[..., self.rank :]], axis=-1)

    def _kv_b(self) -> tuple[jax.Array, jax.Array]:
        """W_UK [N, P_n, L] and W_UV [N, Vd, L] from kv_b_proj [N * (P_n + Vd), L]."""
        w = self.kv_b_proj.weight[...].reshape(self.num_heads, self.nope + self.vdim, self.rank)
        return w[:, : self.nope], w[:, self.nope :]

    def _naive(self, q_nope, q_pe, rows, mask):
        """Expand latents to per-head keys/values and attend: o [B, T, N, Vd] f32, lse."""
        c, k_pe = rows[..., : self.rank], rows[..., self.rank :]
        kvb = self.kv_b_proj(c).reshape(*c.shape[:-1], self.num_heads, self.nope + self.vdim)
        k_pe = jnp.broadcast_to(k_pe[:, :, None, :], (*kvb.shape[:-1], self.rope))
        k = jnp.concatenate([kvb[..., : self.nope], k_pe.astype(kvb.dtype)], axis=-1)
        q = jnp.concatenate([q_nope, q_pe], axis=-1)
        return mla_ops.mla_naive_attention(q, k, kvb[..., self.nope :], mask, self.sm_scale)

    def _absorbed(self, q_nope, q_pe, cache, block_table, kv_lens, backend, mesh=None):
        """Attention over the paged cache in latent space, mapped back to [B, T, N, Vd] f32.
        With a DCP mesh the cache is sharded over 'dcp' and rank partials merge by lse."""
        w_uk, w_uv = self._kv_b()
        acc = acc_dtype(q_nope)
        q_lat = jnp.einsum("btnp,npl->btnl", q_nope, w_uk, preferred_element_type=acc)
        args = (q_lat, q_pe.astype(acc), cache, block_table, kv_lens)
        if mesh is None:
            o_lat, lse = backend(*args, sm_scale=self.sm_scale)
        else:
            from kernels.dcp import dcp_attention

            o_lat, lse = dcp_attention(*args, sm_scale=self.sm_scale, mesh=mesh, backend=backend)
        o = jnp.einsum("btnl,nvl->btnv", o_lat, w_uv.astype(o_lat.dtype))
        return o, lse

    @staticmethod
    def _write(cache: jax.Array, rows: jax.Array, batch, mesh) -> jax.Array:
        """Store new latent rows; under DCP each token is written by its owning rank only."""
        if mesh is None:
            return mla_ops.write_latents(cache, rows, batch.block_table, batch.start, batch.lengths)
        from kernels.dcp import dcp_write_latents

        return dcp_write_latents(cache, rows, batch.block_table, batch.start, batch.lengths, mesh)

    def _out(self, x: jax.Array, o: jax.Array) -> jax.Array:
        return self.o_proj(o.astype(x.dtype).reshape(*x.shape[:-1], -1))

    # ---- entries ---------------------------------------------------------------------------
    def __call__(self, x: jax.Array) -> jax.Array:
        """No-cache causal forward [B, T, D] -> [B, T, D] (naive form, differentiable)."""
        q_nope, q_pe = self._query(x)
        T = x.shape[1]
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (x.shape[0], T, T))
        o, _ = self._naive(q_nope, q_pe, self.latent(x), mask)
        return self._out(x, o)

    def prefill(
        self, x, cache: MLACache, batch, *, has_prefix: bool, backend: AttentionBackend, mesh=None
    ):
        """Chunk of T new tokens at positions start..start+T-1: naive attention inside the chunk,
        plus (has_prefix) absorbed attention over the cached prefix, merged by lse."""
        q_nope, q_pe = self._query(x)
        rows = self.latent(x)
        T = x.shape[1]
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (x.shape[0], T, T))
        o, lse = self._naive(q_nope, q_pe, rows, mask)
        if has_prefix:
            kv_lens = jnp.broadcast_to(batch.start[:, None], (x.shape[0], T))
            o_p, lse_p = self._absorbed(
                q_nope, q_pe, cache.latent, batch.block_table, kv_lens, backend, mesh
            )
            o, _ = mla_ops.merge_partials(o, lse, o_p, lse_p)
        latent = self._write(cache.latent, rows, batch, mesh)
        return self._out(x, o), MLACache(latent)

    def decode(self, x, cache: MLACache, batch, *, backend: AttentionBackend, mesh=None):
        """T new tokens (decode T = 1, verify T = k + 1): write their rows, then row t attends
        to the first start + t + 1 positions (clamped to the row's valid length)."""
        q_nope, q_pe = self._query(x)
        latent = self._write(cache.latent, self.latent(x), batch, mesh)
        T = x.shape[1]
        t = jnp.arange(T)[None, :]
        kv_lens = batch.start[:, None] + jnp.minimum(t + 1, batch.lengths[:, None])
        kv_lens = jnp.where(batch.lengths[:, None] > 0, kv_lens, 0)
        o, _ = self._absorbed(q_nope, q_pe, latent, batch.block_table, kv_lens, backend, mesh)
        return self._out(x, o), MLACache(latent)
