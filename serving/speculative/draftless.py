"""The draftless run of n-gram speculation: plain decode steps on device from each row's last
token until the n-gram drafter would draft again (`decode_until_recurs`), one call for what
would be one call per token."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kimi_linear_jax.model import merge
from serving.core.decode import pick
from serving.speculative.ngram import suffix_recurs


@functools.partial(
    jax.jit, static_argnames=("graphdef", "num_steps", "min_n", "mode"), donate_argnames=("cache",)
)
def decode_until_recurs(
    graphdef,
    params,
    seq,
    length,
    cache,
    batch,
    steps_left,
    sampling=None,
    *,
    num_steps,
    min_n,
    mode="greedy",
):
    """Plain decode steps from each row's last token `seq[b, length[b] - 1]` until the n-gram
    drafter would draft: the loop ends after the step whose token makes some row's last
    `min_n` tokens recur in its tokens (`ngram.suffix_recurs`), or once every row has run its
    `steps_left[b]` steps (at most `num_steps`). Synchronously each of those steps is its own
    call that proposes nothing, so the tokens, and where the next verify window starts, are
    the same.

    seq [B, C] holds each row's tokens (C >= length + steps_left); greedy or sample mode (the
    PRNG stream advances per step as in single steps). Returns (picked, steps run, cache):
    picked is `pick`'s arrays with a step axis [B, num_steps, ...]; row b's tokens are its
    first min(steps run, steps_left[b]).
    """
    model = merge(graphdef, params)
    rows = jnp.arange(seq.shape[0])

    def step(i, token, cache, seq, length):
        active = i < steps_left
        b = batch._replace(start=batch.start + i, lengths=batch.lengths * active.astype(jnp.int32))
        logits, cache = model.decode(token[:, None], cache, b)
        at_i = None if mode == "greedy" else sampling._replace(step=sampling.step + i)
        picked = pick(logits[:, 0], at_i, None, None, mode)
        seq = seq.at[rows, length].set(jnp.where(active, picked[0], seq[rows, length]))
        length = length + active.astype(length.dtype)
        recurs = jnp.any(active & suffix_recurs(seq, length, min_n))
        return picked, cache, seq, length, recurs

    # Every step runs in the loop: the model is traced into the program once, which halves
    # its size and compile time (a first step outside the loop, to give `out` its shapes,
    # doubled them); `out` takes the picked arrays' shapes from an abstract step instead.
    token = jnp.take_along_axis(seq, (length - 1)[:, None], axis=1)[:, 0]
    picked = jax.eval_shape(lambda: step(jnp.int32(0), token, cache, seq, length)[0])
    out = tuple(jnp.zeros((x.shape[0], num_steps, *x.shape[1:]), x.dtype) for x in picked)

    def more(carry):
        i, _, _, _, _, stop, _ = carry
        return (i < num_steps) & ~stop & jnp.any(i < steps_left)

    def body(carry):
        i, token, cache, seq, length, _, out = carry
        picked, cache, seq, length, stop = step(i, token, cache, seq, length)
        out = tuple(o.at[:, i].set(x) for o, x in zip(out, picked, strict=True))
        return i + 1, picked[0], cache, seq, length, stop, out

    carry = (jnp.int32(0), token, cache, seq, length, jnp.bool_(False), out)
    i, _, cache, _, _, _, out = jax.lax.while_loop(more, body, carry)
    return out, i, cache
