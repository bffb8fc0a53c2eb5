"""The engine on a TP x DCP mesh gives one device's outputs: greedy with n-gram, oracle and
draft-model speculation, prefix-cache hits (depth asserted), and seeded sampling with
truncation, penalties and logprobs over the vocab-sharded logits.

All engines share SHAPES so the jitted steps compile once per plan.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from kimi_linear_jax.generation import greedy_generate
from kimi_linear_jax.testing import random_model
from serving.core.sampling import SamplingParams
from serving.engine import LLM
from serving.speculative.oracle import OracleDrafter
from tests.parallel.test_model_parallel import CONFIG, base_model

SYSTEM = [(7 * i) % 120 + 1 for i in range(70)]
QUESTIONS = [[100 + q, 101, 102 + q] for q in range(3)]
PROMPTS = [SYSTEM + q for q in QUESTIONS]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SHAPES = dict(
    num_pages=48,
    page_size=4,
    max_num_seqs=4,
    batch_buckets=(4,),
    token_buckets=(64,),
    max_num_batched_tokens=64,
    chunk_size=64,
)


@functools.cache
def reference() -> dict[tuple[int, ...], list[int]]:
    """Plain greedy decoding on one device (the model package's own loop)."""
    out = greedy_generate(base_model(), PROMPTS, MAX_TOKENS)
    return {tuple(p): o for p, o in zip(PROMPTS, out, strict=True)}


def run_one_by_one(llm, prompts, params=GREEDY):
    return [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]


@pytest.mark.parametrize("tp,dcp", [(4, 2), pytest.param(8, 8, marks=pytest.mark.slow)])
def test_ngram_speculation_with_prefix_hits_equals_one_device(tp, dcp):
    spec = {"method": "ngram", "num_draft_tokens": 3}
    llm = LLM(base_model(), tensor_parallel_size=tp, dcp_size=dcp, speculative=spec, **SHAPES)
    got = run_one_by_one(llm, PROMPTS)
    assert [o.token_ids for o in got] == [reference()[tuple(p)] for p in PROMPTS]
    # 73 tokens: the checkpoint grid is lcm(64, 4 * dcp) = 64 at dcp 2 and 8.
    assert [o.num_cached_tokens for o in got] == [0, 64, 64]
    assert llm.metrics()["prefix_cache_hit_tokens"] == 128


def test_oracle_speculation_with_rejections_equals_one_device():
    truth = reference()
    wrong = OracleDrafter(truth, CONFIG.vocab_size, lambda position: position % 3 == 1)
    spec = {"method": "ngram", "num_draft_tokens": 3}
    llm = LLM(
        base_model(), tensor_parallel_size=4, dcp_size=2, speculative=spec, drafter=wrong, **SHAPES
    )
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in got] == [truth[tuple(p)] for p in PROMPTS]
    assert llm.runner.spec_counts["accepted_tokens"] > 0
    assert llm.runner.spec_counts["accepted_tokens"] < llm.runner.spec_counts["draft_tokens"]


# The draft on one device beside a sharded target is heavy (34 s); the default run keeps the
# draft that shares the mesh.
@pytest.mark.parametrize("draft_heads", [8, pytest.param(2, marks=pytest.mark.heavy)])
def test_draft_model_speculation_equals_one_device(draft_heads):
    """A draft whose heads divide tp shares the mesh; one whose do not runs on one device."""
    cfg = dataclasses.replace(CONFIG, num_attention_heads=draft_heads)
    draft = random_model(cfg, seed=9)
    spec = {"method": "draft_model", "model": draft, "num_draft_tokens": 3}
    llm = LLM(
        base_model(),
        tensor_parallel_size=4,
        dcp_size=2,
        speculative=spec,
        enable_prefix_caching=False,
        **SHAPES,
    )
    assert llm.runner.drafter.par.sharded == (draft_heads == 8)
    got = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in got] == [reference()[tuple(p)] for p in PROMPTS[:2]]


@pytest.mark.heavy  # 29 s
def test_seeded_sampling_and_logprobs_equal_one_device():
    params = [
        SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=1, max_tokens=6, logprobs=3),
        SamplingParams(
            temperature=1.2,
            min_p=0.05,
            seed=2,
            max_tokens=6,
            logprobs=1,
            repetition_penalty=1.3,
            frequency_penalty=0.2,
        ),
        SamplingParams(temperature=0.7, seed=3, max_tokens=6),
    ]
    outs = {}
    for tp, dcp in ((1, 1), (4, 2)):
        llm = LLM(base_model(), tensor_parallel_size=tp, dcp_size=dcp, **SHAPES)
        outs[tp] = llm.generate(PROMPTS, params, use_tqdm=False)
    for one, many in zip(outs[1], outs[4], strict=True):
        assert many.token_ids == one.token_ids
        if one.logprobs is not None:
            for a, b in zip(one.logprobs, many.logprobs, strict=True):
                assert a.keys() == b.keys()
                np.testing.assert_allclose(list(b.values()), list(a.values()), atol=1e-4)


@pytest.mark.heavy  # 36 s; async scheduling runs by default on one device, the mesh above
def test_async_scheduling_equals_sync_on_a_mesh():
    """tp 4 x dcp 2: a step dispatched ahead reads its input tokens from the step in flight's
    outputs on the mesh; outputs (logprobs included) equal synchronous scheduling's."""
    params = [
        SamplingParams(temperature=0.9, top_k=20, seed=1, max_tokens=6, logprobs=3),
        GREEDY,
        SamplingParams(temperature=0.7, seed=3, max_tokens=6, logprobs=1),
    ]
    outs = {}
    for on in (False, True):
        llm = LLM(base_model(), tensor_parallel_size=4, dcp_size=2, async_scheduling=on, **SHAPES)
        got = llm.generate(PROMPTS, params, use_tqdm=False)
        outs[on] = [(o.token_ids, o.logprobs, o.cumulative_logprob, o.finish_reason) for o in got]
    assert outs[True] == outs[False]
    assert outs[True][1][0] == reference()[tuple(PROMPTS[1])]
    assert llm.metrics()["overlapped_steps"] > 0
