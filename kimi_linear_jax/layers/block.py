"""Pre-norm decoder block: x += Mixer(norm(x)); x += FFN(norm(x)). Mixer is KDA or MLA,
FFN is the dense MLP or the MoE; attribute names follow the checkpoint's.

One method per mode, each taking the layer's cache and returning it (`prefill`, `verify`), so
the model's layer loop exists once. Under TP the mixer and the FFN each return a partial sum
(row-parallel output projections, local experts): the block all-reduces each once.
"""

from __future__ import annotations

import jax
from flax import nnx

from kimi_linear_jax.cache import Batch, KDAState, MLACache
from kimi_linear_jax.config import KimiLinearConfig
from kimi_linear_jax.layers.kda import KDA
from kimi_linear_jax.layers.mla import MLA
from kimi_linear_jax.layers.mlp import MLP
from kimi_linear_jax.layers.moe import MoE
from kimi_linear_jax.layers.norm import RMSNorm
from kimi_linear_jax.ops import order
from kimi_linear_jax.parallel.mesh import SINGLE, Parallel


def state_rows(state: KDAState, slots: jax.Array) -> KDAState:
    return KDAState(*(a[slots] for a in state))


def scatter_rows(
    state: KDAState,
    slots: jax.Array,
    rows: KDAState,
    after: jax.Array | None = None,
    mode: str | None = None,
) -> KDAState:
    """Write `rows` into `slots` of every pool array, in place.

    XLA fuses the pools' row gathers into every consumer, including the fusion that writes
    S (the new S is recomputed there from the conv rows). A pool written while such a fusion
    may still read it is protected by a copy of the whole pool, on every step: with 97 slots
    the `small` model's decode went from 9 ms to 77 ms. Ordering the writes removes the
    copies: S after `after` (pass what depends on every read of the pools, e.g. the logits),
    then the conv windows after S. `mode="drop"` skips rows whose slot is out of range."""
    S = state.S.at[slots].set(order.after(rows.S, after).astype(state.S.dtype), mode=mode)
    windows = (
        a.at[slots].set(order.after(r, S).astype(a.dtype), mode=mode)
        for a, r in zip(state[:3], rows)
    )
    return KDAState(*windows, S)


class DecoderBlock(nnx.Module):
    def __init__(
        self, config: KimiLinearConfig, layer: int, *, dtype, rngs: nnx.Rngs, par: Parallel = SINGLE
    ):
        self.par = par
        self.kind = config.layer_kinds[layer]
        self.ffn_kind = config.ffn_kinds[layer]
        D, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(D, eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(D, eps, dtype=dtype)
        if self.kind == "kda":
            self.self_attn = KDA(config, dtype=dtype, rngs=rngs)
        else:
            self.self_attn = MLA(config, dtype=dtype, rngs=rngs, par=par)
        if self.ffn_kind == "moe":
            self.block_sparse_moe = MoE(config, dtype=dtype, rngs=rngs, par=par)
        else:
            self.mlp = MLP(D, config.intermediate_size, dtype=dtype, rngs=rngs)

    def ffn(self, x):
        h = self.post_attention_layernorm(x)
        y = self.block_sparse_moe(h) if self.ffn_kind == "moe" else self.mlp(h)
        return x + self.par.psum(y)

    def __call__(self, x):
        return self.ffn(x + self.par.psum(self.self_attn(self.input_layernorm(x))))

    def prefill(self, x, cache: KDAState | MLACache, batch: Batch, *, has_prefix: bool):
        """A chunk of new tokens per row: (x, the layer's cache with the chunk in it)."""
        h = self.input_layernorm(x)
        if self.kind == "kda":
            y, rows = self.self_attn.prefill(h, state_rows(cache, batch.slots), batch.lengths)
            cache = scatter_rows(cache, batch.slots, rows)
        else:
            y, cache = self.self_attn.prefill(h, cache, batch, has_prefix=has_prefix)
        return self.ffn(x + self.par.psum(y)), cache

    def verify(self, x, cache: KDAState | MLACache, batch: Batch, keep: str = "states"):
        """A window of T new tokens per row: (x, cache, what the KDA commit needs, or None).
        MLA rows are written; a KDA layer's cache comes back unchanged, and its per-step
        states (keep="states") or per-step inputs (keep="inputs") are returned for the caller
        to commit (`layers.kda.advance`)."""
        h = self.input_layernorm(x)
        if self.kind == "kda":
            rows = state_rows(cache, batch.slots)
            y, steps = self.self_attn.decode(h, rows, batch.lengths, keep)
        else:
            (y, cache), steps = self.self_attn.decode(h, cache, batch), None
        return self.ffn(x + self.par.psum(y)), cache, steps

    def verify_tree(self, x, cache: KDAState | MLACache, batch: Batch, parents: jax.Array):
        """A draft-tree window of T nodes (`ops.tree`), the cache only read: (x, what the
        layer keeps for the commit): a KDA layer's per-node states (`KDA.decode_tree`), an MLA
        layer's window latent rows [B, T, L + R] (`MLA.decode_tree`; `MLA.write` stores them)."""
        h = self.input_layernorm(x)
        if self.kind == "kda":
            y, kept = self.self_attn.decode_tree(h, state_rows(cache, batch.slots), parents)
        else:
            y, kept = self.self_attn.decode_tree(h, cache, batch, parents)
        return self.ffn(x + self.par.psum(y)), kept
