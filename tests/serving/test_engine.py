"""End-to-end engine tests on a tiny random model (CPU, 8 emulated devices).

Every engine here uses the same cache and bucket shapes (one batch bucket, one token bucket,
the same page pool) so that the jitted steps compile once and are reused across tests.
"""

from __future__ import annotations

import pytest

from kimi_linear_jax.config import preset
from kimi_linear_jax.generation import greedy_generate
from kimi_linear_jax.testing import random_model
from serving.engine import LLM, RequestOutput
from serving.sampling import SamplingParams

PROMPTS = [list(range(1, 6)), list(range(10, 30)), list(range(40, 51))]
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
# 14 usable pages of 4 tokens: PROMPTS fit together (3 + 7 + 4 pages at their peak); four
# running requests of PROMPTS + PROMPTS do not, so that run preempts.
SHAPES = dict(num_pages=15, page_size=4, max_num_seqs=4, batch_buckets=(4,), token_buckets=(64,))


@pytest.fixture(scope="module")
def model():
    return random_model(preset("tiny"))


@pytest.fixture(scope="module")
def reference(model):
    eos = model.config.eos_token_ids
    return [greedy_generate(model, [p], MAX_TOKENS, eos_token_ids=eos)[0] for p in PROMPTS]


def make_llm(model, **kw):
    return LLM(model, **{**SHAPES, "max_num_batched_tokens": 64, "chunk_size": 16, **kw})


def assert_drained(llm):
    assert llm.allocator.num_free == llm.allocator.capacity
    llm.allocator.check_invariants()
    assert llm.state_pool.num_free == llm.state_pool.num_slots - 1
    assert not llm.scheduler.has_unfinished()


def test_greedy_matches_reference(model, reference):
    llm = make_llm(model)
    outs = llm.generate(PROMPTS, GREEDY)
    assert all(isinstance(o, RequestOutput) for o in outs)
    assert [o.token_ids for o in outs] == reference
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    for o, ref in zip(outs, reference, strict=True):
        assert o.finish_reason == ("length" if len(ref) == MAX_TOKENS else "stop")
        assert o.text is None  # no tokenizer given
    m = llm.metrics()
    assert m["requests"] == 3 and m["prompt_tokens"] == sum(map(len, PROMPTS))
    assert m["generation_tokens"] == sum(map(len, reference))
    assert m["preemptions"] == 0 and m["steps"] > MAX_TOKENS
    assert_drained(llm)


def test_chunk_sizes_agree(model, reference):
    small = make_llm(model, chunk_size=16).generate(PROMPTS, GREEDY)
    large = make_llm(model, chunk_size=64).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in small] == [o.token_ids for o in large] == reference


def test_preemption_keeps_outputs(model, reference):
    llm = make_llm(model)
    outs = llm.generate(PROMPTS + PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference + reference
    assert llm.metrics()["preemptions"] > 0
    assert_drained(llm)
    # The engine stays usable after preemptions.
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference


def test_dcp_matches_single_device(model, reference):
    llm = make_llm(model, dcp_size=4)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert_drained(llm)


def test_seeded_sampling_reproducible(model):
    params = [
        SamplingParams(temperature=1.0, seed=100 + i, max_tokens=MAX_TOKENS) for i in range(3)
    ]
    first = [o.token_ids for o in make_llm(model).generate(PROMPTS, params)]
    again = [o.token_ids for o in make_llm(model).generate(PROMPTS, params)]
    assert first == again
    # Another batch composition: reversed order, and one request alone.
    llm = make_llm(model)
    rev = [o.token_ids for o in llm.generate(PROMPTS[::-1], params[::-1])]
    assert rev[::-1] == first
    (alone,) = llm.generate([PROMPTS[1]], params[1])
    assert alone.token_ids == first[1]
    assert len(set(map(tuple, first))) > 1


def test_repetition_penalty(model):
    # A huge repetition penalty pushes every seen token below the unseen positive logits.
    params = SamplingParams(temperature=0, repetition_penalty=1e6, max_tokens=MAX_TOKENS)
    outs = make_llm(model).generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        seen = prompt + out.token_ids
        assert len(set(seen)) == len(seen), (prompt, out.token_ids)


@pytest.mark.parametrize(
    ("prompts", "params", "match"),
    [
        ([[1, 2], []], GREEDY, "prompt 1: prompt is empty"),
        ([[1, 2, 320]], GREEDY, "prompt 0: token id 320 is outside the vocabulary"),
        ([[-1]], GREEDY, "token id -1 is outside"),
        (["text"], GREEDY, "prompt 0: a text prompt needs a tokenizer"),
        ([[1] * 50], SamplingParams(max_tokens=10), "exceeds max_model_len 56"),
        ([[1]], SamplingParams(temperature=-1.0), "prompt 0: temperature must be >= 0"),
        ([[1]], SamplingParams(max_tokens=0), "max_tokens must be > 0"),
        ([[1], [2]], [GREEDY], "1 sampling_params for 2 prompts"),
    ],
)
def test_bad_inputs_raise(model, prompts, params, match):
    llm = make_llm(model)
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, params)
    assert not llm.scheduler.has_unfinished()  # nothing was queued
    assert llm.metrics()["requests"] == 0


def test_bad_dcp_size(model):
    with pytest.raises(ValueError, match="dcp_size"):
        LLM(model, dcp_size=64)


def test_text_prompt_with_tokenizer(model):
    from kimi_linear_jax.tokenizer import ByteTokenizer

    tok = ByteTokenizer(model.config.vocab_size)
    llm = make_llm(model, tokenizer=tok)
    (out,) = llm.generate("hello", GREEDY)
    assert out.prompt_token_ids == list(b"hello")
    assert out.text == tok.decode(out.token_ids)
