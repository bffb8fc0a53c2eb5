"""Cost-aware widths with lookup first (a draft model with prompt lookup tried first): lookup
windows are priced apart from the draft model's (they run none of its steps), the verifier
chooses on what each row would draft (`Drafter.plan`) before the drafts are made, and a lookup
row is not held to the width the model's windows would get."""

from __future__ import annotations

import types

import pytest

from kimi_linear_jax.presets import preset
from kimi_linear_jax.testing import random_model
from serving.core.sampling import SamplingParams
from serving.engine import LLM
from serving.speculative.oracle import OracleDrafter
from serving.speculative.steps import Verifier
from serving.speculative.widths import CostCurve, WidthPolicy, expected_tokens, window_key

PROMPTS = [list(range(1, 6)), list(range(10, 30)), list(range(40, 51))]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SHAPES = dict(
    num_pages=40,
    page_size=4,
    max_num_seqs=4,
    batch_buckets=(4,),
    token_buckets=(64,),
    max_num_batched_tokens=64,
    chunk_size=16,
)
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
    """A drafter stand-in that plans fixed (lookup, model) drafts per row."""

    def __init__(self, lookup, model):
        self.lookup, self.model = lookup, model

    def plan(self, requests, max_drafts):
        return self.lookup, self.model


def _planned(lookup, model, model_costs, alphas):
    verifier = types.SimpleNamespace(
        drafter=_Plan(lookup, model), widths=WidthPolicy(4, _curve(model_costs))
    )
    output = types.SimpleNamespace(decode=[None] * len(lookup))
    room = [4] * len(lookup)
    w, room = Verifier._planned(verifier, output, room, alphas, 4)
    return w, room, verifier._lookup


def test_plan_compares_the_models_windows_with_lookup_windows_alone():
    # Row 0 found 4 lookup drafts, row 1 would draft 2 by the model. The model's windows do
    # not pay: lookup windows alone, the model's row resting (room 0).
    assert _planned([4, 0], [0, 2], MODEL_COSTS, [1.0, 1.0]) == (4, [4, 0], True)
    # Cheap model windows: both rows draft, on the model's curve (its steps run for row 1).
    cheap = {1: 1.05, 2: 1.1, 4: 1.15}
    assert _planned([4, 0], [0, 2], cheap, [1.0, 1.0]) == (4, [4, 4], False)
    # No row would run the model: lookup windows, even though the model's would not pay.
    assert _planned([3, 2], [0, 0], MODEL_COSTS, [1.0, 1.0]) == (4, [4, 4], True)
    # Nothing found, the model does not pay: a plain step.
    assert _planned([0, 0], [2, 2], MODEL_COSTS, [1.0, 1.0])[0] == 0


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
