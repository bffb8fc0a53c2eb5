"""Multi-head Latent Attention (NoPE: the 64 "rope" dims exist but nothing is rotated).

Naive form (expand the latent through kv_b_proj) for the no-cache forward and for prefill;
absorbed form (q through W_UK, attention over the 576-wide latent rows, W_UV after) for decode
and verify over the paged cache.

Under TP x DCP (`self.par`, fixed when the model is built for a mesh) this runs on one rank of
the model's shard_map: q_proj, W_UK, W_UV and o_proj hold the rank's H / tp heads, the latent
projection is whole, and the latent cache holds the rank's 1/dcp of every sequence's tokens.
The absorbed query is all-gathered over the DCP group (H * dcp / tp heads, or computed whole
with `replicate_q_proj`), each rank attends its tokens, the partials combine back to the head
shard by lse, then W_UV and the row-parallel o_proj (the block all-reduces).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_linear_jax.cache import MLACache
from kimi_linear_jax.config import KimiLinearConfig
from kimi_linear_jax.layers.linear import Linear, acc_dtype
from kimi_linear_jax.layers.norm import RMSNorm
from kimi_linear_jax.ops import mla as mla_ops
from kimi_linear_jax.ops import order
from kimi_linear_jax.ops import tree as tree_ops
from kimi_linear_jax.parallel import dcp
from kimi_linear_jax.parallel.mesh import SINGLE, Parallel


class Absorbed(nnx.Variable):
    """W_UK or W_UV split out of kv_b_proj for the absorbed form (`MLA.split_kv_b`): a copy
    for serving, not a parameter (never saved, loaded or trained; kv_b_proj stays the one
    source)."""


class MLA(nnx.Module):
    def __init__(self, config: KimiLinearConfig, *, dtype, rngs: nnx.Rngs, par: Parallel = SINGLE):
        D, N = config.hidden_size, config.num_attention_heads
        self.par = par
        self.nope, self.rope, self.vdim = (
            config.qk_nope_head_dim,
            config.qk_rope_head_dim,
            config.v_head_dim,
        )
        self.rank = config.kv_lora_rank
        self.sm_scale = config.qk_head_dim**-0.5
        qdim = N * config.qk_head_dim
        q_col = dict(dtype=dtype, rngs=rngs, axes=("q_heads", None))
        if config.q_lora_rank is None:
            self.q_proj = Linear(D, qdim, **q_col)
        else:
            self.q_a_proj = Linear(D, config.q_lora_rank, dtype=dtype, rngs=rngs)
            # The reference builds this norm with its default eps (1e-6), not rms_norm_eps.
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, 1e-6, dtype=dtype)
            self.q_b_proj = Linear(config.q_lora_rank, qdim, **q_col)
        self.kv_a_proj_with_mqa = Linear(D, config.latent_dim, dtype=dtype, rngs=rngs)
        self.kv_a_layernorm = RMSNorm(self.rank, config.kv_a_layernorm_eps, dtype=dtype)
        # kv_b_proj holds W_UK and W_UV of each head: it follows the query heads.
        self.kv_b_proj = Linear(self.rank, N * (self.nope + self.vdim), **q_col)
        self.o_proj = Linear(N * self.vdim, D, dtype=dtype, rngs=rngs, axes=(None, "heads"))

    # ---- pieces ----------------------------------------------------------------------------
    def _query(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(*x.shape[:-1], -1, self.nope + self.rope)  # the heads held here
        return q[..., : self.nope], q[..., self.nope :]

    def latent(self, x: jax.Array) -> jax.Array:
        """The cached row of each token: [c (normed latent, L), k_pe (R)] -> [B, T, L + R]."""
        kv = self.kv_a_proj_with_mqa(x)
        c = self.kv_a_layernorm(kv[..., : self.rank])
        return jnp.concatenate([c, kv[..., self.rank :]], axis=-1)

    def _kv_b(self) -> jax.Array:
        """kv_b_proj as [N, P_n + Vd, L] (N: the query heads held here)."""
        return self.kv_b_proj.weight[...].reshape(-1, self.nope + self.vdim, self.rank)

    def split_kv_b(self) -> None:
        """Keep W_UK [N, P_n, L] and W_UV [N, Vd, L] as arrays of their own, for the absorbed
        form to read whole. Sliced from kv_b_proj inside a step (strided: the heads' halves
        interleave), each half is copied on every step, since XLA:CPU's dots read whole
        arrays only (2 x 1.5 MB per MLA layer a step at the `small` shapes). Changing
        kv_b_proj afterwards leaves them stale: call this on the model a step runs
        (`model.for_serving`)."""
        w, axes = self._kv_b(), ("q_heads", None, None)  # the heads, as kv_b_proj's
        self.w_uk = Absorbed(w[:, : self.nope], logical=axes)
        self.w_uv = Absorbed(w[:, self.nope :], logical=axes)

    def _absorbed_weights(self) -> tuple[jax.Array, jax.Array]:
        """(W_UK [N, P_n, L], W_UV [N, Vd, L]) of the heads held here."""
        if hasattr(self, "w_uk"):
            return self.w_uk[...], self.w_uv[...]
        w = self._kv_b()
        return w[:, : self.nope], w[:, self.nope :]

    def _own(self, x: jax.Array, axis: int) -> jax.Array:
        """With replicate_q_proj the query-side heads are the whole DCP group's: keep this
        rank's block (its output heads). Otherwise they already are the rank's own."""
        par = self.par
        if not (par.replicate_q_proj and par.dcp > 1):
            return x
        n = x.shape[axis] // par.dcp
        return jax.lax.dynamic_slice_in_dim(x, par.dcp_rank() * n, n, axis=axis)

    def _naive(self, q_nope, q_pe, rows, mask):
        """Expand latents to per-head keys/values of the own heads and attend:
        o [B, T, N, Vd] f32, lse [B, T, N]."""
        q_nope, q_pe, w = self._own(q_nope, 2), self._own(q_pe, 2), self._own(self._kv_b(), 0)
        c, k_pe = rows[..., : self.rank], rows[..., self.rank :]
        kvb = jnp.einsum("bsl,nel->bsne", c.astype(w.dtype), w)
        k_pe = jnp.broadcast_to(k_pe[:, :, None, :], (*kvb.shape[:-1], self.rope))
        k = jnp.concatenate([kvb[..., : self.nope], k_pe.astype(kvb.dtype)], axis=-1)
        q = jnp.concatenate([q_nope, q_pe], axis=-1)
        return mla_ops.mla_naive_attention(q, k, kvb[..., self.nope :], mask, self.sm_scale)

    def _absorbed(self, q_nope, q_pe, cache, block_table, kv_lens, new=None):
        """Attention over the paged cache in latent space, mapped back to the own heads:
        o [B, T, N, Vd] f32, lse, and the cache. kv_lens [B, T]: global keys visible to each
        query row. new: (rows [B, T, L + R], col, slot), the step's latent rows and where they
        go (`_targets`): the attention sees them and the cache comes back with them written
        (`mla_ops.paged_attention_write`); None: the cache is only read."""
        q_lat, q_pe = self._latent_query(q_nope, q_pe)
        o_lat, lse, cache = self._paged_latent(q_lat, q_pe, cache, block_table, kv_lens, new)
        return self._uv(o_lat), lse, cache

    def _latent_query(self, q_nope, q_pe) -> tuple[jax.Array, jax.Array]:
        """(q_lat [B, T, N, L], q_pe [B, T, N, R]) of the query heads held here, in `acc`."""
        w_uk, _ = self._absorbed_weights()
        acc = acc_dtype(q_nope)
        return _absorb_query(q_nope, w_uk, acc), q_pe.astype(acc)

    def _paged_latent(self, q_lat, q_pe, cache, block_table, kv_lens, new=None):
        """`_absorbed` before W_UV: o_lat [B, T, N_own, L] and lse of the own heads, with the
        DCP group's partials already combined (every key of the cache counted once)."""
        par = self.par
        if par.q_gather:  # the whole DCP group's heads attend this rank's tokens
            q_lat, q_pe = dcp.gather_heads(q_lat), dcp.gather_heads(q_pe)
        if par.dcp > 1:
            kv_lens = dcp.local_len(kv_lens, par.dcp_rank(), par.dcp)
        args = (par.attention, q_lat, q_pe, cache, block_table, kv_lens)
        if new is None:
            o_lat, lse = mla_ops.paged_attention(*args, sm_scale=self.sm_scale)
        else:
            o_lat, lse, cache = mla_ops.paged_attention_write(*args, *new, sm_scale=self.sm_scale)
        if par.dcp > 1:
            combine = dcp.HEAD_COMBINES[par.combine]
            o_lat, lse = combine(o_lat.astype(jnp.float32), lse.astype(jnp.float32), par.dcp)
        return o_lat, lse, cache

    def _uv(self, o_lat: jax.Array) -> jax.Array:
        """Latent outputs of the own heads through W_UV: [B, T, N_own, Vd]."""
        w_uv = self._own(self._absorbed_weights()[1], 0)
        return jnp.einsum("btnl,nvl->btnv", o_lat, w_uv.astype(o_lat.dtype))

    def _targets(self, cache: jax.Array, batch, T: int) -> tuple[jax.Array, jax.Array]:
        """Where the step's T new rows go in this rank's pages (`mla_ops.targets`); under DCP
        each rank stores the tokens it owns."""
        par = self.par
        args = (batch.block_table, batch.start, batch.lengths, T, cache.shape[1])
        if par.dcp == 1:
            return mla_ops.targets(*args)
        return dcp.local_targets(*args, par.dcp_rank(), par.dcp)

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

    def prefill(self, x, cache: MLACache, batch, *, has_prefix: bool):
        """Chunk of T new tokens at positions start..start+T-1: naive attention inside the chunk,
        plus (has_prefix) absorbed attention over the cached prefix, merged by lse."""
        q_nope, q_pe = self._query(x)
        rows = self.latent(x)
        T = x.shape[1]
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (x.shape[0], T, T))
        o, lse = self._naive(q_nope, q_pe, rows, mask)
        if has_prefix:
            kv_lens = jnp.broadcast_to(batch.start[:, None], (x.shape[0], T))
            o_p, lse_p, _ = self._absorbed(q_nope, q_pe, cache.latent, batch.block_table, kv_lens)
            o, _ = mla_ops.merge_partials(o, lse, o_p, lse_p)
            rows = order.after(rows, o_p)  # the write after the prefix's read: in place
        where = self._targets(cache.latent, batch, T)
        latent = mla_ops.write_rows(cache.latent, rows, batch.block_table, *where)
        return self._out(x, o), MLACache(latent)

    def decode(self, x, cache: MLACache, batch):
        """T new tokens (decode T = 1, verify T = k + 1): write their rows, then row t attends
        to the first start + t + 1 positions (clamped to the row's valid length)."""
        q_nope, q_pe = self._query(x)
        T = x.shape[1]
        new = (self.latent(x), *self._targets(cache.latent, batch, T))
        t = jnp.arange(T)[None, :]
        kv_lens = batch.start[:, None] + jnp.minimum(t + 1, batch.lengths[:, None])
        kv_lens = jnp.where(batch.lengths[:, None] > 0, kv_lens, 0)
        o, _, latent = self._absorbed(q_nope, q_pe, cache.latent, batch.block_table, kv_lens, new)
        return self._out(x, o), MLACache(latent)

    def decode_tree(self, x, cache: MLACache, batch, parents: jax.Array):
        """A draft-tree window of T nodes (`ops.tree`), nothing written: node i attends the
        cached prefix [0, start) through the paged path (DCP included) and its own
        root-to-node path among the window's latent rows (dense, this rank's own heads, after
        the DCP combine, so the window counts once), merged by lse before W_UV.
        Returns (y, the window's latent rows [B, T, L + R] for `write`)."""
        q_nope, q_pe = self._query(x)
        rows = self.latent(x)
        q_lat, q_pe = self._latent_query(q_nope, q_pe)
        B, T = x.shape[:2]
        kv_lens = jnp.broadcast_to(jnp.where(batch.lengths > 0, batch.start, 0)[:, None], (B, T))
        o_p, lse_p, _ = self._paged_latent(q_lat, q_pe, cache.latent, batch.block_table, kv_lens)
        # The rows as a chain verify would read them back: in the cache's dtype.
        kv = rows.astype(cache.latent.dtype)
        own = (self._own(q_lat, 2), self._own(q_pe, 2))
        mask = tree_ops.visibility(parents)
        o_w, lse_w = mla_ops.latent_attention_masked(*own, kv, mask, sm_scale=self.sm_scale)
        o, _ = mla_ops.merge_partials(o_p.astype(o_w.dtype), lse_p.astype(lse_w.dtype), o_w, lse_w)
        return self._out(x, self._uv(o)), rows

    def write(self, cache: MLACache, rows: jax.Array, batch) -> MLACache:
        """rows[b, :lengths[b]] to positions start[b] + t (under DCP: the tokens this rank
        owns), as a decode writes its window."""
        where = self._targets(cache.latent, batch, rows.shape[1])
        return MLACache(mla_ops.write_rows(cache.latent, rows, batch.block_table, *where))


def _absorb_query(q_nope: jax.Array, w_uk: jax.Array, acc) -> jax.Array:
    """q_nope [B, T, N, P] x w_uk [N, P, L] -> q_lat [B, T, N, L] in `acc`.

    XLA:CPU has no kernel for this head-batched product with bfloat16 operands and a float32
    result once T * N reaches a few rows ("Unsupported element type for DotThunk::Execute: BF16
    x BF16 = F32", jax 0.10): a bfloat16 model failed every verify window of 8+ tokens and
    every prefill chunk of 8+ tokens after a prompt's first (long prompts, prefix hits). On
    CPU the operands go to `acc` first, which is exact (bfloat16 values are float32 values);
    elsewhere the product keeps its bfloat16 inputs."""
    if jax.default_backend() == "cpu":
        return jnp.einsum("btnp,npl->btnl", q_nope.astype(acc), w_uk.astype(acc))
    return jnp.einsum("btnp,npl->btnl", q_nope, w_uk, preferred_element_type=acc)
