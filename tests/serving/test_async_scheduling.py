"""Async scheduling (`LLM(async_scheduling=True)`): the next plain decode step is dispatched
before the previous step's tokens reach the host, stops apply one step late and the extra token
is dropped. Every run here gives the outputs of synchronous scheduling field for field (token
ids, text, logprobs, finish and stop reasons, cached tokens, errors), and checks that the
overlap engaged (or, for speculation, that it stayed off), that what it exercises happened
(stops, EOS, preemption, cache hits, drafts) and that every page and slot came back.

Engines use the shapes of test_engine.py, test_prefix_cache.py and test_speculative.py, so
their jitted steps compile once.
"""

from __future__ import annotations

import dataclasses

import jax
import pytest

from kimi_linear_jax.presets import preset
from kimi_linear_jax.testing import random_model
from kimi_linear_jax.tokenizer import ByteTokenizer
from serving.core.sampling import SamplingParams
from serving.engine import LLM
from serving.speculative.oracle import OracleDrafter
from tests.serving import test_prefix_cache as cache_tests
from tests.serving import test_speculative as spec_tests
from tests.serving.test_engine import PROMPTS, assert_drained, make_llm

LOGPROBS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def model():
    return random_model(preset("tiny"))


@pytest.fixture(scope="module")
def free_run(model):
    """Each prompt's 12 greedy tokens, no stop of any kind (synchronous engine)."""
    llm = make_llm(model, tokenizer=ByteTokenizer(model.config.vocab_size))
    return [o.token_ids for o in llm.generate(PROMPTS, LOGPROBS, use_tqdm=False)]


def fields(out):
    return (
        out.request_id,
        out.token_ids,
        out.text,
        out.logprobs,
        out.cumulative_logprob,
        out.finish_reason,
        out.stop_reason,
        out.num_cached_tokens,
        out.error,
    )


def run_both(make, prompts, params, *, drained=assert_drained):
    """Outputs of `make(async_scheduling=...)` off and on; asserts they are identical. Returns
    (outputs, the async engine)."""
    outs = {}
    for on in (False, True):
        llm = make(async_scheduling=on)
        outs[on] = llm.generate(prompts, params, use_tqdm=False)
        drained(llm)
    assert [fields(o) for o in outs[True]] == [fields(o) for o in outs[False]]
    return outs[True], llm


def engine(model, **kw):
    return lambda **on: make_llm(model, **kw, **on)


def tokenizer(model, eos: int | None = None):
    tok = ByteTokenizer(model.config.vocab_size)
    if eos is not None:
        tok.eos_token_ids = (eos,)  # an id the random model greedily emits
    return tok


@pytest.mark.parametrize("fused", [1, 4])
def test_stops_eos_and_max_tokens_apply_one_step_late(model, free_run, fused):
    """Each prompt stops differently, mid-run: a stop token, EOS (ignore_eos off), max_tokens;
    then stop strings. Seeded sampling checks that pending tokens advance the PRNG stream."""
    stop, eos = free_run[0][9], free_run[1][8]  # late enough for a fused step to overlap
    params = [
        dataclasses.replace(LOGPROBS, stop_token_ids=(stop,)),
        dataclasses.replace(LOGPROBS, ignore_eos=False),
        dataclasses.replace(LOGPROBS, max_tokens=10),
    ]
    # Four fused steps of three rows need more than the 14 pages: a step that would shrink to
    # fit is not scheduled ahead, so fusion runs in the larger pool (compiled by other tests).
    pool = {} if fused == 1 else {"num_pages": cache_tests.SHAPES["num_pages"]}
    make = engine(model, tokenizer=tokenizer(model, eos), num_scheduler_steps=fused, **pool)
    outs, llm = run_both(make, PROMPTS, params)
    assert [o.finish_reason for o in outs] == ["stop", "stop", "length"]
    assert [o.stop_reason for o in outs] == [stop, None, None]
    lengths = [free_run[0].index(stop) + 1, free_run[1].index(eos) + 1, 10]
    assert [len(o.token_ids) for o in outs] == lengths and max(lengths) < 12
    assert llm.metrics()["overlapped_steps"] > 0

    stops = [(tokenizer(model).decode(ids[:k])[-1],) for ids, k in zip(free_run, (3, 6, 9))]
    params = [dataclasses.replace(LOGPROBS, stop=s) for s in stops]
    outs, llm = run_both(make, PROMPTS, params)
    assert [o.stop_reason for o in outs] == [s[0] for s in stops]
    assert all(len(o.token_ids) < 12 for o in outs)
    sampled = SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=9, logprobs=1)
    outs, llm = run_both(make, PROMPTS, sampled)
    assert llm.metrics()["overlapped_steps"] > 0


def test_several_batch_buckets(model, free_run):
    """Batch 1 and 2 compile differently (the last bits of logprobs differ on a CPU): a step
    that could lose rows to a stop or an abort, and so run in another bucket synchronously,
    waits for the tokens in flight; the last request alone overlaps."""
    params = [
        dataclasses.replace(LOGPROBS, stop_token_ids=(free_run[0][2],)),
        dataclasses.replace(LOGPROBS, stop_token_ids=(free_run[1][6],)),
        LOGPROBS,
    ]
    outs, llm = run_both(engine(model, batch_buckets=(1, 2, 4)), PROMPTS, params)
    assert [len(o.token_ids) for o in outs] == [3, 7, 12]
    assert llm.metrics()["overlapped_steps"] > 0


def test_preemption_and_penalties(model):
    """More requests than slots and pages: admissions and preemptions synchronise, decodes
    between them overlap. Penalised rows (their counts need the host's tokens) synchronise."""
    outs, llm = run_both(engine(model), PROMPTS + PROMPTS, LOGPROBS)
    m = llm.metrics()
    assert m["preemptions"] > 0 and m["overlapped_steps"] > 0
    params = [
        SamplingParams(temperature=0.8, seed=8, max_tokens=7, frequency_penalty=1.5),
        SamplingParams(temperature=0.0, max_tokens=5, repetition_penalty=3.0),
        LOGPROBS,
    ]
    run_both(engine(model, num_scheduler_steps=4), PROMPTS, params)


@pytest.mark.slow  # make test-heavy has async scheduling on a mesh (tests/parallel)
def test_dcp4(model):
    """The step dispatched ahead reads the in-flight step's tokens from their DCP placement."""
    outs, llm = run_both(engine(model, dcp_size=4), PROMPTS, LOGPROBS)
    assert llm.metrics()["overlapped_steps"] > 0


def _abort_run(llm, prompts, after: int):
    """Step API: abort request 1 once `after` of its tokens were returned; final outputs."""
    rids = [llm.add_request(p, LOGPROBS) for p in prompts]
    final, aborted = {}, False
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.request_id == rids[1] and len(out.token_ids) >= after and not aborted:
                aborted = llm.abort_request(rids[1])
            if out.finished:
                final[out.request_id] = out
    assert aborted
    assert_drained(llm)
    return [fields(final[rid]) for rid in rids]


@pytest.mark.parametrize("buckets", [(4,), (1, 2, 4)])
def test_abort_mid_run_via_the_step_api(model, buckets):
    """With buckets 1 and 2, the step in flight when request 1 is aborted must not hold two
    rows: synchronously request 0 then decodes alone, in bucket 1."""
    prompts = PROMPTS if len(buckets) == 1 else PROMPTS[:2]
    sync = _abort_run(make_llm(model, batch_buckets=buckets), prompts, after=3)
    llm = make_llm(model, batch_buckets=buckets, async_scheduling=True)
    assert _abort_run(llm, prompts, after=3) == sync
    assert sync[1][5] == "abort" and len(sync[1][1]) == 3
    assert llm.metrics()["overlapped_steps"] > 0


def _fault_at(llm, method: str, call: int, lose_caches: bool):
    """Make the runner's `call`-th call of `method` (0-based) raise, after consuming the caches
    as a failed donated call would when `lose_caches`."""
    real, calls = getattr(llm.runner, method), []

    def faulty(*args):
        calls.append(1)
        if len(calls) == call + 1:
            if lose_caches:
                for x in jax.tree.leaves(llm.runner.cache):
                    x.delete()
            raise RuntimeError("injected fault")
        return real(*args)

    setattr(llm.runner, method, faulty)


@pytest.mark.parametrize(
    ("method", "lose_caches"),
    [("dispatch_decode", False), ("dispatch_decode", True), ("collect", False)],
)
def test_fault_in_a_decode_step(model, free_run, method, lose_caches):
    """A fault when the fourth decode step is dispatched, or when its tokens are fetched: its
    requests end with the error and the tokens of the steps before it, as synchronously (an
    async fetch fault also fails the step dispatched after it, which ran on its results)."""

    def make(**on):
        llm = make_llm(model, **on)
        _fault_at(llm, method, 3, lose_caches)
        return llm

    outs, llm = run_both(make, PROMPTS, LOGPROBS)
    assert [o.finish_reason for o in outs] == ["error"] * 3
    # Prompt 1 takes two prefill chunks, so it has one token fewer.
    assert [o.token_ids for o in outs] == [ids[:n] for ids, n in zip(free_run, (4, 3, 4))]
    assert llm.metrics()["overlapped_steps"] > 0
    again = llm.generate(PROMPTS, LOGPROBS, use_tqdm=False)
    assert [o.token_ids for o in again] == free_run
    assert_drained(llm)


def test_prefix_cache_hits(model):
    """Turn 1 decodes past 192 tokens: that step synchronises and snapshots, the others
    overlap. Turn 2 hits that snapshot, and a shorter prompt the prefill's checkpoint at 128
    (prefill donations synchronise too)."""
    turn1 = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, logprobs=1)
    turn2 = dataclasses.replace(turn1, max_tokens=8)
    system = cache_tests.SYSTEM
    outs = {}
    for on in (False, True):
        llm = LLM(model, **cache_tests.SHAPES, async_scheduling=on)
        (first,) = llm.generate([system], turn1, use_tqdm=False)
        prompts = [system + first.token_ids + [9, 8, 7], system[:140] + [1, 2, 3]]
        outs[on] = [fields(o) for o in [first, *llm.generate(prompts, turn2, use_tqdm=False)]]
        assert llm.reset_prefix_cache()
        assert_drained(llm)
    assert outs[True] == outs[False]
    assert [o[7] for o in outs[True]] == [0, 192, 128]
    assert llm.metrics()["overlapped_steps"] > 0


@pytest.mark.parametrize("drafter", ["oracle", "ngram"])
def test_speculation_synchronises(model, free_run, drafter):
    """Verify steps are never overlapped: outputs with speculation equal, and stay plain."""
    greedy = dataclasses.replace(LOGPROBS, logprobs=None)
    truth = {tuple(p): r for p, r in zip(PROMPTS, free_run, strict=True)}
    wrong = lambda p: p % 3 == 1  # noqa: E731 - rejections force the rollback path
    kw = {"drafter": OracleDrafter(truth, model.config.vocab_size, wrong)}

    def make(**on):
        return spec_tests.spec_llm(model, **(kw if drafter == "oracle" else {}), **on)

    # A repetitive prompt so that prompt lookup proposes.
    outs, llm = run_both(make, PROMPTS + [[5, 6, 7, 8] * 6], greedy)
    assert [o.token_ids for o in outs[:3]] == free_run
    m = llm.metrics()
    assert m["spec_draft_tokens"] > 0 and m["overlapped_steps"] == 0


def test_async_scheduling_must_be_a_bool(model):
    with pytest.raises(ValueError, match="async_scheduling must be True or False"):
        make_llm(model, async_scheduling="yes")
