"""Named configurations: `tiny` and `tiny-tp8` (tests), `small` (benchmarks), `pycode` and
`pycode-draft` (the built-in models), and `kimi-linear-48b-a3b` (the release's shapes)."""

from __future__ import annotations

import dataclasses
from typing import Any

from kimi_linear_jax.config import KimiLinearConfig


def _tiny() -> KimiLinearConfig:
    # Byte-level vocabulary (256 bytes + specials) rounded up; four layers with one MLA layer,
    # grouped routing with two groups so every code path runs in tests.
    return KimiLinearConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        kda_layers=(1, 2, 4),
        full_attn_layers=(3,),
        linear_num_heads=4,  # 4 KDA and 4 MLA heads: TP 1, 2 and 4 all shard every layer
        linear_head_dim=8,
        num_attention_heads=4,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=1,
        moe_intermediate_size=32,
        num_expert_group=2,
        topk_group=1,
        bos_token_id=256,
        eos_token_id=258,  # <|im_end|> of the byte tokenizer, as the release stops on it
        pad_token_id=0,
        model_max_length=8192,
    )


def _tiny_tp8() -> KimiLinearConfig:
    # `tiny` with head, expert, vocab and MLP counts that every TP degree up to 8 shards:
    # 8 MLA heads, 8 KDA heads, 16 experts (the parallel tests and benchmarks).
    return dataclasses.replace(
        _tiny(),
        vocab_size=128,
        num_attention_heads=8,
        linear_num_heads=8,
        linear_head_dim=8,
        num_experts=16,
        intermediate_size=64,
        moe_intermediate_size=16,
    )


def _small() -> KimiLinearConfig:
    # About 100M parameters with the release's head shapes (KDA d = 128, MLA 128/64/128, L = 512)
    # and its 3:1 KDA:MLA pattern: big enough for meaningful CPU throughput numbers.
    return KimiLinearConfig(
        vocab_size=16384,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=8,
        kda_layers=(1, 2, 3, 5, 6, 7),
        full_attn_layers=(4, 8),
        linear_num_heads=6,
        linear_head_dim=128,
        num_attention_heads=6,
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=1,
        moe_intermediate_size=384,
        bos_token_id=256,
        eos_token_id=258,  # <|im_end|> of the byte tokenizer, as the release stops on it
        pad_token_id=0,
        model_max_length=65536,
    )


def _pycode() -> KimiLinearConfig:
    # The built-in default model (about 14M parameters): trained on the Python standard
    # library with a 4,096-id byte-level BPE; three KDA layers, one MLA layer, 16 routed experts.
    return KimiLinearConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        kda_layers=(1, 2, 3),
        full_attn_layers=(4,),
        linear_num_heads=4,
        linear_head_dim=64,
        num_attention_heads=4,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        num_experts=16,
        num_experts_per_token=2,
        num_shared_experts=1,
        moe_intermediate_size=256,
        num_expert_group=1,
        topk_group=1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        model_max_length=8192,
    )


def _pycode_draft() -> KimiLinearConfig:
    # The built-in draft model (about 1.6M parameters): `pycode`'s vocabulary, two MLA layers
    # with dense MLPs at half the width. No KDA layer, so nothing to roll back after a verify,
    # and few ops: on a CPU a step is mostly a fixed cost per op, and this one costs a third
    # of the 4-layer KDA + MoE draft's (python -m benchmarks speculative --only draft_cost).
    return dataclasses.replace(
        _pycode(),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        kda_layers=(),
        full_attn_layers=(1, 2),
        first_k_dense_replace=2,
        linear_num_heads=2,
        num_attention_heads=2,
        kv_lora_rank=64,
        num_experts=4,
        moe_intermediate_size=128,
    )


PRESETS = {
    "tiny": _tiny,
    "tiny-tp8": _tiny_tp8,
    "small": _small,
    "pycode": _pycode,
    "pycode-draft": _pycode_draft,
    "kimi-linear-48b-a3b": KimiLinearConfig,  # the defaults are the release's shapes
}


def preset(name: str, **overrides: Any) -> KimiLinearConfig:
    """A named configuration (one of `PRESETS`), with field overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name](), **overrides)
