"""Cost-aware widths with lookup first (a draft model with prompt lookup tried first): lookup
windows are priced apart from the draft model's (they run none of its steps), the verifier
chooses on what each row would draft (`Drafter.plan`) before the drafts are made, and a lookup
row is not held to the width the model's windows would get."""

from __future__ import annotations

import types

import numpy as np
import pytest

from kimi_linear_jax.presets import preset
from kimi_linear_jax.testing import random_model
from serving.engine import LLM
from serving.speculative.lag import MAX_LAG
from serving.speculative.oracle import OracleDrafter
from serving.speculative.steps import Verifier
from serving.speculative.widths import CostCurve, WidthPolicy, expected_tokens, window_key
from tests.serving.test_widths import GREEDY, PROMPTS, SHAPES  # the widths tests' engine

# The model's windows cost 3-6 plain steps (none pays, even if every draft holds); lookup
# windows 1.1-1.3 (the widest pays most).
MODEL_COSTS = {1: 3.0, 2: 4.0, 4: 6.0}
LOOKUP_COSTS = {1: 1.1, 2: 1.2, 4: 1.3}


def _curve(model_costs=MODEL_COSTS, lookup_costs=LOOKUP_COSTS, rows: int = 4) -> CostCurve:
    curve = CostCurve()
    curve.seconds = {(0, rows): 1.0, **{(w, rows): c for w, c in model_costs.items()}}
    curve.seconds.update({(window_key(w, True), rows): c for w, c in lookup_costs.items()})
    curve.frozen = True
    return curve


def test_lookup_windows_are_priced_apart():
    policy = WidthPolicy(4, _curve())
    assert window_key(0, True) == window_key(0) == 0  # one plain step
    assert policy.choose([1.0], [4], 4) == 0  # the model's windows never pay
    assert policy.choose([1.0], [4], 4, lookup=True) == 4
    assert policy.best([1.0], [4], 4, lookup=True) == (4, pytest.approx(5 / 1.3))
    assert policy.choose([1.0], [2], 4, lookup=True) == 2  # what the lookup found
    # A request drafts by lookup where it can: the break-even is the lookup windows'.
    alpha = policy.break_even(4)
    best = max(expected_tokens(alpha, w) / c for w, c in LOOKUP_COSTS.items())
    assert best == pytest.approx(1.0, abs=1e-6) and policy.probe_width(4) == 1
    assert WidthPolicy(4, _curve(lookup_costs={})).break_even(4) == 1.0  # nothing pays


class _Plan:
    """A drafter stand-in that plans fixed (lookup, model, model acceptance) per row; the
    slots in `lagging` already have a lag (resting them again starts none)."""

    def __init__(self, lookup, model, model_alphas, lagging=()):
        self.lookup, self.model, self.model_alphas = lookup, model, model_alphas
        self.lagging = set(lagging)

    def plan(self, requests, max_drafts):
        return self.lookup, self.model, self.model_alphas

    def starts_rest(self, slots):
        return not set(slots) <= self.lagging


def _planned(lookup, model, model_costs, alphas, model_alphas=None, lag=0.0, lagging=()):
    """(width, room, lookup windows alone) that `Verifier._planned` chooses, row i in slot i,
    with a one-token lag pass of `lag` seconds (the curve's plain step: 1)."""
    model_alphas = alphas if model_alphas is None else model_alphas
    widths = WidthPolicy(4, _curve(model_costs))
    widths.lag = {4: lag}
    verifier = types.SimpleNamespace(
        drafter=_Plan(lookup, model, model_alphas, lagging), widths=widths, _alphas=alphas
    )
    verifier._rest_price = types.MethodType(Verifier._rest_price, verifier)
    rows = [types.SimpleNamespace(request_id=str(i)) for i in range(len(lookup))]
    placement = {r.request_id: types.SimpleNamespace(slot=i) for i, r in enumerate(rows)}
    output = types.SimpleNamespace(decode=rows, placement=placement)
    w, room = Verifier._planned(verifier, output, [4] * len(lookup), 4)
    return w, room, verifier._lookup


CHEAP = {1: 1.05, 2: 1.1, 4: 1.15}


def test_plan_compares_the_models_windows_with_lookup_windows_alone():
    # Row 0 found 4 lookup drafts, row 1 would draft 2 by the model. The model's windows do
    # not pay: lookup windows alone, the model's row resting (room 0).
    assert _planned([4, 0], [0, 2], MODEL_COSTS, [1.0, 1.0]) == (4, [4, 0], True)
    # Cheap model windows: both rows draft, on the model's curve (its steps run for row 1).
    assert _planned([4, 0], [0, 2], CHEAP, [1.0, 1.0]) == (4, [4, 4], False)
    # No row would run the model: lookup windows, even though the model's would not pay.
    assert _planned([3, 2], [0, 0], MODEL_COSTS, [1.0, 1.0]) == (4, [4, 4], True)
    # Nothing found, the model does not pay: a plain step.
    assert _planned([0, 0], [2, 2], MODEL_COSTS, [1.0, 1.0])[0] == 0


def test_plan_judges_the_models_rows_by_the_models_acceptance():
    # Model windows a little dearer than lookup windows (1.5 against 1.3 at w = 4). At the
    # request's acceptance (its lookup windows', 1.0) row 1's model drafts would pay for them:
    # (5 + 3) / 1.5 > 6 / 1.3; at the model's own (0.05) they do not: lookup windows alone.
    dearer = {1: 1.2, 2: 1.3, 4: 1.5}
    assert _planned([4, 0], [0, 2], dearer, [1.0, 1.0]) == (4, [4, 4], False)
    assert _planned([4, 0], [0, 2], dearer, [1.0, 1.0], [1.0, 0.05]) == (4, [4, 0], True)
    assert _planned([0], [2], dearer, [1.0], [0.05])[0] == 0
    # The other way round: a request whose lookup misses, a model that holds.
    assert _planned([0], [2], dearer, [0.05], [1.0]) == (2, [4], False)


def test_resting_the_models_rows_is_priced_with_the_lag_pass_it_starts():
    """A row whose model rests gathers a lag, written by a pass when it drafts again. At the
    model's acceptance 0.5 its 2-draft window (1.75 tokens for 1.8 steps) just loses to a
    plain step; with the pass resting would start (0.1 of a step) it pays: 1.75 / 1.8 >
    1 / 1.1. A row that lags already starts no pass: a plain step again."""
    near = {1: 1.6, 2: 1.8, 4: 2.6}
    assert _planned([0], [2], near, [1.0], [0.5])[0] == 0
    assert _planned([0], [2], near, [1.0], [0.5], lag=0.1) == (2, [4], False)
    assert _planned([0], [2], near, [1.0], [0.5], lag=0.1, lagging=[0])[0] == 0
    # Lookup windows alone rest the model's row too, so every one of them is charged the
    # pass. Row 0 found 1 lookup draft (always accepted), row 1 would draft by the model:
    # lookup alone makes 3 tokens for 1.1 steps (2.73 a step), the model's 1-draft window
    # for both 3.5 for 1.6 (2.19); charged 0.3, lookup alone makes 3 / 1.4 = 2.14.
    both = ([1, 0], [0, 2], near, [1.0, 1.0], [1.0, 0.5])
    assert _planned(*both) == (1, [4, 0], True)
    assert _planned(*both, lag=0.3) == (1, [4, 4], False)


@pytest.fixture(scope="module")
def model():
    return random_model(preset("tiny"))


@pytest.fixture(scope="module")
def reference(model):
    return [o.token_ids for o in LLM(model, **SHAPES).generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_lookup_rows_draft_wide_where_the_models_do_not_pay(model, reference, monkeypatch):
    """The target as its own draft, prompt lookup first (an oracle that always finds the
    continuation), on a curve where the model's windows never pay and lookup windows pay
    widest: every window is a lookup window of 4, output is plain decoding's. Chosen on the
    model's windows alone, as before lookup windows were priced apart, no window paid and
    the requests rested."""
    import serving.speculative.steps as steps

    spec = {"method": "draft_model", "num_draft_tokens": 2, "prompt_lookup_num_tokens": 4}
    llm = LLM(model, speculative={**spec, "model": model, "width_policy": "cost"}, **SHAPES)
    truth = {tuple(p): r for p, r in zip(PROMPTS, reference, strict=True)}
    llm.runner.drafter.lookup = OracleDrafter(truth, model.config.vocab_size, lambda p: False)
    llm.runner.widths.curve = _curve()
    widths, verify = [], steps.verify_step

    def spy(*args, **kw):
        widths.append(args[3].shape[1])
        return verify(*args, **kw)

    monkeypatch.setattr(steps, "verify_step", spy)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference
    m = llm.metrics()
    assert m["spec_draft_tokens"] == m["spec_lookup_draft_tokens"] > 0, m  # no model drafts
    assert m["spec_accepted_tokens"] == m["spec_draft_tokens"]
    # Each request's 39 tokens after the prefill's: 7 windows of 4 drafts (5 tokens each),
    # then the last 4 tokens (3 drafts, in the compiled window of 4). The second prompt
    # prefills in two chunks, so the rows' windows are one step apart.
    assert m["spec_draft_tokens"] == 3 * (7 * 4 + 3)
    assert widths and set(widths) == {4}, widths


class _EveryOtherCall(OracleDrafter):
    """Lookup stand-in: the true continuation (never wrong) at every other call for each
    request, nothing at the others; counts the drafts it proposed, and the longest
    proposal since `widest` was last reset (a step's)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.calls, self.proposed, self.widest = {}, 0, 0

    def propose_tokens(self, request, max_drafts):
        calls = self.calls[request.request_id] = self.calls.get(request.request_id, 0) + 1
        drafts = super().propose_tokens(request, max_drafts) if calls % 2 else []
        self.proposed += len(drafts)
        self.widest = max(self.widest, len(drafts))
        return drafts

    def shadow(self, request):  # the truth, outside the count of calls
        drafts = super().propose_tokens(request, 1)
        return drafts[0] if drafts else None


def test_models_misses_do_not_narrow_the_lookup_windows(model, reference, monkeypatch):
    """A draft model with random weights (its drafts and lag shadows miss) behind a lookup
    that always holds, at every other step: windows pay only at a high acceptance. Judged
    by the request's acceptance, the lookup's, every lookup proposal is verified whole in a
    window as wide as it (4, less at a request's end); the model is judged by its own.
    Counted together (the model's lag shadows and windows in the request's acceptance), the
    lookup windows narrowed and stopped."""
    import serving.speculative.steps as steps

    draft = random_model(preset("tiny"), seed=5)
    spec = {"method": "draft_model", "num_draft_tokens": 2, "prompt_lookup_num_tokens": 4}
    llm = LLM(model, speculative={**spec, "model": draft, "width_policy": "cost"}, **SHAPES)
    truth = {tuple(p): r for p, r in zip(PROMPTS, reference, strict=True)}
    lookup = llm.runner.drafter.lookup = _EveryOtherCall(truth, model.config.vocab_size)
    # At acceptance 1 the widest window pays most; at 0.5 none pays.
    llm.runner.widths.curve = _curve({1: 1.6, 2: 2.0, 4: 2.4}, {1: 1.5, 2: 1.9, 4: 2.2})
    widths, verify = [], steps.verify_step

    def spy(*args, **kw):  # (the window's width, the step's longest lookup proposal)
        widths.append((args[3].shape[1], lookup.widest))
        lookup.widest = 0
        return verify(*args, **kw)

    monkeypatch.setattr(steps, "verify_step", spy)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference
    m = llm.metrics()
    assert m["spec_lookup_draft_tokens"] == lookup.proposed > 0, (m, lookup.proposed)
    # Every lookup draft is accepted (the model's, in windows it shares with lookup rows
    # while its own estimate falls, mostly miss).
    assert m["spec_accepted_tokens"] >= lookup.proposed, m
    # Each window as wide as its step's longest lookup proposal: 4, or what is left of a
    # request's max_tokens at its end.
    assert widths and all(w == p for w, p in widths), widths
    assert max(w for w, _ in widths) == 4, widths


def test_start_up_compiles_the_draft_models_lag_passes(model):
    """A draft model's lag (the tokens of a row that rested) is written in one pass as wide
    as the next power of two: the cost profile compiles that pass at every width and batch
    bucket, so no lag compiles in the middle of serving (each had taken 0.4-0.6 s there,
    after a whole warm round of the benchmark)."""
    import serving.speculative.draft_model as draft_mod

    spec = {"method": "draft_model", "num_draft_tokens": 1, "prompt_lookup_num_tokens": 2}
    llm = LLM(model, speculative={**spec, "model": model, "width_policy": "cost"}, **SHAPES)
    drafter, pages = llm.runner.drafter, np.zeros(llm.runner.buckets.min_width, np.int32)
    compiled = draft_mod.write_lag._cache_size()
    for rows in SHAPES["batch_buckets"]:
        for n in range(1, MAX_LAG + 1):  # a lag of n tokens in slot 0, written as a step would
            for position in range(n):
                drafter.lag.add(0, position, 7, pages)
            drafter._write_lags([0], rows)
            assert not drafter.lag.pending(0)
    assert draft_mod.write_lag._cache_size() == compiled
