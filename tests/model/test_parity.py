"""Logits parity with transformers 5.23 `KimiLinearForCausalLM` (pure torch on CPU).

Random tiny models are built *in transformers*, saved with its `save_pretrained`, loaded here
with `load_pretrained`, and both run the same ids in float32.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_linear_jax import load_pretrained
from kimi_linear_jax.model import forward, set_kda_impl
from tests.helpers import TF_TINY, assert_close

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Grouped routing is exercised by the 'grouped_topk' variant; the base uses one group.
BASE = {**TF_TINY, "num_expert_group": 1}

VARIANTS = {
    "base": {},
    "q_lora": dict(q_lora_rank=24),
    "grouped_topk": dict(num_expert_group=4, topk_group=2, num_experts_per_token=3),
    "dense2_no_shared": dict(first_k_dense_replace=2, num_shared_experts=0),
    "two_shared": dict(num_shared_experts=2),
    # Head dims that are not powers of two, odd head counts, and a 5-layer mix with 2 MLA layers.
    "odd_dims": dict(
        hidden_size=48,
        num_attention_heads=3,
        num_key_value_heads=3,
        kv_lora_rank=20,
        qk_rope_head_dim=6,
        qk_nope_head_dim=10,
        v_head_dim=12,
        num_hidden_layers=5,
        linear_attn_config={
            "kda_layers": [1, 3, 4],
            "full_attn_layers": [2, 5],
            "num_heads": 3,
            "head_dim": 12,
            "short_conv_kernel_size": 4,
        },
    ),
}


def hf_model(path, seed: int, **overrides):
    """A random transformers model with perturbed norms and router bias, saved to `path`."""
    cfg = transformers.KimiLinearConfig(**{**BASE, **overrides})
    torch.manual_seed(seed)
    model = transformers.KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.05 * torch.randn_like(b))
    model.save_pretrained(path)
    return model


_PAIRS: dict = {}


def _pair(variant: str, impl: str, tmp_path_factory):
    """(name, transformers model, our jitted forward), built once per variant and impl."""
    if variant not in _PAIRS:
        path = tmp_path_factory.mktemp(variant)
        _PAIRS[variant] = (hf_model(path, seed=len(variant), **VARIANTS[variant]), path)
    ref, path = _PAIRS[variant]
    graphdef, params = nnx.split(set_kda_impl(load_pretrained(path, dtype="float32"), impl))
    return f"{variant}/{impl}", ref, lambda ids: forward(graphdef, params, ids)


# Every variant at T = 130 (two chunks, the second partial) with the default KDA prefill
# ('auto': the recurrent scan on CPU), two of them with the chunked form too; the base model
# also at T = 1 and 37. Each case is a fresh compile, so the grid is kept to what adds coverage.
CASES = (
    [("base", 1, "chunked"), ("base", 37, "auto")]
    + [(v, 130, "auto") for v in sorted(VARIANTS)]
    + [(v, 130, "chunked") for v in ("base", "odd_dims")]
)


@pytest.mark.parametrize("variant,T,impl", CASES)
def test_logits_match_transformers(variant, T, impl, tmp_path_factory):
    name, ref, ours = _pair(variant, impl, tmp_path_factory)
    ids = np.random.default_rng(T).integers(0, BASE["vocab_size"], (2, T))
    with torch.no_grad():
        expected = ref(torch.as_tensor(ids)).logits.numpy()
    got = np.asarray(ours(jnp.asarray(ids, jnp.int32)))
    # f32 on both sides with different summation orders (chunked KDA, fused einsums):
    # we reach ~1e-6 relative; 1e-4 is the stated bar.
    assert_close(got, expected, atol=1e-4, rtol_rms=1e-5, name=f"{name} T={T}")
