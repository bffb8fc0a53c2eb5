"""A plain greedy generation loop over the cached entries (one sequence batch, contiguous
cache). The serving engine supersedes it for real workloads; it stays as the simple reference
that the engine's outputs are checked against."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi_linear_jax.cache import ModelCache, contiguous_batch, init_cache
from kimi_linear_jax.model import KimiLinearForCausalLM, decode_step, prefill_step


def greedy_generate(
    model: KimiLinearForCausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos_token_ids: Sequence[int] = (),
    page_size: int = 64,
    dcp_size: int = 1,
) -> list[list[int]]:
    """Greedy continuations of a batch of token-id prompts (each stops at an eos id).

    `dcp_size` > 1 spreads every sequence's MLA latent cache over that many devices (token p
    on device p % dcp_size); `page_size` is then the per-device page.
    """
    cfg = model.config
    mesh = dcp_mesh(dcp_size)
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
    # Pages are virtual under DCP: page_size * dcp_size tokens, 1/dcp_size on each device.
    page_size *= dcp_size
    n_pages = -(-total // page_size)
    cache = init_cache(
        cfg, num_slots=B + 1, num_pages=B * n_pages, page_size=page_size, dtype=model.dtype
    )
    if mesh is not None:
        cache = shard_cache(cache, mesh)
    ids = np.zeros((B, longest), np.int32)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    batch = contiguous_batch(B, total, page_size, lengths=lengths)
    logits, cache = prefill_step(graphdef, params, jnp.asarray(ids), cache, batch, mesh=mesh)
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
        logits, cache = decode_step(
            graphdef, params, jnp.asarray(nxt[:, None]), cache, batch, mesh=mesh
        )
        start = start + np.where(done, 0, 1).astype(np.int32)
    return out


def dcp_mesh(dcp_size: int):
    """A 1-D mesh named 'dcp' over the first `dcp_size` devices; None for one device."""
    if dcp_size < 1:
        raise ValueError(f"dcp_size must be >= 1, got {dcp_size}")
    devices = jax.devices()
    if dcp_size > len(devices):
        raise ValueError(f"dcp_size ({dcp_size}) is larger than the device count ({len(devices)})")
    if dcp_size == 1:
        return None
    return jax.sharding.Mesh(np.array(devices[:dcp_size]), ("dcp",))


def shard_cache(cache: ModelCache, mesh) -> ModelCache:
    """MLA latents sharded over the in-page token axis; KDA states replicated on every rank."""
    from kernels.dcp import cache_sharding

    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    kda = jax.device_put(cache.kda, replicated)
    mla = tuple(
        m._replace(latent=jax.device_put(m.latent, cache_sharding(mesh))) for m in cache.mla
    )
    return ModelCache(kda, mla)
