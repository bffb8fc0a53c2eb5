"""The compiled serving steps read and write only the state slots and latent pages of their
rows: no copy of a whole KDA slot pool or MLA latent pool (issue 13). XLA inserts such a copy
when a fusion may read a pool after its in-place update; it then costs every step time in
proportion to the pool (9 ms a step with 2 slots, 77 ms with 97, for the `small` model on a
CPU). This inspects the optimized HLO of each step with an odd slot count and an odd page count
that no other array shares.

The decode and verify steps of the serving model (`for_serving`, as the engine runs it) also
read no slice of kv_b_proj: XLA copied W_UK and W_UV out of it in every MLA layer, every step.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_linear_jax.cache import contiguous_batch, init_cache
from kimi_linear_jax.model import HashedGraph, decode_step, for_serving, prefill_step
from kimi_linear_jax.presets import preset
from kimi_linear_jax.testing import random_model
from serving.core.decode import decode_steps
from serving.core.sampling import SamplingBatch, SamplingParams
from serving.speculative.verify import verify_step

SLOTS = 13
PAGES = 37
# The release's head shapes (KDA d = 128): with the tiny preset's 8-wide heads XLA fuses
# differently and the copies do not appear, so the test would not catch them. Two MLA layers:
# with one, its pool was not copied; with two, the last one's was, twice a step (B = 1).
CFG = preset("small", vocab_size=320, num_hidden_layers=3, kda_layers=(1,), full_attn_layers=(2, 3))


def pool_copies(compiled_text: str) -> list[str]:
    """Copies whose result is a whole pool array: [SLOTS, ...] of any KDA state field, or
    [PAGES, page_size, L + R] of an MLA latent cache."""
    return [
        line.strip()[:160]
        for line in compiled_text.splitlines()
        if re.search(rf"= f32\[({SLOTS}|{PAGES}),[\d,]+\]\{{[\d,]+\}} copy\(", line)
    ]


def kv_b_reads(compiled_text: str) -> list[str]:
    """Ops that read kv_b_proj (its parameter declarations aside)."""
    return [
        line.strip()[:160]
        for line in compiled_text.splitlines()
        if "kv_b_proj" in line and "parameter(" not in line and "ENTRY" not in line
    ]


@pytest.fixture(scope="module")
def parts():
    graphdef, params = nnx.split(for_serving(random_model(CFG)))
    cache = init_cache(CFG, num_slots=SLOTS, num_pages=PAGES, page_size=16, dtype=jnp.float32)
    # One row: the row scatters become dynamic-update-slices, where the copies showed.
    B = 1
    batch = contiguous_batch(B, 128, 16, start=np.array([40]), lengths=np.array([1]))
    sampling = SamplingBatch.from_params([SamplingParams(temperature=0, seed=0)] * B, [0] * B, B)
    return HashedGraph(graphdef), params, cache, batch, sampling


def test_decode_step_copies_no_pool(parts):
    graphdef, params, cache, batch, _ = parts
    ids = jnp.ones((1, 1), jnp.int32)
    text = decode_step.lower(graphdef, params, ids, cache, batch).compile().as_text()
    assert pool_copies(text) == []
    assert kv_b_reads(text) == []


@pytest.mark.parametrize("num_steps", [1, 4])
def test_fused_decode_copies_no_pool(parts, num_steps):
    graphdef, params, cache, batch, sampling = parts
    zeros = jnp.zeros((1, 1), jnp.int32)
    lowered = decode_steps.lower(
        graphdef,
        params,
        jnp.ones(1, jnp.int32),
        cache,
        batch,
        jnp.full(1, num_steps),
        sampling,
        zeros,
        zeros.astype(bool),
        num_steps=num_steps,
        mode="greedy",
    )
    text = lowered.compile().as_text()
    assert pool_copies(text) == []
    assert kv_b_reads(text) == []


# track=True: a verify that also snapshots a track point into a checkpoint slot (the snapshot
# write must follow every write of the commit, or each S pool is copied twice).
@pytest.mark.parametrize("commit", ["replay", "gather"])
@pytest.mark.parametrize("track", [False, True])
def test_verify_step_copies_no_pool(parts, commit, track):
    graphdef, params, cache, batch, sampling = parts
    k = 3
    zeros = jnp.zeros((1, 1), jnp.int32)
    lowered = verify_step.lower(
        graphdef,
        params,
        jnp.ones(1, jnp.int32),
        jnp.ones((1, k), jnp.int32),
        jnp.full(1, k, jnp.int32),
        cache,
        batch,
        sampling,
        zeros,
        zeros.astype(bool),
        jnp.full(1, -1, jnp.int32),
        jnp.full(1, -1, jnp.int32),
        mode="greedy",
        track=track,
        commit=commit,
    )
    text = lowered.compile().as_text()
    assert pool_copies(text) == []
    assert kv_b_reads(text) == []


# has_prefix: the chunk also attends to the cached prefix, a read of each latent pool before
# its write.
@pytest.mark.parametrize("has_prefix", [False, True])
def test_prefill_step_copies_no_pool(parts, has_prefix):
    graphdef, params, cache, batch, _ = parts
    ids = jnp.ones((1, 16), jnp.int32)
    start = jnp.full(1, 16 if has_prefix else 0, jnp.int32)
    b = batch._replace(start=start, lengths=jnp.array([9], jnp.int32))
    lowered = prefill_step.lower(graphdef, params, ids, cache, b, has_prefix=has_prefix)
    assert pool_copies(lowered.compile().as_text()) == []
