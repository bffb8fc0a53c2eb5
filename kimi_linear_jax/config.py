"""KimiLinearConfig: a frozen, hashable model configuration built from an HF `config.json`.

Layer kinds are data: `layer_kinds[i]` is "kda" or "mla", `ffn_kinds[i]` is "dense" or "moe".
A config that a jitted function has seen is never mutated; make variants with
`dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

# Fields an HF config must carry for this model to be built. Everything else has the
# release's value as a default.
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "linear_attn_config",
)
_LINEAR_REQUIRED = ("num_heads", "head_dim")


# Scalar fields and their lower bounds (the checks of `KimiLinearConfig._check_types`).
_INT_FIELDS = {
    **dict.fromkeys(
        (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "model_max_length",
            "linear_num_heads",
            "linear_head_dim",
            "short_conv_kernel_size",
            "num_attention_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "v_head_dim",
            "num_experts_per_token",
            "moe_intermediate_size",
            "moe_layer_freq",
            "num_expert_group",
            "topk_group",
        ),
        1,
    ),
    **dict.fromkeys(
        ("qk_rope_head_dim", "num_experts", "num_shared_experts", "first_k_dense_replace"), 0
    ),
}
_FLOAT_FIELDS = ("rms_norm_eps", "kv_a_layernorm_eps", "routed_scaling_factor")
_BOOL_FIELDS = (
    "tie_word_embeddings",
    "mla_use_nope",
    "use_grouped_topk",
    "moe_renormalize",
    "moe_weights_include_bias",
)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class KimiLinearConfig:
    vocab_size: int = 163840
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 27
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 163584
    eos_token_id: int | tuple[int, ...] | None = 163586
    pad_token_id: int | None = 163839
    model_max_length: int = 1048576
    # KDA (linear attention); layer lists are 1-based as in the release.
    kda_layers: tuple[int, ...] = (
        1,
        2,
        3,
        5,
        6,
        7,
        9,
        10,
        11,
        13,
        14,
        15,
        17,
        18,
        19,
        21,
        22,
        23,
        25,
        26,
    )
    full_attn_layers: tuple[int, ...] = (4, 8, 12, 16, 20, 24, 27)
    linear_num_heads: int = 32
    linear_head_dim: int = 128
    short_conv_kernel_size: int = 4
    # MLA
    num_attention_heads: int = 32
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    kv_a_layernorm_eps: float = 1e-6
    # FFN / MoE
    num_experts: int = 256
    num_experts_per_token: int = 8
    num_shared_experts: int = 1
    moe_intermediate_size: int = 1024
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    moe_router_activation_func: str = "sigmoid"
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    moe_renormalize: bool = True
    routed_scaling_factor: float = 2.446
    # The released modeling code folds the correction bias into the expert weights; transformers
    # (the parity target) does not. False follows transformers.
    moe_weights_include_bias: bool = False
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        self._validate()

    # ---- derived ---------------------------------------------------------------------------
    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """'kda' or 'mla' for each 0-based layer."""
        kda = set(self.kda_layers)
        return tuple("kda" if i + 1 in kda else "mla" for i in range(self.num_hidden_layers))

    @property
    def ffn_kinds(self) -> tuple[str, ...]:
        """'dense' or 'moe' for each 0-based layer (DeepSeek's rule)."""
        return tuple(
            "moe"
            if self.num_experts > 0
            and i >= self.first_k_dense_replace
            and i % max(self.moe_layer_freq, 1) == 0
            else "dense"
            for i in range(self.num_hidden_layers)
        )

    @property
    def kda_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == "kda")

    @property
    def mla_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == "mla")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached MLA row: latent c (L) then the shared k_pe (R)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kda_dim(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    # ---- validation ------------------------------------------------------------------------
    def _validate(self) -> None:
        self._check_types()
        n = self.num_hidden_layers
        both = set(self.kda_layers) & set(self.full_attn_layers)
        if both:
            raise ValueError(f"linear_attn_config: layers {sorted(both)} are both KDA and MLA")
        covered = set(self.kda_layers) | set(self.full_attn_layers)
        if covered != set(range(1, n + 1)):
            missing = sorted(set(range(1, n + 1)) - covered)
            extra = sorted(covered - set(range(1, n + 1)))
            raise ValueError(
                "linear_attn_config: kda_layers + full_attn_layers (1-based) must cover layers "
                f"1..{n} exactly; missing {missing}, out of range {extra}"
            )
        if self.num_experts > 0:
            if self.num_experts % self.num_expert_group:
                raise ValueError(
                    f"num_experts ({self.num_experts}) must be a multiple of num_expert_group "
                    f"({self.num_expert_group})"
                )
            if self.num_experts_per_token > self.num_experts:
                raise ValueError(
                    f"num_experts_per_token ({self.num_experts_per_token}) > num_experts "
                    f"({self.num_experts})"
                )
            if not 1 <= self.topk_group <= self.num_expert_group:
                raise ValueError(
                    f"topk_group ({self.topk_group}) must be in [1, num_expert_group "
                    f"({self.num_expert_group})]"
                )
        if self.moe_router_activation_func != "sigmoid":
            raise ValueError(
                "moe_router_activation_func: only 'sigmoid' is supported, got "
                f"{self.moe_router_activation_func!r}"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act: only 'silu' is supported, got {self.hidden_act!r}")

    def _check_types(self) -> None:
        """Each scalar field has its type and range, or a ValueError names it: a config.json
        with "hidden_size": "64" must not reach JAX, nor vocab_size -5 the loader."""
        for name, low in _INT_FIELDS.items():
            value = getattr(self, name)
            if not _is_int(value) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r:.60}")
        for name in ("bos_token_id", "pad_token_id", "q_lora_rank"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise ValueError(f"{name} must be a non-negative integer or null, got {value!r}")
        eos = self.eos_token_id
        eos_ok = (
            eos is None or _is_int(eos) or (isinstance(eos, tuple) and all(_is_int(e) for e in eos))
        )
        if not eos_ok:
            raise ValueError(f"eos_token_id must be an integer or a list of them, got {eos!r:.60}")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            if not ok or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r:.60}")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r:.60}")

    # ---- HF config.json --------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> KimiLinearConfig:
        """Build from an HF config dict. Unknown fields are ignored."""
        model_type = hf.get("model_type")
        if model_type != "kimi_linear":
            raise ValueError(f"model_type: expected 'kimi_linear', got {model_type!r}")
        for name in _REQUIRED:
            if name not in hf:
                raise ValueError(f"config.json is missing required field {name!r}")
        lin = hf["linear_attn_config"] or {}
        for name in _LINEAR_REQUIRED:
            if name not in lin:
                raise ValueError(
                    f"config.json is missing required field 'linear_attn_config.{name}'"
                )
        kda, full = _layer_lists(hf, lin)
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in hf.items() if k in known}
        kw.update(
            kda_layers=kda,
            full_attn_layers=full,
            linear_num_heads=int(lin["num_heads"]),
            linear_head_dim=int(lin["head_dim"]),
            short_conv_kernel_size=int(lin.get("short_conv_kernel_size", 4)),
        )
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = tuple(kw["eos_token_id"])
        # transformers spells some fields differently (attribute_map); accept both.
        for alias, name in _ALIASES.items():
            if alias in hf and name not in hf:
                kw[name] = hf[alias]
        if kw.get("v_head_dim") is None:
            kw["v_head_dim"] = hf["qk_nope_head_dim"]
        if kw.get("topk_group") is None:
            kw["topk_group"] = 1
        return cls(**kw)

    def to_hf_config(self) -> dict[str, Any]:
        """The HF config dict (release field names); from_hf_config(to_hf_config(c)) == c."""
        out: dict[str, Any] = {
            "architectures": ["KimiLinearForCausalLM"],
            "model_type": "kimi_linear",
        }
        skip = {
            "kda_layers",
            "full_attn_layers",
            "linear_num_heads",
            "linear_head_dim",
            "short_conv_kernel_size",
        }
        for f in dataclasses.fields(self):
            if f.name in skip:
                continue
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        out["linear_attn_config"] = {
            "kda_layers": list(self.kda_layers),
            "full_attn_layers": list(self.full_attn_layers),
            "num_heads": self.linear_num_heads,
            "head_dim": self.linear_head_dim,
            "short_conv_kernel_size": self.short_conv_kernel_size,
        }
        # transformers reads these names too; keeping them makes its loader agree with us.
        out["num_key_value_heads"] = self.num_attention_heads
        out["num_experts_per_tok"] = self.num_experts_per_token
        out["n_group"] = self.num_expert_group
        return out

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> KimiLinearConfig:
        try:
            with open(path) as f:
                hf = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(hf, dict):
            raise ValueError(f"{path}: expected a JSON object")
        return cls.from_hf_config(hf)


_ALIASES = {
    "num_experts_per_tok": "num_experts_per_token",
    "n_group": "num_expert_group",
    "n_shared_experts": "num_shared_experts",
    "norm_topk_prob": "moe_renormalize",
    "num_local_experts": "num_experts",
    "max_position_embeddings": "model_max_length",
}


def _layer_lists(hf: dict[str, Any], lin: dict[str, Any]) -> tuple[tuple[int, ...], ...]:
    """KDA and MLA layer lists (1-based), from `layer_types` when present, else the lists."""
    n = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if types:
        if len(types) != n:
            raise ValueError(f"layer_types has {len(types)} entries, num_hidden_layers is {n}")
        kda = tuple(i + 1 for i, t in enumerate(types) if t == "linear_attention")
        full = tuple(i + 1 for i, t in enumerate(types) if t == "full_attention")
        return kda, full
    for name in ("kda_layers", "full_attn_layers"):
        if name not in lin:
            raise ValueError(f"config.json is missing required field 'linear_attn_config.{name}'")
    return tuple(int(i) for i in lin["kda_layers"]), tuple(int(i) for i in lin["full_attn_layers"])
