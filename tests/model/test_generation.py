"""The greedy loop over the cached entries."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_linear_jax.generation import greedy_generate
from kimi_linear_jax.model import forward
from kimi_linear_jax.presets import preset
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
