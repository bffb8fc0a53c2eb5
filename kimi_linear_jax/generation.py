"""A plain greedy generation loop over the cached entries (one sequence batch, contiguous
cache). The serving engine supersedes it for real workloads; it stays as the simple reference
that the engine's outputs are checked against."""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi_linear_jax.cache import contiguous_batch
from kimi_linear_jax.model import KimiLinearForCausalLM, decode_step, prefill_step
from kimi_linear_jax.parallel.rules import init_cache


def greedy_generate(
    model: KimiLinearForCausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos_token_ids: Sequence[int] = (),
    page_size: int = 64,
) -> list[list[int]]:
    """Greedy continuations of a batch of token-id prompts (each stops at an eos id).

    A model built for a mesh (`model.par`) runs sharded; under DCP every sequence's MLA latent
    cache is spread over the DCP group (token p on rank p % dcp) and `page_size` is the
    per-device page.
    """
    cfg = model.config
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts: every prompt needs at least one token")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    bad = [t for p in prompts for t in p if not 0 <= int(t) < cfg.vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
    B, longest = len(prompts), max(len(p) for p in prompts)
    total = longest + max_new_tokens
    if total > cfg.model_max_length:
        raise ValueError(
            f"prompt ({longest}) + max_new_tokens ({max_new_tokens}) exceeds the context limit "
            f"{cfg.model_max_length}"
        )
    graphdef, params = nnx.split(model)
    # Pages are virtual under DCP: page_size * dcp tokens, 1/dcp of them on each device.
    page_size *= model.par.dcp
    n_pages = -(-total // page_size)
    cache = init_cache(
        cfg,
        model.par,
        num_slots=B + 1,
        num_pages=B * n_pages,
        page_size=page_size,
        dtype=model.dtype,
    )
    ids = np.zeros((B, longest), np.int32)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    batch = contiguous_batch(B, total, page_size, lengths=lengths)
    logits, cache = prefill_step(graphdef, params, jnp.asarray(ids), cache, batch)
    out: list[list[int]] = [[] for _ in range(B)]
    done = np.zeros(B, bool)
    eos = set(int(e) for e in eos_token_ids)
    start = lengths.copy()
    for _ in range(max_new_tokens):
        nxt = np.asarray(jnp.argmax(logits.reshape(B, -1), axis=-1), np.int32)
        for b in range(B):
            if not done[b]:
                out[b].append(int(nxt[b]))
                done[b] = int(nxt[b]) in eos or len(out[b]) >= max_new_tokens
        if done.all():
            break
        batch = batch._replace(
            start=jnp.asarray(start), lengths=jnp.asarray(np.where(done, 0, 1).astype(np.int32))
        )
        logits, cache = decode_step(graphdef, params, jnp.asarray(nxt[:, None]), cache, batch)
        start = start + np.where(done, 0, 1).astype(np.int32)
    return out
