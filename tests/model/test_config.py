"""KimiLinearConfig: reading HF config dicts (the release's, transformers'), round trips,
validation errors, and the parameter counts of the presets (abstract shapes only)."""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_linear_jax.config import _REQUIRED, KimiLinearConfig
from kimi_linear_jax.model import KimiLinearForCausalLM
from kimi_linear_jax.presets import PRESETS, preset
from tests.helpers import TF_TINY

# The released Kimi-Linear-48B-A3B-Instruct config.json, field by field from the reference
# table, plus fields this project does not know (they must be ignored).
RELEASE = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "vocab_size": 163840,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 27,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "pad_token_id": 163839,
    "model_max_length": 1048576,
    "linear_attn_config": {
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "num_heads": 32,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
    },
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_shared_experts": 1,
    "moe_intermediate_size": 1024,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "moe_router_activation_func": "sigmoid",
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "moe_renormalize": True,
    "routed_scaling_factor": 2.446,
    "hidden_act": "silu",
    # leftovers and fields unknown to KimiLinearConfig
    "head_dim": 72,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "initializer_range": 0.02,
    "transformers_version": "4.56.0",
    "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig"},
    "some_future_field": {"nested": [1, 2, 3]},
}

RELEASE_MLA_LAYERS = (3, 7, 11, 15, 19, 23, 26)  # 0-based


def release() -> dict:
    return copy.deepcopy(RELEASE)


# ---- the release's config.json -------------------------------------------------------------------
def test_release_config_layer_kinds_and_dims():
    c = KimiLinearConfig.from_hf_config(release())
    assert len(c.layer_kinds) == 27
    assert c.mla_layer_ids == RELEASE_MLA_LAYERS
    assert c.kda_layer_ids == tuple(i for i in range(27) if i not in RELEASE_MLA_LAYERS)
    assert c.layer_kinds[3] == "mla" and c.layer_kinds[0] == "kda" and c.layer_kinds[26] == "mla"
    assert c.ffn_kinds == ("dense",) + ("moe",) * 26
    assert c.qk_head_dim == 192
    assert c.latent_dim == 576
    assert c.kda_dim == 4096
    assert c.q_lora_rank is None
    assert c.eos_token_ids == (163586,)


def test_release_config_matches_preset_and_ignores_unknown_fields():
    c = KimiLinearConfig.from_hf_config(release())
    assert c == preset("kimi-linear-48b-a3b")
    names = {f.name for f in dataclasses.fields(c)}
    assert not {"head_dim", "rope_theta", "some_future_field", "auto_map"} & names
    # Changing an unknown field changes nothing; changing a known one does.
    hf = release()
    hf["head_dim"] = 999
    hf["some_future_field"] = "anything"
    assert KimiLinearConfig.from_hf_config(hf) == c
    hf["routed_scaling_factor"] = 1.0
    assert KimiLinearConfig.from_hf_config(hf).routed_scaling_factor == 1.0


def test_from_json_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(RELEASE))
    assert KimiLinearConfig.from_json_file(p) == KimiLinearConfig.from_hf_config(release())
    p.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        KimiLinearConfig.from_json_file(p)
    p.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        KimiLinearConfig.from_json_file(p)


# ---- round trips ---------------------------------------------------------------------------------
ROUND_TRIP = {
    **{name: (lambda name=name: preset(name)) for name in PRESETS},
    "tiny-q-lora": lambda: dataclasses.replace(preset("tiny"), q_lora_rank=24),
    "48b-q-lora": lambda: dataclasses.replace(preset("kimi-linear-48b-a3b"), q_lora_rank=1536),
    "tiny-eos-tuple": lambda: preset("tiny", eos_token_id=(258, 257)),
}


@pytest.mark.parametrize("name", sorted(ROUND_TRIP))
def test_round_trip(name):
    c = ROUND_TRIP[name]()
    hf = c.to_hf_config()
    assert hf["model_type"] == "kimi_linear"
    assert KimiLinearConfig.from_hf_config(hf) == c
    # Through JSON text too (tuples become lists, None becomes null).
    assert KimiLinearConfig.from_hf_config(json.loads(json.dumps(hf))) == c


def test_round_trip_q_lora_rank_is_kept():
    c = dataclasses.replace(preset("tiny"), q_lora_rank=24)
    hf = json.loads(json.dumps(c.to_hf_config()))
    assert hf["q_lora_rank"] == 24
    assert KimiLinearConfig.from_hf_config(hf).q_lora_rank == 24
    assert KimiLinearConfig.from_hf_config(preset("tiny").to_hf_config()).q_lora_rank is None


# ---- layer_types (written by transformers) -------------------------------------------------------
def test_layer_types_take_precedence_over_lists():
    hf = release()
    # Lists say layer 4 (1-based) is MLA; layer_types says only the first and last are.
    types = ["linear_attention"] * 27
    types[0] = types[26] = "full_attention"
    hf["layer_types"] = types
    c = KimiLinearConfig.from_hf_config(hf)
    assert c.mla_layer_ids == (0, 26)
    assert c.full_attn_layers == (1, 27)
    assert c.kda_layers == tuple(range(2, 27))


def test_layer_types_without_lists():
    hf = release()
    del hf["linear_attn_config"]["kda_layers"]
    del hf["linear_attn_config"]["full_attn_layers"]
    types = ["full_attention" if i in RELEASE_MLA_LAYERS else "linear_attention" for i in range(27)]
    hf["layer_types"] = types
    assert KimiLinearConfig.from_hf_config(hf) == preset("kimi-linear-48b-a3b")


def test_layer_types_wrong_length():
    hf = release()
    hf["layer_types"] = ["linear_attention"] * 26
    with pytest.raises(ValueError, match=r"layer_types has 26 entries.*27"):
        KimiLinearConfig.from_hf_config(hf)


def test_layer_types_unknown_kind():
    hf = release()
    hf["layer_types"] = ["linear_attention"] * 26 + ["sliding_attention"]
    with pytest.raises(ValueError, match=r"missing \[27\]"):
        KimiLinearConfig.from_hf_config(hf)


# ---- transformers' config ------------------------------------------------------------------------
def test_transformers_config_dict():
    transformers = pytest.importorskip("transformers")
    tf = transformers.KimiLinearConfig(**TF_TINY)
    d = tf.to_dict()
    c = KimiLinearConfig.from_hf_config(d)
    assert c.layer_kinds == ("kda", "kda", "mla", "kda")
    assert c.ffn_kinds == ("dense", "moe", "moe", "moe")
    # transformers' own view of the layers agrees with ours.
    kind = {"linear_attention": "kda", "full_attention": "mla"}
    assert tuple(kind[t] for t in tf.layer_types) == c.layer_kinds
    assert tuple({"dense": "dense", "sparse": "moe"}[t] for t in tf.mlp_layer_types) == c.ffn_kinds
    assert (c.num_experts, c.num_experts_per_token, c.num_expert_group, c.topk_group) == (
        8,
        2,
        2,
        1,
    )
    assert c.num_shared_experts == 1 and c.moe_intermediate_size == 32
    assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (128, 64, 96)
    assert (c.linear_num_heads, c.linear_head_dim, c.short_conv_kernel_size) == (2, 16, 4)
    assert (c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (32, 16, 8, 16)
    assert c.q_lora_rank is None
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (1, 2, 0)
    # transformers' attribute_map aliases, whether or not to_dict wrote them.
    assert tf.num_experts_per_tok == c.num_experts_per_token
    assert tf.n_group == c.num_expert_group
    for alias, name in (
        ("num_experts_per_tok", "num_experts_per_token"),
        ("n_group", "num_expert_group"),
    ):
        if alias in d:
            assert d[alias] == getattr(c, name)


def test_alias_field_names():
    hf = release()
    for name, alias, value in (
        ("num_experts_per_token", "num_experts_per_tok", 6),
        ("num_expert_group", "n_group", 4),
        ("num_shared_experts", "n_shared_experts", 2),
        ("moe_renormalize", "norm_topk_prob", False),
        ("num_experts", "num_local_experts", 128),
        ("model_max_length", "max_position_embeddings", 4096),
    ):
        del hf[name]
        hf[alias] = value
    c = KimiLinearConfig.from_hf_config(hf)
    assert c.num_experts_per_token == 6
    assert c.num_expert_group == 4
    assert c.num_shared_experts == 2
    assert c.moe_renormalize is False
    assert c.num_experts == 128
    assert c.model_max_length == 4096
    # The canonical name wins when both are present.
    hf["num_experts_per_token"] = 3
    assert KimiLinearConfig.from_hf_config(hf).num_experts_per_token == 3


# ---- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", ["llama", "deepseek_v3", None])
def test_wrong_model_type(model_type):
    hf = release()
    if model_type is None:
        del hf["model_type"]
    else:
        hf["model_type"] = model_type
    with pytest.raises(ValueError, match="model_type"):
        KimiLinearConfig.from_hf_config(hf)


@pytest.mark.parametrize("name", list(_REQUIRED))
def test_missing_required_field(name):
    hf = release()
    del hf[name]
    with pytest.raises(ValueError, match=re.escape(f"'{name}'")):
        KimiLinearConfig.from_hf_config(hf)


@pytest.mark.parametrize("name", ["num_heads", "head_dim", "kda_layers", "full_attn_layers"])
def test_missing_linear_attn_field(name):
    hf = release()
    del hf["linear_attn_config"][name]
    with pytest.raises(ValueError, match=re.escape(f"'linear_attn_config.{name}'")):
        KimiLinearConfig.from_hf_config(hf)


def test_overlapping_layer_lists():
    hf = release()
    hf["linear_attn_config"]["kda_layers"].append(4)  # 4 is also a full-attention layer
    with pytest.raises(ValueError, match=r"layers \[4\] are both KDA and MLA"):
        KimiLinearConfig.from_hf_config(hf)


def test_layer_lists_not_covering_all_layers():
    hf = release()
    hf["linear_attn_config"]["kda_layers"].remove(5)
    with pytest.raises(ValueError, match=r"1\.\.27.*missing \[5\]"):
        KimiLinearConfig.from_hf_config(hf)


def test_layer_lists_out_of_range():
    hf = release()
    hf["linear_attn_config"]["full_attn_layers"].append(28)
    with pytest.raises(ValueError, match=r"out of range \[28\]"):
        KimiLinearConfig.from_hf_config(hf)


def test_zero_based_lists_rejected():
    # A 0-based list (0..26) misses layer 27 and has 0 out of range.
    hf = release()
    lin = hf["linear_attn_config"]
    lin["kda_layers"] = [i - 1 for i in lin["kda_layers"]]
    lin["full_attn_layers"] = [i - 1 for i in lin["full_attn_layers"]]
    with pytest.raises(ValueError, match=r"missing \[27\], out of range \[0\]"):
        KimiLinearConfig.from_hf_config(hf)


@pytest.mark.parametrize(
    "field, value, pattern",
    [
        ("num_expert_group", 3, "num_expert_group"),
        ("num_experts_per_token", 300, "num_experts_per_token"),
        ("topk_group", 2, "topk_group"),
        ("moe_router_activation_func", "softmax", "moe_router_activation_func"),
        ("hidden_act", "gelu", "hidden_act"),
    ],
)
def test_invalid_values(field, value, pattern):
    hf = release()
    hf[field] = value
    with pytest.raises(ValueError, match=pattern):
        KimiLinearConfig.from_hf_config(hf)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("hidden_size", "64", r"hidden_size must be an integer >= 1, got '64'"),
        ("vocab_size", -5, r"vocab_size must be an integer >= 1, got -5"),
        ("num_attention_heads", 4.0, r"num_attention_heads must be an integer >= 1, got 4.0"),
        ("num_experts", True, r"num_experts must be an integer >= 0, got True"),
        ("rms_norm_eps", "1e-5", r"rms_norm_eps must be a finite number > 0"),
        ("routed_scaling_factor", float("nan"), r"routed_scaling_factor must be a finite"),
        ("moe_renormalize", "yes", r"moe_renormalize must be true or false"),
        ("bos_token_id", -1, r"bos_token_id must be a non-negative integer or null"),
        ("eos_token_id", "2", r"eos_token_id must be an integer or a list of them"),
    ],
)
def test_config_field_types_and_ranges(field, value, match):
    """Issue 12, defect 9: a wrong type or range names the field (not a JAX traceback)."""
    hf = preset("tiny").to_hf_config()
    hf[field] = value
    with pytest.raises(ValueError, match=match):
        KimiLinearConfig.from_hf_config(hf)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        preset("huge")


# ---- parameter counts (abstract shapes, nothing materialised) ------------------------------------
def expected_param_count(c: KimiLinearConfig) -> tuple[int, int]:
    """(all parameters, fp32 ones) from the checkpoint's tensor table."""
    D, V = c.hidden_size, c.vocab_size
    n = 2 * V * D + D  # embed, lm_head, final norm
    fp32 = 0
    for kind, ffn in zip(c.layer_kinds, c.ffn_kinds):
        n += 2 * D  # input / post-attention norms
        if kind == "kda":
            P, H, d, W = c.kda_dim, c.linear_num_heads, c.linear_head_dim, c.short_conv_kernel_size
            n += 3 * P * D + 3 * P * W  # q/k/v proj, q/k/v conv
            n += H + P  # A_log, dt_bias
            n += d * D + P * d + H * D + d * D + P * d  # f_a, f_b, b, g_a, g_b
            n += d + D * P  # o_norm, o_proj
            fp32 += H + P
        else:
            N, L = c.num_attention_heads, c.kv_lora_rank
            q = N * c.qk_head_dim
            if c.q_lora_rank is None:
                n += q * D
            else:
                n += c.q_lora_rank * D + c.q_lora_rank + q * c.q_lora_rank
            n += c.latent_dim * D + L + N * (c.qk_nope_head_dim + c.v_head_dim) * L
            n += D * N * c.v_head_dim
        if ffn == "dense":
            n += 3 * D * c.intermediate_size
        else:
            E, I = c.num_experts, c.moe_intermediate_size
            n += E * D + E + 3 * E * I * D + 3 * D * I * c.num_shared_experts
            fp32 += E
    return n, fp32


def abstract_params(config: KimiLinearConfig, dtype=jnp.float32) -> dict[str, jax.ShapeDtypeStruct]:
    model = nnx.eval_shape(lambda: KimiLinearForCausalLM(config, dtype=dtype))
    return {
        ".".join(str(p) for p in path): v
        for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


@pytest.mark.slow  # tracing the 48B model abstractly takes ~20 s on a CPU
def test_48b_parameter_count():
    c = preset("kimi-linear-48b-a3b")
    params = abstract_params(c, jnp.bfloat16)
    for v in params.values():
        # eval_shape gives shapes only: nothing of 98 GB was allocated.
        assert isinstance(v.get_value(), jax.ShapeDtypeStruct)
    count = sum(int(np.prod(v.shape)) for v in params.values())
    nbytes = sum(int(np.prod(v.shape)) * jnp.dtype(v.dtype).itemsize for v in params.values())
    fp32 = {k: v for k, v in params.items() if v.dtype == jnp.float32}
    n_fp32 = sum(int(np.prod(v.shape)) for v in fp32.values())
    print(f"kimi-linear-48b-a3b: {count} parameters ({count / 1e9:.3f}e9), {nbytes} bytes in bf16")
    assert 48.6e9 <= count <= 49.6e9
    assert (count, n_fp32) == expected_param_count(c)
    # Only A_log, dt_bias and the router's correction bias stay fp32; the rest are bf16.
    assert {k.rsplit(".", 1)[-1] for k in fp32} == {"A_log", "dt_bias", "e_score_correction_bias"}
    assert len(fp32) == 2 * 20 + 26
    assert all(v.dtype == jnp.bfloat16 for k, v in params.items() if k not in fp32)
    assert nbytes == 2 * (count - n_fp32) + 4 * n_fp32
    assert 2 * count < nbytes < 2 * count + 1e6


def test_small_parameter_count():
    c = preset("small")
    params = abstract_params(c)
    count = sum(int(np.prod(v.shape)) for v in params.values())
    print(f"small: {count} parameters")
    assert 80e6 <= count <= 130e6
    assert count == expected_param_count(c)[0]


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_tiny_parameter_count(q_lora_rank):
    c = preset("tiny", q_lora_rank=q_lora_rank)
    params = abstract_params(c)
    assert sum(int(np.prod(v.shape)) for v in params.values()) == expected_param_count(c)[0]
    has_q_a = any(".q_a_proj." in k for k in params)
    assert has_q_a == (q_lora_rank is not None)
