"""StatePool bookkeeping and the slot-wise KDA state moves (untouched slots stay bit-identical)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_linear_jax.cache import KDAState, init_kda_state
from kimi_linear_jax.layers.block import state_rows
from kimi_linear_jax.presets import preset
from serving.core.state_pool import NULL_SLOT, OutOfSlotsError, StatePool, copy_rows, reset_slots

NUM_SLOTS = 6
SENTINEL = -7.25  # exactly representable: untouched slots must come back bit-identical


def test_pool_never_hands_out_null_slot_and_exhausts():
    pool = StatePool(4)
    slots = [pool.acquire(r) for r in "abc"]
    assert sorted(slots) == [1, 2, 3] and NULL_SLOT not in slots
    assert pool.num_free == 0 and pool.slot("b") == slots[1]
    with pytest.raises(OutOfSlotsError, match="'d'"):
        pool.acquire("d")
    with pytest.raises(ValueError, match="already holds"):
        pool.acquire("a")
    pool.release("b")
    assert pool.acquire("d") == slots[1]


def test_pool_double_release_and_unknown_raise_key_error():
    pool = StatePool(3)
    pool.acquire("a")
    pool.release("a")
    with pytest.raises(KeyError, match="'a'"):
        pool.release("a")
    with pytest.raises(KeyError, match="'ghost'"):
        pool.slot("ghost")
    assert pool.num_free == 2


def _states(seed=0):
    """A tuple of KDAState (one per tiny KDA layer), random, every slot distinct."""
    config = preset("tiny")
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    out = []
    for _ in config.kda_layer_ids:
        empty = init_kda_state(config, NUM_SLOTS, jnp.float32)
        out.append(jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape, x.dtype), empty))
    return tuple(out)


def _poisoned(states, targets):
    """Every slot not in `targets` set to the sentinel."""
    mask = np.ones(NUM_SLOTS, bool)
    mask[list(targets)] = False
    return jax.tree.map(lambda x: x.at[np.flatnonzero(mask)].set(SENTINEL), states)


def _assert_untouched(after, before, targets):
    others = [s for s in range(NUM_SLOTS) if s not in targets]
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(a)[others], np.asarray(b)[others])
        assert np.all(np.asarray(a)[others] == SENTINEL)


def test_reset_slots_zeroes_targets_only():
    targets = [2, 4]
    states = _poisoned(_states(), targets)
    out = jax.jit(reset_slots)(states, jnp.array(targets))
    assert isinstance(out[0], KDAState) and len(out) == len(states)
    for leaf in jax.tree.leaves(out):
        assert not np.asarray(leaf)[targets].any()
    _assert_untouched(out, states, targets)


def gather_slot(states, slot):
    """Every layer's state of `slot`, each array with a leading 1 (what saving a preempted
    request's state to host would keep; the engine recomputes instead)."""
    return tuple(state_rows(s, jnp.asarray([slot])) for s in states)


def scatter_slot(states, saved, slot):
    """Write `saved` (from `gather_slot`) into `slot` of every layer."""
    return tuple(
        KDAState(*(a.at[slot].set(jnp.asarray(r[0], a.dtype)) for a, r in zip(s, v, strict=True)))
        for s, v in zip(states, saved, strict=True)
    )


def test_copy_rows_copies_every_layer_and_field():
    src, dst = 1, 3
    states = _poisoned(_states(), [src, dst])
    out = jax.jit(copy_rows)(states, jnp.array([src]), jnp.array([dst]))
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(states), strict=True):
        np.testing.assert_array_equal(np.asarray(a)[dst], np.asarray(b)[src])
        np.testing.assert_array_equal(np.asarray(a)[src], np.asarray(b)[src])
    _assert_untouched(out, states, [src, dst])


def test_gather_then_scatter_restores_into_another_slot():
    src, dst = 5, 2
    states = _poisoned(_states(), [src, dst])
    saved = jax.device_get(jax.jit(gather_slot)(states, src))  # to host, as on preemption
    assert isinstance(saved[0], KDAState)
    for s, x in zip(jax.tree.leaves(saved), jax.tree.leaves(states), strict=True):
        assert s.shape == (1, *x.shape[1:])
        np.testing.assert_array_equal(s[0], np.asarray(x)[src])
    out = jax.jit(scatter_slot)(states, saved, dst)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(states), strict=True):
        np.testing.assert_array_equal(np.asarray(a)[dst], np.asarray(b)[src])
        assert a.dtype == b.dtype
    _assert_untouched(out, states, [src, dst])


def test_scatter_round_trip_of_a_reset_slot():
    slot = 3
    states = _states(1)
    saved = gather_slot(states, slot)
    wiped = reset_slots(states, jnp.array([slot]))
    restored = scatter_slot(wiped, saved, slot)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(states), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
