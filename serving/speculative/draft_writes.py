"""The draft model's cache writes after a verify (`DraftModelDrafter`): the commit of its
window's per-step KDA states, the window passes that write a lag, a lookup row's accepted
tokens or a tree path's tail, and a resting row's track-point snapshot. Each takes the cache
and returns it (donated); rows outside a write become padding rows, so nothing of theirs is
written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kimi_linear_jax.cache import Batch, KDAState
from kimi_linear_jax.layers.block import state_rows
from kimi_linear_jax.model import commit_kda, merge
from serving.speculative.draft_tree import held_on_chain, window_tail
from serving.speculative.verify import track_rows, write_track


def _commit(cache, per_step, slots, n, track, after):
    """Commit step n[b] - 1 of the window into each row's slot and, with `track` = (track
    slots, track steps [B], -1: none), the state after the track step into the track slot,
    as the target's verify does for the prefix cache (rows whose step is not below n write
    nothing there)."""
    if track is None:
        return commit_kda(cache, per_step, slots, n, after=after)
    track_slots, track_steps = track
    snaps = track_rows(per_step, track_steps, n)
    cache = commit_kda(cache, per_step, slots, n, after=(after, snaps))
    return write_track(cache, snaps, track_slots, track_steps, n)


def _only(rows, track):
    """`track` for the rows `rows` alone (the others: no track step)."""
    return None if track is None else (track[0], jnp.where(rows, track[1], -1))


def _batch_of(rows, batch: Batch, start, lengths) -> Batch:
    """A batch of the rows `rows` from `start`, `lengths` long; the others become padding
    rows (slot and pages null, length 0), so nothing of theirs is written."""
    pad = jnp.zeros_like(batch.slots)
    slots, start, lengths = (jnp.where(rows, a, pad) for a in (batch.slots, start, lengths))
    return Batch(slots, jnp.where(rows[:, None], batch.block_table, 0), start, lengths)


@functools.partial(jax.jit, donate_argnames=("cache",))
def commit_window(cache, per_step, slots, commit_lens, model_rows, track=None):
    # Lookup rows ran no step in the window: n = 0 keeps their slot as it was.
    n = jnp.where(model_rows, commit_lens, 0)
    return _commit(cache, per_step, slots, n, _only(model_rows, track), after=None)


def _pass(graphdef, params, ids, cache, batch: Batch, track=None):
    # A window pass and its commit, as in the target's verify: on the built-in draft it took
    # 1.1 ms where a prefill with prefix took 1.3-1.7 ms (separate runs). (logits, cache)
    logits, cache, per_step = merge(graphdef, params).verify(ids, cache, batch)
    return logits, _commit(cache, per_step, batch.slots, batch.lengths, track, after=logits)


def _write(graphdef, params, ids, cache, batch: Batch, track=None):
    return _pass(graphdef, params, ids, cache, batch, track)[1]


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def write_lag(graphdef, params, ids, cache, batch: Batch):
    """A lag's window pass, and whether the draft's greedy token at each position but the
    last was the token that followed ([B, W - 1], False past a row's lag): the shadow drafts
    of the steps the row rested in, scored for the price of an argmax."""
    logits, cache = _pass(graphdef, params, ids, cache, batch)
    hits = jnp.argmax(logits[:, :-1], axis=-1) == ids[:, 1:]
    return cache, hits & (jnp.arange(ids.shape[1] - 1) < batch.lengths[:, None] - 1)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def catch_up(graphdef, params, window, cache, batch: Batch, rows, commit_lens, track=None):
    """Write the accepted tokens `window[b, :commit_lens[b]]` of the rows `rows`."""
    lookup = _batch_of(rows, batch, batch.start, commit_lens)
    return _write(graphdef, params, window, cache, lookup, _only(rows, track))


@functools.partial(jax.jit, static_argnames=("graphdef", "width"), donate_argnames=("cache",))
def tree_rollback(
    graphdef,
    params,
    cache,
    per_step,
    chain,
    window,
    batch: Batch,
    model_rows,
    drafted,
    commit_lens,
    track=None,
    *,
    width,
):
    """After a tree verify: model rows commit the step that ends the chain part of their
    accepted path (lookup rows ran none: 0 keeps the slot), then the drafted rows write the
    rest of it (`width` tokens at most; 0: none can have any) in one window pass from there,
    with each part's track snapshot (a track step inside the tail is shifted into it)."""
    held = jnp.where(model_rows, held_on_chain(window, chain, commit_lens), 0)
    if per_step is not None:
        cache = _commit(cache, per_step, batch.slots, held, _only(model_rows, track), None)
    if not width:
        return cache
    ids, rest = window_tail(window, held, commit_lens, width)
    rows = drafted & (rest > 0)
    tail = _batch_of(rows, batch, batch.start + held, rest)
    shifted = None if track is None else (track[0], jnp.where(rows, track[1] - held, -1))
    return _write(graphdef, params, ids, cache, tail, shifted)


@functools.partial(jax.jit, donate_argnames=("cache",))
def track_resting(cache, slots, rows, commit_lens, track):
    """Resting rows drafted nothing, so their track step can only be 0, the state after
    `last`, and their slot holds it: the runner flushed their lag, `last` included, before
    the verify (`_flush_lags`). It goes to the track slot as a one-step window."""
    one_step = tuple(
        KDAState(*(a[:, None] for a in state_rows(state, slots))) for state in cache.kda
    )
    track_slots, track_steps = _only(rows, track)
    snaps = track_rows(one_step, track_steps, commit_lens)
    return write_track(cache, snaps, track_slots, track_steps, commit_lens)
