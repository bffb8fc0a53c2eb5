"""Kimi Linear (KDA + MLA + MoE) on JAX."""

from kimi_linear_jax import heap

# Before JAX's first computation, or it has no effect (see heap.py: page faults on CPU).
heap.apply_default()

from kimi_linear_jax.config import KimiLinearConfig  # noqa: E402 (after the heap setup)
from kimi_linear_jax.model import KimiLinearForCausalLM  # noqa: E402

__all__ = ["KimiLinearConfig", "KimiLinearForCausalLM", "load_pretrained", "save_pretrained"]


def __getattr__(name):
    # Lazy: checkpoint I/O pulls in safetensors and orbax, which the model itself does not need.
    if name in ("load_pretrained", "save_pretrained"):
        from kimi_linear_jax import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(name)
