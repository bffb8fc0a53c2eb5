"""The verify step: the target runs over each row's window `[last, d_1 .. d_n]` (chain layout),
decides on device how many drafts it accepts, and commits the recurrent state at step
`commit_lens - 1` of the window, all inside one jitted function (no host round trip).

Acceptance:
- greedy rows: the longest prefix of drafts equal to the target's argmax, plus the target's
  token after it (the bonus or the correction);
- sampled rows: each window position j draws the token the plain sampler would draw there,
  `sample` with the row's key for that output index (`row_keys(seed, step + j)`), and the
  drafts are accepted while they equal those draws. Every drafter here proposes
  deterministically (a one-hot draft distribution), for which this is rejection sampling
  exactly: draft d at j is accepted with probability p_j(d), the first rejection emits a draw
  from p_j without d, renormalised, and the bonus one from p_n; so the output has the target
  distribution. Being the plain sampler's own draws, it is also the same text a seed gives
  without speculation, alone or batched, whatever the drafts (up to the window's logits
  matching the single steps' in float).

`commit_lens = accepted + 1`. Order (also under DCP, where the logits are replicated so every
rank takes the same decision): accept, then the KDA state and conv windows commit, then (on the
host) the KV tail release.

The commit replays by default: the window pass keeps each step's inputs to the recurrence
(k, v, g, beta and the pre-conv projections: O(T*H*K) per row) and, once `commit_lens` is
known, a scan re-runs the first `commit_lens` steps from the slot's state. The gather commit
(keep every step's state, O(T*H*K*V), and pick one) is its reference, `commit="gather"`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kimi_linear_jax.cache import KDAState, ModelCache
from kimi_linear_jax.layers.block import scatter_rows, state_rows
from kimi_linear_jax.layers.kda import commit, replay
from kimi_linear_jax.model import commit_kda, merge
from serving.core.sampling import (
    SamplingBatch,
    apply_bias,
    apply_penalties,
    no_logprobs,
    token_logprobs,
    truncation_mask,
)
from serving.core.sampling import sample as sample_tokens

# The verify's KDA commit -> what the window pass keeps for it (`layers.kda.decode`).
COMMITS = {"replay": "inputs", "gather": "states"}


def target_probs(logits: jax.Array, batch: SamplingBatch) -> jax.Array:
    """[N, V] the distribution `sample` draws from (temperature then truncation), vocab order."""
    greedy = batch.temperature <= 0.0
    scaled = logits / jnp.where(greedy, 1.0, batch.temperature)[:, None]
    keep, order = truncation_mask(scaled, batch)
    ranked = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(jnp.where(keep, ranked, -jnp.inf), axis=-1)
    return jnp.take_along_axis(probs, jnp.argsort(order, axis=-1), axis=-1)


def per_position(batch: SamplingBatch, offsets: jax.Array) -> SamplingBatch:
    """Row parameters repeated for each of a window's T positions, the PRNG step advanced by
    offsets [B, T] (a chain: the position; a tree: the node's depth), flattened to B * T."""
    t = offsets.shape[1]
    rep = jax.tree.map(lambda a: jnp.repeat(a, t, axis=0), batch)
    return rep._replace(step=rep.step + offsets.reshape(-1).astype(rep.step.dtype))


def _leading_true(ok: jax.Array) -> jax.Array:
    """Length of the all-True prefix of each row of ok [B, n]."""
    return jnp.cumprod(ok.astype(jnp.int32), axis=-1).sum(-1)


def accept(
    logits: jax.Array, drafts: jax.Array, num_drafts: jax.Array, batch: SamplingBatch, *, sample
) -> tuple[jax.Array, jax.Array]:
    """(tokens [B, T], accepted [B]) for logits [B, T, V] over windows with drafts [B, T - 1]
    (row b uses its first num_drafts[b]). tokens[b, :accepted[b] + 1] is what the row emits."""
    b, t, v = logits.shape
    target = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    valid = jnp.arange(t - 1)[None, :] < num_drafts[:, None]
    greedy_accepted = _leading_true((drafts == target[:, :-1]) & valid)
    if not sample:
        return target, greedy_accepted
    flat = per_position(batch, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)))
    drawn, _, _ = sample_tokens(logits.reshape(b * t, v), flat, num_top_logprobs=1)
    drawn = drawn.reshape(b, t)
    accepted = _leading_true((drafts == drawn[:, :-1]) & valid)
    greedy = (batch.temperature <= 0.0)[:, None]
    return jnp.where(greedy, target, drawn), jnp.where(greedy[:, 0], greedy_accepted, accepted)


def track_rows(per_step, track_steps, commit_lens) -> tuple[KDAState, ...]:
    """Per KDA layer, the state after step track_steps[b] (what a track point snapshots).
    Rows whose step was not accepted get a placeholder that `write_track` drops."""
    valid = (track_steps >= 0) & (track_steps < commit_lens)
    # Only accepted track steps are written, so the pool itself is never read here: reading
    # it would cost a copy of the whole pool.
    return tuple(
        commit(KDAState(*(s[:, 0] for s in steps)), steps, jnp.where(valid, track_steps + 1, 0))
        for steps in per_step
    )


def _replay_tracked(cache: ModelCache, inputs, slots, commit_lens, track_steps, after):
    """The replay commit of every KDA layer, and from the same pass the track rows (the state
    after step track_steps[b]; placeholders where that step was not accepted)."""
    valid = (track_steps >= 0) & (track_steps < commit_lens)
    snapshot_n = jnp.where(valid, track_steps + 1, 0)
    kda, snaps = [], []
    for state, x in zip(cache.kda, inputs, strict=True):
        new, snap = replay(state_rows(state, slots), x, commit_lens, snapshot_n)
        kda.append(scatter_rows(state, slots, new, after=(after, snap)))
        snaps.append(snap)
    return ModelCache(tuple(kda), cache.mla), tuple(snaps)


def write_track(cache: ModelCache, rows, track_slots, track_steps, commit_lens) -> ModelCache:
    """Write the track rows to slot track_slots[b] when that step was accepted
    (0 <= ith < commit_lens); other rows write nothing. After every write of the commit (the
    conv windows' writes read the committed S pool; see `scatter_rows`), so that these writes
    need no copy of a pool either."""
    valid = (track_steps >= 0) & (track_steps < commit_lens)
    kda = []
    for state, picked in zip(cache.kda, rows, strict=True):
        dst = jnp.where(valid, track_slots, state.S.shape[0])  # out of range: dropped
        kda.append(scatter_rows(state, dst, picked, after=state[:3], mode="drop"))
    return ModelCache(tuple(kda), cache.mla)


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "mode", "commit_recurrent", "track", "commit"),
    donate_argnames=("cache",),
)
def verify_step(
    graphdef,
    params,
    last,
    drafts,
    num_drafts,
    cache,
    batch,
    sampling,
    counts,
    prompt_mask,
    track_slots,
    track_steps,
    *,
    mode,
    commit_recurrent=True,
    track=True,
    commit="replay",
):
    """One verify over rows [B] (padding rows: batch.lengths 0). Returns ((tokens [B, T],
    commit_lens [B], logprob [B, T], top ids [B, T, N], top values [B, T, N]), cache); the
    logprob outputs are zeros in greedy mode. `track` (static) compiles the track-point
    snapshot in; without it the track arrays are ignored (a step with no row tracking skips the
    extra gather and scatter of every KDA array). `commit` (static): "replay" re-runs the
    accepted steps from the window's inputs, "gather" picks from every step's state (the
    reference; T times the memory)."""
    if commit not in COMMITS:
        raise ValueError(f"commit must be one of {tuple(COMMITS)}, got {commit!r}")
    if drafts.ndim != 2 or drafts.shape[0] != last.shape[0]:
        raise ValueError(f"chain layout needs drafts [B, k], got {drafts.shape}")
    if drafts.shape[1] == 0:
        commit = "gather"  # a one-token window keeps one state either way: no second pass
    model = merge(graphdef, params)
    ids = jnp.concatenate([last[:, None], drafts], axis=1)
    live = batch.lengths > 0
    batch = batch._replace(lengths=jnp.where(live, num_drafts + 1, 0))
    logits, cache, per_step = model.verify(ids, cache, batch, keep=COMMITS[commit])
    logits = logits.astype(jnp.float32)
    if mode == "penalized":  # penalised rows get no drafts: only position 0 matters
        logits = logits.at[:, 0].set(apply_penalties(logits[:, 0], counts, prompt_mask, sampling))
    if mode != "greedy":  # logit_bias is the same at every position of the window
        logits = jax.vmap(apply_bias, in_axes=(1, None), out_axes=1)(logits, sampling)
    tokens, accepted = accept(logits, drafts, num_drafts, sampling, sample=mode != "greedy")
    commit_lens = jnp.where(live, accepted + 1, 0)
    if commit_recurrent and track and commit == "replay":
        slots = batch.slots
        cache, rows = _replay_tracked(cache, per_step, slots, commit_lens, track_steps, logits)
        cache = write_track(cache, rows, track_slots, track_steps, commit_lens)
    elif commit_recurrent:
        # The track rows are computed before the commit overwrites the pools they come from
        # (XLA may recompute them from the pools' rows), and the commit waits for them.
        rows = track_rows(per_step, track_steps, commit_lens) if track else ()
        cache = commit_kda(cache, per_step, batch.slots, commit_lens, after=(logits, rows))
        if track:
            cache = write_track(cache, rows, track_slots, track_steps, commit_lens)
    if mode == "greedy":
        return (tokens, commit_lens, *no_logprobs(tokens)), cache
    return (tokens, commit_lens, *token_logprobs(logits, tokens)), cache
