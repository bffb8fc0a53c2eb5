"""Draftless runs: where prompt lookup proposes nothing, the n-gram engine runs plain decode
steps on device until a step's token makes the request's last n tokens recur
(`draftless.decode_until_recurs`). Stepping one call at a time (`verifier.draftless_runs = False`)
is the reference: every request proposes at the same positions (a run skips only positions
where its lookup finds nothing), so the speculation metrics are the same, in fewer engine
steps, and so are greedy outputs (tokens, logprobs, finish reasons). A sampled row draws a run's
tokens as plain steps do; at batch 1 its outputs are the same too. (In a batch, a row without
drafts that shares a verify window with one that drafts draws there instead, with or without
runs, and runs change which rows share one.)
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from kimi_linear_jax.presets import preset
from kimi_linear_jax.testing import random_model
from serving.core.sampling import SamplingParams
from serving.engine import LLM
from serving.speculative.ngram import _ends, suffix_recurs
from tests.serving.test_speculative import SHAPES as speculative_shapes

# Two repetitive prompts (lookup proposes there) and two that are not (draftless runs).
PROMPTS = [[5, 6, 7, 8] * 5, list(range(10, 30)), list(range(40, 51)), [3, 9, 3, 9, 3]]
# test_speculative's shapes (a worker that ran it finds these programs in its compile cache),
# with room for every request's pages: under page pressure, when a request preempts depends on
# the steps, and so would the windows.
SHAPES = {**speculative_shapes, "num_pages": 64}
SPEC_KEYS = ("spec_draft_tokens", "spec_accepted_tokens", "spec_verify_steps")


@pytest.fixture(scope="module")
def model():
    return random_model(preset("tiny"))


def test_suffix_recurs_equals_the_host_lookup():
    """The device check says a suffix recurs exactly where the host lookup finds an earlier
    occurrence; tokens past each row's length (garbage) are never read."""
    rng = np.random.default_rng(0)
    for n in (1, 2, 3):
        seq = rng.integers(0, 4, size=(64, 24)).astype(np.int32)
        length = rng.integers(1, 25, size=64).astype(np.int32)
        got = np.asarray(suffix_recurs(seq, length, n))
        want = [L > n and _ends(seq[b, :L], n).size > 0 for b, L in enumerate(length)]
        assert got.tolist() == want, n
        assert 0 < sum(want) < len(want)  # both answers occur


def _run(model, runs: bool, params, prompts=PROMPTS, **kw):
    """(tokens, logprobs, finish reason) per prompt and the metrics of an n-gram engine."""
    spec = kw.pop("speculative", {"method": "ngram", "num_draft_tokens": 4})
    setup = kw.pop("setup", lambda llm: None)
    llm = LLM(model, speculative=spec, **{**SHAPES, **kw})
    llm.runner.verifier.draftless_runs = runs
    setup(llm)
    proposals = _spy_proposals(llm.runner.drafter)
    outs = llm.generate(prompts, params, use_tqdm=False)
    seen = [(o.token_ids, o.logprobs, o.finish_reason) for o in outs]
    return seen, llm.metrics(), proposals


def _spy_proposals(drafter) -> dict:
    """(request id, its length) -> the drafts proposed there, for each proposal a row may
    draft in (max_drafts > 0)."""
    proposals = {}
    propose = drafter.propose_tokens

    def spy(request, max_drafts):
        drafts = propose(request, max_drafts)
        if max_drafts > 0:
            proposals[(request.request_id, request.num_tokens)] = drafts
        return drafts

    drafter.propose_tokens = spy
    return proposals


def assert_same_proposals(runs: dict, stepwise: dict):
    """Runs propose where stepping does, the same drafts, and skip only empty proposals."""
    assert set(runs) <= set(stepwise), sorted(set(runs) - set(stepwise))
    assert all(runs[key] == stepwise[key] for key in runs)
    assert not [key for key in set(stepwise) - set(runs) if stepwise[key]]
    assert len(runs) < len(stepwise)  # runs happened


@pytest.mark.parametrize(
    "case",
    [
        "greedy",
        "stop-tokens",
        "prefix-caching",
        # 31 s; runs at dcp 4 also happen in test_speculative's dcp 4 n-gram test.
        pytest.param("dcp4", marks=pytest.mark.heavy),
    ],
)
def test_runs_keep_outputs_and_windows(model, case):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = {}
    if case == "stop-tokens":  # requests end inside a run: its later tokens are dropped
        plain = LLM(model, **SHAPES).generate(PROMPTS, params, use_tqdm=False)
        stops = [o.token_ids[16] for o in plain]
        params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=stops)
    elif case == "prefix-caching":  # track points cut the windows a run may fill
        kw = dict(enable_prefix_caching=True)
    elif case == "dcp4":
        kw = dict(dcp_size=4)
    stepwise, m_step, proposed_step = _run(model, False, params, **kw)
    runs, m_runs, proposed_runs = _run(model, True, params, **kw)
    assert runs == stepwise
    assert_same_proposals(proposed_runs, proposed_step)
    # A run goes on past a stop token (the host drops those tokens), and counts those steps.
    keys = SPEC_KEYS[:2] if case == "stop-tokens" else SPEC_KEYS
    assert {k: m_runs[k] for k in keys} == {k: m_step[k] for k in keys}
    assert m_runs["spec_draft_tokens"] > 0  # windows ran between the runs
    assert m_runs["steps"] < m_step["steps"], (m_runs["steps"], m_step["steps"])
    if case == "stop-tokens":
        assert any(f == "stop" and len(t) < 24 for t, _, f in runs)


def test_sampled_resting_rows_step_one_call_at_a_time(model):
    """Sampled with logprobs, at batch 1: the same tokens and logprobs. A request that rests
    (its drafts keep failing) is stepped one call at a time, and so is its probe: the next
    probe is counted in steps, so a run would move it."""
    spec = {"method": "ngram", "num_draft_tokens": 4, "min_acceptance": 0.99}
    # Sampled tokens rarely repeat two in a row: lookups of one token propose, drafts fail
    # (the request rests) and probes find nothing (a run would follow them).
    spec["prompt_lookup_min"] = 1
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=64, ignore_eos=True, logprobs=2)
    stepwise, m_step, proposed_step = _run(model, False, params, PROMPTS[:1], speculative=spec)
    runs, m_runs, proposed_runs = _run(model, True, params, PROMPTS[:1], speculative=spec)
    assert runs == stepwise
    assert_same_proposals(proposed_runs, proposed_step)
    assert {k: m_runs[k] for k in SPEC_KEYS} == {k: m_step[k] for k in SPEC_KEYS}
    assert m_runs["steps"] < m_step["steps"], (m_runs["steps"], m_step["steps"])


def test_resting_rows_run_under_cost_aware_widths(model):
    """Cost-aware widths on a pinned curve where windows cost 1.4-2 plain steps, in an engine
    whose drafts have been failing (its pool's prior near 0): requests rest from the start
    with no probes (the n-gram shadows), and their steps run on device as those of rows that
    may draft do: the same tokens, windows and proposals in fewer engine steps."""
    from serving.speculative.widths import CostCurve

    def setup(llm):
        curve = CostCurve()
        curve.seconds = {(0, 1): 1.0, (1, 1): 1.4, (2, 1): 1.6, (4, 1): 2.0}
        curve.frozen = True  # the same widths with and without runs
        llm.runner.widths.curve = curve
        pool = llm.scheduler.draft_policy.pool
        pool.hits, pool.trials = 0.0, 50.0

    spec = {"method": "ngram", "num_draft_tokens": 4, "width_policy": "cost"}
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    kw = dict(speculative=spec, setup=setup, batch_buckets=(1,), max_num_seqs=1)
    stepwise, m_step, proposed_step = _run(model, False, params, **kw)
    runs, m_runs, proposed_runs = _run(model, True, params, **kw)
    assert runs == stepwise
    assert set(proposed_runs) <= set(proposed_step)
    assert all(proposed_runs[key] == proposed_step[key] for key in proposed_runs)
    assert {k: m_runs[k] for k in SPEC_KEYS} == {k: m_step[k] for k in SPEC_KEYS}
    assert m_runs["steps"] < m_step["steps"], (m_runs["steps"], m_step["steps"])


def test_a_resting_draft_models_steps_run_with_lookup_first(model):
    """Lookup first, behind a draft model whose drafts miss (random weights, gated by
    `min_acceptance`): the model rests after its first windows and drafts again at each
    probe, and where lookup finds nothing the steps run on device, up to the probe and to
    the room of the row's lag, whose tokens the run adds. Against stepping one call at a
    time: the same tokens, lookup proposals and windows (the model's probes on the same
    steps), and the same draft caches, in fewer engine steps. (To rounding: near a track
    point a stepping row writes its lag every step, where a run's tokens go in one pass.)"""
    draft = random_model(preset("tiny"), seed=5)
    spec = {"method": "draft_model", "model": draft, "num_draft_tokens": 2}
    spec.update(prompt_lookup_num_tokens=8, min_acceptance=0.5)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    kw = dict(batch_buckets=(1,), max_num_seqs=1)
    seen = {}
    for runs in (False, True):
        llm = LLM(model, speculative=spec, **{**SHAPES, **kw})
        llm.runner.verifier.draftless_runs = runs
        proposals = _spy_proposals(llm.runner.drafter.lookup)
        drafter, model_windows = llm.runner.drafter, []
        model_drafts = drafter._model_drafts

        def spy(last, batch, steps, *a, _real=model_drafts, _seen=model_windows, **named):
            if steps.any():  # the position each model window drafts from
                _seen.append(int(np.asarray(batch.start)[0]))
            return _real(last, batch, steps, *a, **named)

        drafter._model_drafts = spy
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        tokens = [(o.token_ids, o.finish_reason) for o in outs]
        seen[runs] = tokens, llm.metrics(), proposals, drafter.cache, model_windows
    (tokens, m_step, proposed_step, cache_step, at_step) = seen[False]
    (runs, m_runs, proposed_runs, cache_runs, at_runs) = seen[True]
    assert runs == tokens and all(len(t) == 48 for t, _ in runs)
    assert at_runs == at_step and len(at_runs) > 2 * len(PROMPTS), (at_runs, at_step)
    assert_same_proposals(proposed_runs, proposed_step)
    keys = (*SPEC_KEYS, "spec_lookup_draft_tokens")
    assert {k: m_runs[k] for k in keys} == {k: m_step[k] for k in keys}
    assert m_runs["spec_lookup_draft_tokens"] > 0 and m_runs["spec_draft_tokens"] > 0
    assert m_runs["steps"] < m_step["steps"], (m_runs["steps"], m_step["steps"])
    for a, b in zip(jax.tree.leaves(cache_runs), jax.tree.leaves(cache_step), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
