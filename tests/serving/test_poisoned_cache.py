"""Non-finite values in cache slots no request may read never reach an output (issue 36,
defect 8): the latent pools are filled with NaN / inf before a batch, so every free page, and
the tail of each sequence's last page, holds poison; the outputs must equal a clean run's."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from kimi_linear_jax.presets import preset
from kimi_linear_jax.testing import random_model
from serving.core.sampling import SamplingParams
from serving.engine import LLM

SHAPES = dict(num_pages=32, page_size=4, max_num_seqs=4, enable_prefix_caching=False)
PROMPTS = [[5, 9, 2], [7] * 9, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]


@pytest.fixture(scope="module")
def llm():
    return LLM(random_model(preset("tiny")), **SHAPES)


def poison_pools(llm, value) -> None:
    cache = llm.runner.cache
    mla = tuple(m._replace(latent=jnp.full_like(m.latent, value)) for m in cache.mla)
    llm.runner.cache = cache._replace(mla=mla)


@pytest.mark.parametrize("value", [jnp.nan, jnp.inf], ids=["nan", "inf"])
def test_poisoned_free_slots_leave_outputs_unchanged(llm, value):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2)
    clean = llm.generate(PROMPTS, params, use_tqdm=False)
    poison_pools(llm, value)
    dirty = llm.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(clean, dirty, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs
    latent = llm.runner.cache.mla[0].latent
    assert not bool(jnp.isfinite(latent).all())  # the poison was there all along
