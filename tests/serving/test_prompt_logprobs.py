"""`SamplingParams(prompt_logprobs=N)` on a tiny random model (CPU), against the reference: a
float32 log_softmax of the no-cache forward `model(ids)` at every position.

Every engine here has the same shapes (SHAPES), so the jitted steps compile once for the file.
The prompt spans several prefill chunks (chunk_size 16), so chunk boundaries are covered.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_linear_jax.model import forward
from kimi_linear_jax.presets import preset
from kimi_linear_jax.testing import random_model
from serving.core.sampling import SamplingParams
from serving.engine import LLM

# 70 tokens: four chunks of 16 and one of 6; past the prefix cache's checkpoint grid (64).
PROMPT = [(7 * i) % 250 + 1 for i in range(70)]
SHORT = list(range(10, 30))
SHAPES = dict(
    num_pages=64,
    page_size=4,
    max_num_seqs=4,
    batch_buckets=(4,),
    token_buckets=(16,),
    max_num_batched_tokens=64,
    chunk_size=16,
)
GREEDY = SamplingParams(temperature=0, max_tokens=4)
# The reference and the engine's prefill differ in summation order only.
TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return random_model(preset("tiny"))


@pytest.fixture(scope="module")
def reference(model):
    """log_softmax(model(PROMPT)) in float32: [T, V]; row p is the distribution of token p + 1."""
    graphdef, state = nnx.split(model)
    logits = forward(graphdef, state, jnp.asarray([PROMPT], jnp.int32))[0]
    return np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))


def make_llm(model, **kw):
    return LLM(model, **{**SHAPES, **kw})


def with_prompt_logprobs(params: SamplingParams, n: int) -> SamplingParams:
    return dataclasses.replace(params, prompt_logprobs=n)


def assert_matches(prompt_logprobs, reference, n: int):
    """Entry 0 is None; entry i maps PROMPT[i] and the forward's top n at i - 1 to their
    logprobs."""
    assert len(prompt_logprobs) == len(PROMPT)
    assert prompt_logprobs[0] is None
    for i, entry in enumerate(prompt_logprobs[1:], start=1):
        row = reference[i - 1]
        top = np.argsort(-row)[:n].tolist()
        assert set(entry) == {PROMPT[i], *top}, i
        got = np.array(list(entry.values()))
        want = row[list(entry)]
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL, err_msg=f"entry {i}")


@pytest.mark.parametrize("n", [0, 3])
def test_prompt_logprobs_match_the_full_forward(model, reference, n):
    (out,) = make_llm(model).generate(PROMPT, with_prompt_logprobs(GREEDY, n), use_tqdm=False)
    assert out.finish_reason is not None and out.token_ids
    assert_matches(out.prompt_logprobs, reference, n)
    assert out.logprobs is None  # prompt logprobs do not turn on sampled-token logprobs
    if n == 0:
        assert all(len(e) == 1 for e in out.prompt_logprobs[1:])


def test_a_mixed_batch_generates_what_it_would_without(model, reference):
    """Rows with and without prompt logprobs in one step (a greedy, a seeded sampled, and a
    penalised row) get the tokens they get without any prompt logprobs in the batch."""
    base = [
        GREEDY,
        SamplingParams(temperature=0.8, seed=5, max_tokens=5),
        SamplingParams(temperature=0, max_tokens=3, repetition_penalty=2.0, logprobs=2),
    ]
    prompts = [PROMPT, SHORT, PROMPT[:37]]
    plain = make_llm(model).generate(prompts, base, use_tqdm=False)
    asked = [with_prompt_logprobs(base[0], 2), base[1], with_prompt_logprobs(base[2], 1)]
    mixed = make_llm(model).generate(prompts, asked, use_tqdm=False)
    assert [o.token_ids for o in mixed] == [o.token_ids for o in plain]
    for a, b in zip(mixed[2].logprobs, plain[2].logprobs, strict=True):
        assert a.keys() == b.keys()
        np.testing.assert_allclose(list(a.values()), list(b.values()), atol=TOL)
    assert_matches(mixed[0].prompt_logprobs, reference, 2)
    assert mixed[1].prompt_logprobs is None and plain[0].prompt_logprobs is None
    # The third prompt is PROMPT's first 37 tokens: the same entries, one top token each.
    short = mixed[2].prompt_logprobs
    assert len(short) == 37 and short[0] is None
    for i, entry in enumerate(short[1:], start=1):
        assert entry.keys() <= mixed[0].prompt_logprobs[i].keys()
        assert entry[PROMPT[i]] == pytest.approx(reference[i - 1, PROMPT[i]], abs=TOL)


@pytest.mark.parametrize(
    "engine",
    [
        dict(async_scheduling=True),
        dict(speculative={"method": "ngram", "num_draft_tokens": 3}),
        # 20 s; heavy: DCP splits attention only, whose outputs the DCP tests compare.
        pytest.param(dict(dcp_size=2), marks=pytest.mark.heavy),
    ],
    ids=["async", "ngram", "dcp2"],
)
def test_other_engine_features_keep_prompt_logprobs(model, reference, engine):
    params = with_prompt_logprobs(GREEDY, 3)
    (want,) = make_llm(model).generate(PROMPT, GREEDY, use_tqdm=False)
    (out,) = make_llm(model, **engine).generate(PROMPT, params, use_tqdm=False)
    assert out.token_ids == want.token_ids
    assert_matches(out.prompt_logprobs, reference, 3)


def test_a_warm_prefix_cache_is_not_hit(model, reference):
    """A request with prompt logprobs prefills its whole prompt even when the cache holds it,
    and still donates; one without them then hits."""
    llm = make_llm(model)
    (first,) = llm.generate(PROMPT, GREEDY, use_tqdm=False)
    (asked,) = llm.generate(PROMPT, with_prompt_logprobs(GREEDY, 3), use_tqdm=False)
    assert asked.num_cached_tokens == 0
    assert asked.token_ids == first.token_ids
    assert_matches(asked.prompt_logprobs, reference, 3)
    llm.reset_prefix_cache()
    llm.generate(PROMPT, with_prompt_logprobs(GREEDY, 0), use_tqdm=False)  # donates at 64
    (hit,) = llm.generate(PROMPT, GREEDY, use_tqdm=False)
    assert hit.num_cached_tokens == 64 and hit.token_ids == first.token_ids


def test_preempted_requests_keep_their_prompt_logprobs(model, reference):
    """Four PROMPTs outgrow the page pool: preempted ones prefill again from the start (prompt
    and outputs); their prompt logprobs are the same."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    llm = make_llm(model, enable_prefix_caching=False)
    outs = llm.generate([PROMPT] * 4, params, use_tqdm=False)
    assert llm.metrics()["preemptions"] > 0
    assert len({tuple(o.token_ids) for o in outs}) == 1
    for out in outs:
        assert_matches(out.prompt_logprobs, reference, 1)


def test_an_abort_mid_prefill_leaves_the_rest_none(model, reference):
    llm = make_llm(model)
    rid = llm.add_request(PROMPT, with_prompt_logprobs(GREEDY, 0))
    assert llm.step() == []  # the first chunk: positions 0..15 give entries 1..16
    llm.abort_request(rid)
    (out,) = llm.step()
    assert out.finish_reason == "abort"
    got = out.prompt_logprobs
    assert got[0] is None and all(e is None for e in got[17:])
    for i in range(1, 17):
        assert got[i][PROMPT[i]] == pytest.approx(reference[i - 1, PROMPT[i]], abs=TOL)


def test_a_one_token_prompt_has_one_none_entry(model):
    (out,) = make_llm(model).generate([PROMPT[:1]], with_prompt_logprobs(GREEDY, 2), use_tqdm=False)
    assert out.prompt_logprobs == [None] and len(out.token_ids) == GREEDY.max_tokens


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (-1, r"prompt_logprobs must be in \[0, 20\], got -1"),
        (21, r"prompt_logprobs must be in \[0, 20\], got 21"),
        (1.5, "prompt_logprobs must be an integer or None, got 1.5"),
        (True, "prompt_logprobs must be an integer or None, got True"),
        ("3", "prompt_logprobs must be an integer or None, got '3'"),
    ],
)
def test_bad_values_fail_alone(model, value, match):
    llm = make_llm(model)
    bad = SamplingParams(max_tokens=4, prompt_logprobs=value)
    with pytest.raises(ValueError, match=match):
        llm.add_request(SHORT, bad)
    assert not llm.has_unfinished_requests()
    outs = llm.generate([SHORT, SHORT], [bad, GREEDY], use_tqdm=False)
    assert outs[0].finish_reason == "error" and "prompt_logprobs" in outs[0].error
    assert outs[1].token_ids == llm.generate([SHORT], GREEDY, use_tqdm=False)[0].token_ids
