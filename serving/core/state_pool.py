"""Recurrent-state slots: which request owns which KDA state slot, and slot-wise state moves.

`StatePool` is host bookkeeping. Slot 0 is the null slot: never handed out, because padding
rows of a batch point at it and write garbage there; a real request must never share it.

The helpers below are pure JAX over a tuple of `KDAState` (one per KDA layer). They return new
states and are jittable with traced slot indices, so the runner can fuse them into its steps
(and donate the states). A slot's state is its three conv windows and S, moved together: a
request restored with S but a stale conv window (or another slot's) decodes silently wrong.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kimi_linear_jax.cache import CacheLayout, KDAState
from kimi_linear_jax.layers.block import state_rows

NULL_SLOT = CacheLayout.NULL_SLOT
KDAStates = tuple[KDAState, ...]


class OutOfSlotsError(RuntimeError):
    """No free state slot."""


class StatePool:
    """Hands out slots 1..num_slots-1, one per request."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (slot 0 is the null slot), got {num_slots}")
        self.num_slots = num_slots
        # Reversed so that pop() hands out low slot ids first.
        self._free: list[int] = list(range(num_slots - 1, NULL_SLOT, -1))
        self._owned: dict[Hashable, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, request_id: Hashable) -> int:
        if request_id in self._owned:
            raise ValueError(f"request {request_id!r} already holds slot {self._owned[request_id]}")
        if not self._free:
            raise OutOfSlotsError(
                f"no free state slot for request {request_id!r}: "
                f"all {self.num_slots - 1} are in use"
            )
        slot = self._free.pop()
        self._owned[request_id] = slot
        return slot

    def slot(self, request_id: Hashable) -> int:
        if request_id not in self._owned:
            raise KeyError(f"request {request_id!r} holds no slot (unknown or already released)")
        return self._owned[request_id]

    def release(self, request_id: Hashable) -> None:
        self._free.append(self.slot(request_id))
        del self._owned[request_id]


def reset_slots(kda_states: KDAStates, slots: jax.Array) -> KDAStates:
    """Zero conv windows and S of `slots` [N] in every layer (a fresh request starts at zero)."""
    slots = jnp.asarray(slots, jnp.int32)
    return jax.tree.map(lambda x: x.at[slots].set(0), kda_states)


def copy_rows(kda_states: KDAStates, src: jax.Array, dst: jax.Array) -> KDAStates:
    """Every layer's state of slots src[i] copied into slots dst[i] (prefix-cache restores
    and snapshots, copy on write)."""
    return tuple(
        KDAState(*(a.at[dst].set(r) for a, r in zip(s, state_rows(s, src), strict=True)))
        for s in kda_states
    )


@functools.partial(jax.jit, donate_argnames=("cache",))
def _copy_slots(cache, src, dst):
    """`copy_rows` on a ModelCache, cache donated. Padding pairs copy the null slot onto
    itself."""
    return cache._replace(kda=copy_rows(cache.kda, src, dst))


def copy_slots(cache, pairs: Sequence[tuple[int, int]], width: int):
    """Host pairs padded to a multiple of `width` (a bounded number of compiled shapes)."""
    n = -(-len(pairs) // width) * width
    src = np.zeros(n, np.int32)
    dst = np.zeros(n, np.int32)
    for i, (a, b) in enumerate(pairs):
        src[i], dst[i] = a, b
    return _copy_slots(cache, jnp.asarray(src), jnp.asarray(dst))


@functools.partial(jax.jit, donate_argnames=("cache",))
def reset_cache_slots(cache, slots):
    """`reset_slots` on a ModelCache's KDA states (a fresh request's slot), cache donated."""
    return cache._replace(kda=reset_slots(cache.kda, slots))
