"""Ordering of in-place cache writes inside a compiled step (issue 13).

A donated pool is updated in place only if XLA can order the update after every read of the
old pool. When no data dependence says so, copy insertion keeps the old pool alive with a copy
of the whole pool, on every step. `after` adds that dependence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def after(x: jax.Array, first) -> jax.Array:
    """`x`, with a data dependence on `first` (an array or a pytree of them, so XLA computes
    `x` after all of them): plus zero times a finite element of each (NaN / inf are replaced
    first, so `x` is unchanged)."""
    leaves = jax.tree.leaves(first)
    if not leaves:
        return x
    zero = sum(jnp.where(jnp.isfinite(e), e, 0) for e in (a.reshape(-1)[0] for a in leaves))
    return x + zero.astype(x.dtype) * 0
