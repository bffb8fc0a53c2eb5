"""The jitted multi-step decode, shared by the runner (the target model, any sampling mode) and
the draft model (greedy, keeping the state after each step for its rollback). The draftless
run of speculation, which decodes until a suffix recurs, is `speculative/draftless.py`.

Each step feeds back the token it picked. Tokens are picked on device in one of three static
modes (`MODES`), so each mode compiles once per bucket: "greedy" is a bare argmax; "sample"
runs `sampling.sample` (any temperature, truncation, logprobs); "penalized" also applies the
repetition / presence / frequency penalties first. Both add each row's logit_bias before the
draw; a biased row is never in greedy mode (`step_result.sample_mode`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kimi_linear_jax.model import commit_kda, merge
from serving.core.sampling import apply_bias, apply_penalties, no_logprobs, sample

MODES = ("greedy", "sample", "penalized")


def pick(logits, sampling, counts, prompt_mask, mode, top_k=1):
    """(tokens [B], logprob [B], top ids [B, N], top values [B, N]) from logits [B, V].
    Greedy mode reads neither `sampling` nor the penalty inputs (they may be None); its top
    ids are the `top_k` best tokens, the picked one first (a draft model's tree siblings),
    its logprob outputs zeros."""
    logits = logits.astype(jnp.float32)
    if mode == "greedy":
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        if top_k == 1:
            return tokens, *no_logprobs(tokens)
        return tokens, *_greedy_top(logits, tokens, top_k)
    if top_k != 1:
        raise ValueError(f"top_k is for greedy mode, got mode {mode!r}")
    if mode == "penalized":
        logits = apply_penalties(logits, counts, prompt_mask, sampling)
    logits = apply_bias(logits, sampling)
    tokens, chosen, (top_ids, top_values) = sample(logits, sampling)
    return tokens, chosen, top_ids, top_values


def _greedy_top(logits, tokens, top_k: int):
    """`no_logprobs` with the top ids widened to the `top_k` best tokens, `tokens` first: the
    others are the best of the logits without it, so all are distinct even on ties."""
    rows = jnp.arange(logits.shape[0])
    _, others = jax.lax.top_k(logits.at[rows, tokens].set(-jnp.inf), top_k - 1)
    top_ids = jnp.concatenate([tokens[:, None], others.astype(jnp.int32)], axis=-1)
    zero = jnp.zeros(tokens.shape, jnp.float32)
    return zero, top_ids, jnp.zeros(top_ids.shape, jnp.float32)


pick_jit = jax.jit(pick, static_argnames=("mode", "top_k"))


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "num_steps", "mode", "keep_states", "top_k"),
    donate_argnames=("cache",),
)
def decode_steps(
    graphdef,
    params,
    ids,
    cache,
    batch,
    steps_left,
    sampling=None,
    counts=None,
    prompt_mask=None,
    *,
    num_steps,
    mode="greedy",
    keep_states=False,
    top_k=1,
):
    """`num_steps` decode steps from ids [B], each feeding back the token it picked.

    Row b runs its first `steps_left[b]` steps; later ones have length 0, which writes no KV
    and commits no KDA state, so a row may stop early. The sampling step (the PRNG stream
    position) and the penalty counts advance per step exactly as in single steps, so fused
    and unfused decoding draw the same tokens.

    Returns (picked, states, cache): picked is `pick`'s four arrays with a step axis
    ([B, S, ...]); states, with `keep_states`, the KDA states after every step per layer
    ([B, S, ...], what `commit_kda` picks from to roll back), else None. `top_k` (greedy
    mode): the top ids are each step's `top_k` best tokens (`pick`), else the picked one.
    """
    model = merge(graphdef, params)
    rows = jnp.arange(ids.shape[0])

    def step(carry, i):
        token, cache, counts = carry
        active = (i < steps_left).astype(jnp.int32)
        b = batch._replace(start=batch.start + i, lengths=batch.lengths * active)
        if keep_states:
            logits, cache, states = model.verify(token[:, None], cache, b)
            cache = commit_kda(cache, states, b.slots, b.lengths, after=logits)
        else:
            (logits, cache), states = model.decode(token[:, None], cache, b), None
        at_i = None if mode == "greedy" else sampling._replace(step=sampling.step + i)
        picked = pick(logits[:, 0], at_i, counts, prompt_mask, mode, top_k)
        counts = counts.at[rows, picked[0]].add(active) if mode == "penalized" else counts
        return (picked[0], cache, counts), (picked, states)

    if num_steps == 1:
        # One step without the loop: a scan's carry makes XLA copy every KDA slot pool.
        (_, cache, _), (picked, states) = step((ids, cache, counts), jnp.int32(0))
        # The window's per-step states already have a step axis of 1.
        return tuple(x[:, None] for x in picked), states, cache
    (_, cache, _), (picked, states) = jax.lax.scan(
        step, (ids, cache, counts), jnp.arange(num_steps)
    )
    # [S, B, ...] -> [B, S, ...]; each step's states are [B, 1, ...] windows.
    states = jax.tree.map(lambda x: jnp.swapaxes(x[:, :, 0], 0, 1), states)
    return tuple(jnp.swapaxes(x, 0, 1) for x in picked), states, cache
