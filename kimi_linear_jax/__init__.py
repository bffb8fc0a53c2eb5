"""Kimi Linear (KDA + MLA + MoE) on JAX."""

from kimi_linear_jax import heap

# Only with KIMI_LINEAR_JAX_MALLOC=keep; before JAX's first computation (see heap.py).
heap.apply_from_env()

from kimi_linear_jax.config import KimiLinearConfig  # noqa: E402 (after the heap setup)
from kimi_linear_jax.model import KimiLinearForCausalLM  # noqa: E402

__all__ = ["KimiLinearConfig", "KimiLinearForCausalLM", "load_pretrained", "save_pretrained"]


def __getattr__(name):
    # Lazy: checkpoint I/O pulls in safetensors and orbax, which the model itself does not need.
    if name in ("load_pretrained", "save_pretrained"):
        from kimi_linear_jax import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(name)
