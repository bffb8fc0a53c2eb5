"""Test helpers: tiny random checkpoints in the real HF layout (nothing is downloaded)."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_linear_jax.checkpoint import save_pretrained
from kimi_linear_jax.config import KimiLinearConfig, preset
from kimi_linear_jax.model import KimiLinearForCausalLM


def random_model(config: KimiLinearConfig, *, seed: int = 0, dtype=jnp.float32):
    """A model whose every parameter is random: norm weights near 1 and a non-zero router
    bias too, so that a mix-up of any two tensors changes the logits."""
    model = KimiLinearForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(seed))
    key = jax.random.key(seed + 1)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = path[-2] if path[-1] == "weight" else path[-1]
        key, sub = jax.random.split(key)
        noise = jax.random.normal(sub, var.shape, jnp.float32)
        if "norm" in str(name):
            var.set_value((1.0 + 0.1 * noise).astype(var.dtype))
        elif name == "e_score_correction_bias":
            var.set_value((0.05 * noise).astype(var.dtype))
    return model


def make_tiny_checkpoint(path: str | os.PathLike, seed: int = 0, **config_overrides):
    """Write a random `tiny` checkpoint (config.json + model.safetensors) to `path`; returns
    its config."""
    config = dataclasses.replace(preset("tiny"), **config_overrides)
    save_pretrained(random_model(config, seed=seed), path)
    return config
