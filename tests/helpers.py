"""The one numerics comparison helper used across tests, and the abstract GPU that lowering
for CUDA on a CPU-only machine needs."""

from __future__ import annotations

import contextlib

import jax
import numpy as np


def assert_close(actual, expected, *, atol: float, rtol_rms: float, name: str = "") -> None:
    """max |a - e| <= atol and ||a - e|| / ||e|| <= rtol_rms (both reported on failure)."""
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    assert a.shape == e.shape, f"{name}: shape {a.shape} != {e.shape}"
    assert np.all(np.isfinite(a)), f"{name}: non-finite values"
    err = np.abs(a - e)
    max_abs = float(err.max()) if err.size else 0.0
    denom = float(np.linalg.norm(e)) or 1.0
    rel = float(np.linalg.norm(a - e)) / denom
    assert max_abs <= atol and rel <= rtol_rms, (
        f"{name}: max_abs={max_abs:.3e} (atol {atol:.1e}), rel_rms={rel:.3e} (tol {rtol_rms:.1e})"
    )


# jax >= 0.11 lowers a GPU kernel on a CPU-only machine only under an abstract GPU device.
JAX_0_11 = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11)


def abstract_gpu():
    """jax >= 0.11 lowers a GPU kernel on a CPU-only machine only under an abstract GPU device
    ("No supported GPU devices found" otherwise); jax 0.10 lowers without one."""
    if not JAX_0_11:
        return contextlib.nullcontext()
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    h200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    # Auto, not the default Explicit axis: a whole model step traced under the mesh would ask
    # every op for explicit sharding rules (ragged_dot_general has none in jax 0.12).
    mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Auto,), abstract_device=h200)
    return jax.sharding.use_abstract_mesh(mesh)


# A tiny transformers `KimiLinearConfig` (the shapes of our `tiny` preset, vocab 128), shared by
# the parity, checkpoint and config tests.
TF_TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    num_experts=8,
    num_experts_per_token=2,
    num_shared_experts=1,
    first_k_dense_replace=1,
    linear_attn_config={
        "kda_layers": [1, 2, 4],
        "full_attn_layers": [3],
        "num_heads": 2,
        "head_dim": 16,
        "short_conv_kernel_size": 4,
    },
    num_expert_group=2,
    topk_group=1,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
