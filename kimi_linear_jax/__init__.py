"""Kimi Linear (KDA + MLA + MoE) on JAX."""

from kimi_linear_jax.config import KimiLinearConfig
from kimi_linear_jax.model import KimiLinearForCausalLM

__all__ = ["KimiLinearConfig", "KimiLinearForCausalLM", "load_pretrained", "save_pretrained"]


def __getattr__(name):
    # Lazy: checkpoint I/O pulls in safetensors and orbax, which the model itself does not need.
    if name in ("load_pretrained", "save_pretrained"):
        from kimi_linear_jax import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(name)
