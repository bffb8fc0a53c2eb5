"""Test helpers: tiny random checkpoints in the real HF layout (nothing is downloaded)."""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi_linear_jax.checkpoint import save_pretrained
from kimi_linear_jax.config import KimiLinearConfig
from kimi_linear_jax.model import init_model
from kimi_linear_jax.presets import preset


def random_model(config: KimiLinearConfig, *, seed: int = 0, dtype=jnp.float32):
    """A model whose every parameter is random: norm weights near 1 and a non-zero router
    bias too, so that a mix-up of any two tensors changes the logits."""
    model = init_model(config, seed=seed, dtype=dtype)
    rng = np.random.default_rng(seed + 1)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = str(path[-2] if path[-1] == "weight" else path[-1])
        # Host-side numpy draws: no per-shape compilation.
        noise = rng.standard_normal(var.shape, np.float32)
        if "norm" in name:
            var.set_value(jnp.asarray(1.0 + 0.1 * noise, var.dtype))
        elif name == "e_score_correction_bias":
            var.set_value(jnp.asarray(0.05 * noise, var.dtype))
    return model


def make_tiny_checkpoint(path: str | os.PathLike, seed: int = 0, **config_overrides):
    """Write a random `tiny` checkpoint (config.json + model.safetensors) to `path`; returns
    its config."""
    config = dataclasses.replace(preset("tiny"), **config_overrides)
    save_pretrained(random_model(config, seed=seed), path)
    return config
