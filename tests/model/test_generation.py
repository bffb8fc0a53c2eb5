"""The greedy loop over the cached entries."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_linear_jax.config import preset
from kimi_linear_jax.generation import greedy_generate
from kimi_linear_jax.model import forward
from kimi_linear_jax.testing import random_model


@pytest.fixture(scope="module")
def model():
    return random_model(preset("tiny"), seed=11)


def full_forward_greedy(model, prompt, n):
    """Reference: re-run the whole no-cache forward for every new token. The sequence is right
    padded to one fixed width (one compile): by causality padding after it changes nothing."""
    g, p = nnx.split(model)
    seq = list(prompt)
    for _ in range(n):
        padded = np.zeros((1, 32), np.int32)
        padded[0, : len(seq)] = seq
        logits = forward(g, p, jnp.asarray(padded))
        seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
    return seq[len(prompt) :]


def test_batched_equals_single_equals_full_forward(model):
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 300, n)) for n in (3, 17)]
    batched = greedy_generate(model, prompts, 6)
    for prompt, got in zip(prompts, batched):
        assert greedy_generate(model, [prompt], 6)[0] == got
        assert full_forward_greedy(model, prompt, 6) == got


def test_eos_stops_a_row(model):
    prompt = [5, 6, 7]
    first = greedy_generate(model, [prompt], 4)[0]
    out = greedy_generate(model, [prompt, prompt], 4, eos_token_ids=[first[1]])
    assert out[0] == first[:2] and out[1] == first[:2]


@pytest.mark.parametrize(
    "prompts,n,match",
    [
        ([[]], 4, "at least one token"),
        ([[1, 2]], 0, "max_new_tokens must be > 0"),
        ([[1, 400]], 2, "token id 400 is outside the vocabulary"),
        ([[1] * 8190], 8, "exceeds the context limit 8192"),
    ],
)
def test_bad_input(model, prompts, n, match):
    with pytest.raises(ValueError, match=match):
        greedy_generate(model, prompts, n)


# Slow: the engine's DCP tests cover dcp 4 by default (test_engine, test_speculative).
@pytest.mark.slow
@pytest.mark.parametrize("dcp_size", [2, 4])
def test_dcp_greedy_equals_single_device(model, dcp_size):
    """Decode context parallelism: the MLA latent cache spread over dcp_size devices gives the
    same greedy tokens as one device (prompts shorter and longer than dcp_size, ragged)."""
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(0, 300, n)) for n in (2, 19)]
    single = greedy_generate(model, prompts, 8, page_size=16)
    assert greedy_generate(model, prompts, 8, page_size=16, dcp_size=dcp_size) == single


def test_dcp_size_larger_than_device_count(model):
    import jax

    n = len(jax.devices())
    with pytest.raises(ValueError, match=rf"dcp_size \({n + 1}\) is larger than the device count"):
        greedy_generate(model, [[1, 2]], 2, dcp_size=n + 1)


def test_dcp_logits_equal_single_device(model):
    """Logits, not only argmax: prefill + a 3-token verify window with the latent cache on 4
    devices == one device."""
    from kimi_linear_jax.cache import contiguous_batch, init_cache
    from kimi_linear_jax.generation import dcp_mesh, shard_cache
    from kimi_linear_jax.model import decode_step, prefill_step
    from tests.helpers import assert_close

    cfg = model.config
    g, p = nnx.split(model)
    ids = np.random.default_rng(4).integers(0, 300, (2, 26)).astype(np.int32)
    out = {}
    for c in (1, 4):
        mesh = dcp_mesh(c)
        page = 8 * c  # virtual page: 8 tokens a device
        cache = init_cache(
            cfg, num_slots=3, num_pages=2 * (-(-32 // page)), page_size=page, dtype=jnp.float32
        )
        cache = cache if mesh is None else shard_cache(cache, mesh)
        batch = contiguous_batch(2, 32, page, lengths=[23, 3])
        a, cache = prefill_step(g, p, jnp.asarray(ids[:, :23]), cache, batch, mesh=mesh)
        win = batch._replace(start=jnp.asarray([23, 3], jnp.int32), lengths=jnp.full((2,), 3))
        b, _ = decode_step(g, p, jnp.asarray(ids[:, 23:]), cache, win, mesh=mesh)
        out[c] = (np.asarray(a), np.asarray(b))
    for x, y, name in zip(out[4], out[1], ("prefill", "verify")):
        assert_close(x, y, atol=1e-5, rtol_rms=1e-5, name=name)
