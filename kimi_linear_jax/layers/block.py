"""Pre-norm decoder block: x += Mixer(norm(x)); x += FFN(norm(x)). Mixer is KDA or MLA,
FFN is the dense MLP or the MoE; attribute names follow the checkpoint's."""

from __future__ import annotations

from flax import nnx

from kimi_linear_jax.config import KimiLinearConfig
from kimi_linear_jax.layers.kda import KDA
from kimi_linear_jax.layers.mla import MLA
from kimi_linear_jax.layers.mlp import MLP
from kimi_linear_jax.layers.moe import MoE
from kimi_linear_jax.layers.norm import RMSNorm


class DecoderBlock(nnx.Module):
    def __init__(self, config: KimiLinearConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        self.kind = config.layer_kinds[layer]
        self.ffn_kind = config.ffn_kinds[layer]
        D, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(D, eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(D, eps, dtype=dtype)
        mixer = KDA if self.kind == "kda" else MLA
        self.self_attn = mixer(config, dtype=dtype, rngs=rngs)
        if self.ffn_kind == "moe":
            self.block_sparse_moe = MoE(config, dtype=dtype, rngs=rngs)
        else:
            self.mlp = MLP(D, config.intermediate_size, dtype=dtype, rngs=rngs)

    def ffn(self, x):
        h = self.post_attention_layernorm(x)
        return x + (self.block_sparse_moe(h) if self.ffn_kind == "moe" else self.mlp(h))

    def __call__(self, x):
        return self.ffn(x + self.self_attn(self.input_layernorm(x)))
