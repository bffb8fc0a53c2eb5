"""Cost-aware verify widths: the expected-token law, the width choice and the break-even
acceptance on a cost curve, the curve's interpolation and refresh, and engines that pick
their windows from it (greedy output stays plain's; failing drafts stop costing windows)."""

from __future__ import annotations

import collections
import dataclasses
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from kimi_linear_jax.presets import preset
from kimi_linear_jax.testing import random_model
from serving.core.request import Request
from serving.core.sampling import SamplingParams
from serving.engine import LLM
from serving.speculative.oracle import OracleDrafter
from serving.speculative.widths import (
    MIN_LIVE,
    STALE,
    STALE_MAX,
    WINDOW,
    CostCurve,
    WidthPolicy,
    _lowest_root,
    _solve,
    candidate_widths,
    expected_tokens,
    window_key,
)

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


def _curve(plain: float, per_width) -> CostCurve:
    curve = CostCurve()
    curve.seconds = {(0, 4): plain, **{(w, 4): c for w, c in per_width.items()}}
    curve.frozen = True
    return curve


# ---- the law ---------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 1.0])
@pytest.mark.parametrize("m", [0, 1, 4])
def test_expected_tokens_is_the_mean_of_the_truncated_geometric(alpha, m):
    """E = sum_a (a + 1) P(A = a): a window of m drafts accepts a < m drafts with
    probability alpha^a (1 - alpha) and all m with alpha^m; it emits one token more."""
    law = [(alpha**a) * (1 - alpha) for a in range(m)] + [alpha**m]
    assert sum(law) == pytest.approx(1.0)
    mean = sum((a + 1) * p for a, p in enumerate(law))
    assert expected_tokens(alpha, m) == pytest.approx(mean)


def test_candidate_widths():
    assert candidate_widths(1) == (1,)
    assert candidate_widths(4) == (1, 2, 4)
    assert candidate_widths(6) == (1, 2, 4, 6)


# ---- the choice --------------------------------------------------------------------------------


def test_choice_maximises_expected_tokens_per_second():
    rng = np.random.default_rng(0)
    for _ in range(200):
        costs = {w: 1.0 + rng.uniform(0.05, 0.6) * w for w in (1, 2, 4, 8)}
        policy = WidthPolicy(8, _curve(1.0, costs))
        alphas = rng.uniform(0, 1, 3).tolist()
        avail = rng.integers(0, 9, 3).tolist()
        got = policy.choose(alphas, avail, 4)
        rates = {
            w: sum(expected_tokens(a, min(w, n)) for a, n in zip(alphas, avail)) / c
            for w, c in {0: 1.0, **costs}.items()
        }
        assert rates[got] == pytest.approx(max(rates.values()))


def test_choice_extremes():
    policy = WidthPolicy(4, _curve(1.0, {1: 1.3, 2: 1.5, 4: 1.9}))
    assert policy.choose([0.0, 0.0], [4, 4], 4) == 0  # drafts never accepted: plain
    assert policy.choose([1.0, 1.0], [4, 4], 4) == 4  # always accepted: the widest pays most
    assert policy.choose([1.0, 1.0], [0, 0], 4) == 0  # nothing to draft: plain
    assert policy.choose([1.0], [1], 4) == 1  # one draft found: wider costs more for nothing
    assert WidthPolicy(4).choose([0.0], [4], 1) == 4  # nothing priced yet: the widest


def test_break_even_is_where_a_window_starts_to_pay():
    policy = WidthPolicy(4, _curve(1.0, {1: 1.3, 2: 1.5, 4: 1.9}))
    alpha = policy.break_even(4)
    best = max(expected_tokens(alpha, w) / c for w, c in {1: 1.3, 2: 1.5, 4: 1.9}.items())
    assert best == pytest.approx(1.0, abs=1e-6)
    assert policy.choose([alpha - 0.01], [4], 4) == 0
    assert policy.choose([alpha + 0.01], [4], 4) > 0
    assert WidthPolicy(4, _curve(1.0, {1: 0.9})).break_even(4) == 0.0  # a window is cheaper


def test_curve_interpolates_refreshes_and_drops_outliers():
    curve = CostCurve()
    curve.observe(1, 1, 1.0)
    curve.observe(1, 9, 3.0)
    assert curve.cost(1, 5) == pytest.approx(2.0)  # linear between measured batch sizes
    assert curve.cost(1, 16) == 3.0 and curve.cost(1, 0) == 1.0  # the nearest outside
    assert curve.cost(2, 5) is None  # a width never measured
    curve.observe(1, 1, 2.0)
    assert curve.cost(1, 1) == pytest.approx(1.5)  # the median of the recent steps
    curve.observe(1, 1, 4.9)  # one slow step
    assert curve.cost(1, 1) == pytest.approx(2.0)
    curve.observe(1, 1, 100.0)  # a compiling call: dropped
    assert curve.cost(1, 1) == pytest.approx(2.0)
    for _ in range(WINDOW):  # a lasting change of price: followed
        curve.observe(1, 1, 3.0)
    assert curve.cost(1, 1) == pytest.approx(3.0)
    curve.frozen = True
    curve.observe(1, 1, 1.0)
    assert curve.cost(1, 1) == pytest.approx(3.0)


def test_profiled_points_carry_the_host_part_of_the_live_plain_step():
    curve = CostCurve()
    for w, c in {0: 1.0, 1: 1.5, 2: 1.8}.items():
        curve.profile(w, 4, c)
    assert curve.cost(1, 4) == 1.5  # nothing live yet
    curve.observe(0, 4, 1.4)  # a whole plain step: 0.4 of host work on top of its profile
    assert curve.cost(0, 4) == 1.4
    assert curve.cost(1, 4) == pytest.approx(1.9) and curve.cost(2, 4) == pytest.approx(2.2)
    curve.observe(1, 4, 2.5)
    assert curve.cost(1, 4) == pytest.approx(1.9)  # one live step does not price it yet
    curve.observe(1, 4, 2.5)
    curve.observe(1, 4, 2.5)  # MIN_LIVE steps: measured live, its own price
    assert curve.cost(1, 4) == 2.5


def test_a_guessed_window_carries_the_host_part_the_live_windows_show():
    """A window's host work (drafting, judging each row) is more than a plain step's: a
    window still guessed is priced at its profile plus the least that two or more live
    windows of its kind run over theirs, a lookup window by lookup windows; the plain step's
    part where fewer are live (one slow window does not price the others out)."""
    curve = CostCurve()
    profiles = {0: 1.0, 1: 1.5, 2: 1.8, 4: 2.4, 8: 3.5, window_key(2, True): 1.2}
    for key, c in profiles.items():
        curve.profile(key, 4, c)
    for key, live in {0: 1.1, 1: 1.8}.items():
        for _ in range(MIN_LIVE):
            curve.observe(key, 4, live)
    assert curve.cost(4, 4) == pytest.approx(2.4 + 0.1)  # one live window: the plain's part
    for _ in range(MIN_LIVE):
        curve.observe(2, 4, 2.05)  # windows 0.3 and 0.25 over their profiles, plain 0.1
    assert curve.cost(4, 4) == pytest.approx(2.4 + 0.25)
    assert curve.cost(8, 4) == pytest.approx(3.5 + 0.25)
    assert curve.cost(window_key(2, True), 4) == pytest.approx(1.2 + 0.1)  # no live lookup
    for _ in range(MIN_LIVE):  # once 4 drafts run live, their own price
        curve.observe(4, 4, 2.55)
    assert curve.cost(4, 4) == 2.55
    assert curve.cost(8, 4) == pytest.approx(3.5 + 0.15)


def test_a_stale_point_priced_as_before_stays_priced_longer():
    """A stale point re-tried and found at its old price (within CONFIRMED) goes stale after
    twice as many steps next time, up to STALE_MAX: a settled curve stops paying for re-tries
    (at B = 8 each width near the best was re-tried every run). One found cheaper is re-tried
    after STALE again."""
    curve = CostCurve()
    for w, c in {0: 1.0, 1: 1.5, 2: 1.6}.items():
        curve.profile(w, 4, c)

    def stale_after(width, price):  # steps of other widths until `width` is a guess again
        for _ in range(MIN_LIVE):
            curve.observe(width, 4, price)
        steps = 0
        while curve.settled(width, 4):
            curve.observe(0, 4, 1.0)
            steps += 1
        return steps

    assert stale_after(2, 2.0) == STALE + 1
    assert stale_after(2, 1.9) == 2 * STALE + 1  # 1.9 >= 0.9 x 2.0: the price held
    assert stale_after(2, 1.95) == 4 * STALE + 1
    assert stale_after(2, 1.2) == STALE + 1  # cheaper than it was: re-tried sooner again
    assert [stale_after(2, 1.2) for _ in range(6)][-2:] == [STALE_MAX + 1] * 2


def _guessed(live_plain: float = 1.0) -> CostCurve:
    """A curve of profiles only (1 draft 1.6 steps, 2 drafts 1.7, 4 drafts 5.0) and a live
    plain step at its profile (no host part)."""
    curve = CostCurve()
    for w, c in {0: 1.0, 1: 1.6, 2: 1.7, 4: 5.0}.items():
        curve.profile(w, 4, c)
    for _ in range(MIN_LIVE):
        curve.observe(0, 4, live_plain)
    return curve


@pytest.mark.parametrize("live_one", [1.3, 2.0])
def test_a_guessed_price_near_the_best_is_tried_until_live_steps_price_it(live_one):
    """At alpha 0.5 the profile makes 2 drafts the best (4 x 1.75 / 1.7 = 4.12 tokens a
    step-second) and 1 draft near it (4 x 1.5 / 1.6 = 3.75, within EXPLORE): the guess for 1
    draft is tried until MIN_LIVE steps price it, then its live price decides. 4 drafts
    (1.55) are never tried."""
    policy = WidthPolicy(4, _guessed())
    alphas, room = [0.5] * 4, [4] * 4
    chosen = []
    for _ in range(4 * MIN_LIVE):
        w = policy.choose(alphas, room, 4)
        chosen.append(w)
        policy.curve.observe(w, 4, {1: live_one, 2: 1.7}[w])
    assert chosen[: 2 * MIN_LIVE] == [2] * MIN_LIVE + [1] * MIN_LIVE  # each priced live once
    # Live, 1 draft at 1.3 steps makes 4.6 and wins; at 2.0 it makes 3.0 and 2 drafts do.
    assert chosen[2 * MIN_LIVE :] == [1 if live_one == 1.3 else 2] * (2 * MIN_LIVE)
    assert policy.curve.settled(1, 4) and not policy.curve.settled(4, 4)


def test_a_pinned_curve_is_not_explored():
    curve = _guessed()
    curve.frozen = True
    assert WidthPolicy(4, curve).choose([0.5] * 4, [4] * 4, 4) == 2


def test_probe_width_is_the_first_to_pay():
    # Windows of 1 and 2 cost 1.9 and 2.0 steps, of 4 2.2: the 4-wide pays from the lowest
    # acceptance (E(a, 4) = 2.2 at a ~ 0.57; 1 + a + a^2 = 2 needs 0.62, 1 + a = 1.9 0.9).
    policy = WidthPolicy(4, _curve(1.0, {1: 1.9, 2: 2.0, 4: 2.2}))
    assert policy.probe_width(4) == 4
    assert policy.break_even(4) == pytest.approx(
        min(a for a in np.linspace(0, 1, 100001) if expected_tokens(a, 4) >= 2.2), abs=1e-4
    )


@pytest.mark.parametrize("width", [1, 2, 3, 4, 8])
def test_solve_finds_the_acceptance_of_a_ratio(width):
    for ratio in np.linspace(1.01, width + 0.99, 37):
        alpha = _solve(width, float(ratio))
        assert 0.0 < alpha < 1.0 and expected_tokens(alpha, width) == pytest.approx(ratio)
    assert _solve(width, 0.8) == 0.0 and _solve(width, width + 1.5) == 1.0


def test_a_point_not_stepped_for_long_is_a_guess_again():
    """A width priced high in a slow spell and then never chosen is priced as a guess again
    after STALE steps of other widths (so `EXPLORE` may try it), and its old steps do not
    count when it is stepped again."""
    curve = CostCurve()
    policy = WidthPolicy(4, curve)
    for w, c in {0: 1.0, 1: 1.5, 2: 1.6, 4: 3.0}.items():
        curve.profile(w, 4, c)
    for _ in range(MIN_LIVE):
        curve.observe(0, 4, 1.0)
        curve.observe(2, 4, 4.0)  # a slow spell
    assert policy.choose([0.6], [4], 4) == 1  # 2 drafts now dearer than 1 (4.0 a step)
    for _ in range(STALE):
        curve.observe(1, 4, 1.5)
    assert curve.settled(2, 4) and curve.cost(2, 4) == 4.0
    curve.observe(0, 4, 1.0)  # the 2-draft point's last step is STALE + 1 steps ago
    assert not curve.settled(2, 4) and curve.cost(2, 4) == pytest.approx(1.6)
    assert policy.choose([0.6], [4], 4) == 2  # priced (1.96 / 1.6) over 1 (1.6 / 1.5)
    for _ in range(MIN_LIVE):
        curve.observe(2, 4, 1.7)
    assert curve.cost(2, 4) == pytest.approx(1.7)  # the slow spell's steps are gone


def test_a_step_that_wrote_a_lag_prices_no_width():
    """The lag pass is the price of the rest that started it (`rest`): a step in which the
    draft wrote one (the window that ends a rest, a full lag) does not refresh the curve;
    nor a step with a track point (another program), nor fixed widths."""
    import types

    from serving.speculative.steps import Verifier

    drafter = types.SimpleNamespace(lag_passes=3)
    verifier = types.SimpleNamespace(widths=WidthPolicy(4), drafter=drafter, _passes=3)
    quiet = types.SimpleNamespace(track={})
    assert Verifier._prices(verifier, quiet)
    drafter.lag_passes = 4
    assert not Verifier._prices(verifier, quiet)
    verifier._passes = 4
    assert not Verifier._prices(verifier, types.SimpleNamespace(track={"r": 0}))
    verifier.widths = None
    assert not Verifier._prices(verifier, quiet)


def test_rest_is_charged_where_the_models_rows_rest():
    """`rest` (the lag pass that resting the model's rows starts) is added to the plain step
    on the model's curve, and to every width on the lookup windows' (they rest it too)."""
    policy = WidthPolicy(4, _curve(1.0, {1: 1.6, 2: 1.8, 4: 2.6}))
    assert policy.choose([0.5], [4], 4) == 0  # 1.75 tokens for 1.8 steps: plain pays more
    assert policy.best([0.5], [4], 4, rest=0.1)[0] == 2  # against 1 / 1.1
    assert policy.best([0.5], [4], 4, rest=0.1)[1] == pytest.approx(1.75 / 1.8)
    policy.curve.seconds = {**policy.curve.seconds, (("lookup", 1), 4): 1.5}
    assert policy.best([1.0], [1], 4, lookup=True, rest=0.5) == (1, pytest.approx(2 / 2.0))
    assert policy.rest_price(4) == 0.0  # nothing profiled
    policy.lag = {1: 0.1, 8: 0.3}
    assert (policy.rest_price(2), policy.rest_price(6)) == (0.1, 0.3)  # the nearest batch


def test_first_paying_width_skips_only_widths_that_cannot_pay_sooner():
    """The break-even solves only widths whose lower bound could beat the best so far: the
    answer is the plain minimum over every width's own solve (ties: the first width)."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 9))
        widths = [int(w) for w in rng.choice([1, 2, 4, 8], n)]
        ratios = [(w, float(r)) for w, r in zip(widths, rng.uniform(0.5, 10.0, n), strict=True)]
        if rng.random() < 0.3:  # ties: a width repeated at the same price
            ratios.append(ratios[0])
        expected = min(((w, _solve(w, r)) for w, r in ratios), key=lambda x: x[1])
        assert _lowest_root(ratios) == expected


def test_prices_follow_the_curve_after_they_are_kept():
    curve = CostCurve()
    policy = WidthPolicy(4, curve)
    curve.profile(0, 4, 1.0)
    curve.profile(4, 4, 2.0)
    assert policy.choose([0.9], [4], 4) == 4  # 4.1 tokens for 2 steps
    for _ in range(MIN_LIVE):
        curve.observe(4, 4, 5.0)  # live steps price the window far dearer
    assert policy.choose([0.9], [4], 4) == 0
    assert policy.break_even(4) == pytest.approx(_solve(4, 5.0), abs=1e-9)


def test_alpha_estimate_follows_the_windows():
    from serving.core.policy import DraftPolicy

    request = Request("r", [1], SamplingParams())
    assert request.spec_alpha == 0.5  # the prior
    policy = DraftPolicy(by="alpha")
    assert policy.acceptance(request) == 0.5  # not verified yet: its prior
    primed = Request("p", [1], SamplingParams(), spec_prior=0.9)  # the engine's pool
    assert policy.acceptance(primed) == pytest.approx(0.9)
    for _ in range(10):
        policy.record(request, 4, 4)  # every draft accepted
    assert request.spec_alpha > 0.9
    policy.record(request, 0, 4)  # the first draft rejected: one trial, no hit
    assert request.spec_trials == pytest.approx(0.8 * (1 - 0.8**10) / 0.2 * 4 + 1)
    for _ in range(30):
        policy.record(request, 0, 4)
    assert request.spec_alpha < 0.2  # the full windows are forgotten
    assert policy.acceptance(request) == request.spec_alpha
    with pytest.raises(ValueError, match="DraftPolicy.by"):
        DraftPolicy(by="mean")


# ---- engines -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return random_model(preset("tiny"))


@pytest.fixture(scope="module")
def reference(model):
    return [o.token_ids for o in LLM(model, **SHAPES).generate(PROMPTS, GREEDY, use_tqdm=False)]


def _engine(model, reference, wrong, curve=None):
    truth = {tuple(p): r for p, r in zip(PROMPTS, reference, strict=True)}
    drafter = OracleDrafter(truth, model.config.vocab_size, wrong)
    spec = {"method": "ngram", "num_draft_tokens": 4, "width_policy": "cost"}
    llm = LLM(model, speculative=spec, drafter=drafter, **SHAPES)
    if curve is not None:
        llm.runner.widths.curve = curve
    return llm


def _windows(llm, monkeypatch):
    """Record the drafts width of every verify call."""
    import serving.speculative.steps as steps

    widths, real = [], steps.verify_step

    def spy(*args, **kw):
        widths.append(args[3].shape[1])
        return real(*args, **kw)

    monkeypatch.setattr(steps, "verify_step", spy)
    return widths


def test_start_up_profile_prices_every_width(model, reference):
    llm = _engine(model, reference, lambda p: False)
    seconds = llm.runner.widths.curve.profiled
    assert set(seconds) == set(itertools.product((0, 1, 2, 4), (4,)))  # every bucket: (4,)
    assert all(s > 0 for s in seconds.values())
    assert llm.runner.widths.lag == {4: 0.0}  # a host drafter keeps no lag: resting is free
    policy = llm.scheduler.draft_policy
    assert policy.by == "alpha" and policy.min_acceptance == llm.runner.widths.break_even(1)


@pytest.mark.parametrize("wrong", ["never", "always", "every_third"])
def test_cost_aware_greedy_equals_plain(model, reference, wrong, monkeypatch):
    rule = {"never": lambda p: False, "always": lambda p: True, "every_third": lambda p: p % 3 == 2}
    llm = _engine(model, reference, rule[wrong])
    windows = _windows(llm, monkeypatch)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference
    assert windows and set(windows) <= {0, 1, 2, 4}
    assert llm.cache.allocator.num_free == llm.cache.allocator.capacity


def test_pool_prior_and_shadow_record():
    """The pool's prior is every request's recent per-draft acceptance (1.0 before any), and
    a shadow counts as a window of one draft."""
    from serving.core.policy import POOL_DECAY, DraftPolicy

    policy = DraftPolicy(by="alpha")
    assert policy.prior() == 1.0
    a, b = Request("a", [1], SamplingParams()), Request("b", [1], SamplingParams())
    policy.record_step([a, b], {"a": [5, 6, 7], "b": [5]}, {"a": 4, "b": 0}, {"b": [False]})
    # a: 2 of 4 accepted (2 hits, 3 trials); b: a failed shadow (0 hits, 1 trial).
    assert (a.spec_hits, a.spec_trials, b.spec_hits, b.spec_trials) == (2, 3, 0, 1)
    assert policy.prior() == pytest.approx(2 * POOL_DECAY / (3 * POOL_DECAY + 1))
    policy.record_step([b], {"b": [5]}, {}, {"b": [True]})
    assert b.spec_hits == 1 and b.spec_trials == pytest.approx(0.8 + 1)
    assert policy.pool.trials == pytest.approx(POOL_DECAY * (3 * POOL_DECAY + 1) + 1)
    rested = dataclasses.replace(policy, min_acceptance=0.9, probes=False)
    assert rested.pool is policy.pool  # one pool through the step's replace
    assert rested.drafts(4, 0.1, 100, 0) == (0, 100, 0)  # no probe, however long it rested


def _windows_at(policy, requests, alphas, rounds, seed=0):
    """Record `rounds` windows of 4 drafts for each request in turn, each draft accepted with
    its request's probability (given the one before was)."""
    rng = np.random.default_rng(seed)
    for _ in range(rounds):
        for request, alpha in zip(requests, alphas, strict=True):
            accepted = 0
            while accepted < 4 and rng.random() < alpha:
                accepted += 1
            policy.record(request, accepted, 4)


def test_pool_prior_is_worth_more_where_requests_draft_alike():
    """Requests of one acceptance: their five-window estimates spread by noise alone, and the
    pool's prior, worth up to MAX_PRIOR_TRIALS, holds each estimate near the truth. Requests
    of two acceptances: the prior stays near two trials and each follows its own windows."""
    from serving.core.policy import MAX_PRIOR_TRIALS, DraftPolicy

    alike, policy = [Request(i, [1], SamplingParams()) for i in range(8)], DraftPolicy(by="alpha")
    assert policy.pool.weight == 2.0  # before any window: the prior is 1.0, and cheap
    _windows_at(policy, alike, [0.75] * 8, 60)
    assert policy.pool.weight > 0.75 * MAX_PRIOR_TRIALS
    assert all(r.spec_prior_weight == policy.pool.weight for r in alike)
    raw = [r.spec_hits / r.spec_trials for r in alike]  # the five-window estimates alone
    shrunk = [r.spec_alpha for r in alike]
    assert max(abs(a - 0.75) for a in shrunk) < 0.06
    assert np.std(shrunk) < 0.5 * np.std(raw)
    differ, policy = [Request(i, [1], SamplingParams()) for i in range(8)], DraftPolicy(by="alpha")
    _windows_at(policy, differ, [0.95, 0.3] * 4, 60)
    assert policy.pool.weight < 3.0
    assert np.mean([r.spec_alpha for r in differ[0::2]]) > 0.85
    assert np.mean([r.spec_alpha for r in differ[1::2]]) < 0.5


def test_costly_windows_and_failing_drafts_rest_the_requests(model, reference, monkeypatch):
    """Windows twice a plain step and drafts that always fail: the first requests of an
    engine (prior 1.0) verify a few windows until their alpha falls below the break-even,
    then rest with no probe (the oracle shadows); requests after them start at the pool's
    prior, near 0, and verify no window at all."""
    curve = _curve(1.0, {1: 1.4, 2: 1.6, 4: 2.0})
    llm = _engine(model, reference, lambda p: True, curve)
    windows = _windows(llm, monkeypatch)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference
    assert windows[0] == 4  # alpha 1.0: 5 tokens for 2 steps
    assert 1 < len(windows) <= 8  # alpha 1 -> below the break-even (0.4) in a few windows
    assert llm.scheduler.draft_policy.prior() < 0.05
    windows.clear()
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference
    assert windows == []


def test_shadows_bring_a_resting_request_back(model, reference, monkeypatch):
    """Drafts that fail for the first 16 positions and then hold: the requests rest (no
    probes) and their shadow drafts, scored every resting step, bring them back to windows
    that accept."""
    curve = _curve(1.0, {1: 1.4, 2: 1.6, 4: 2.0})
    llm = _engine(model, reference, lambda p: p < 16, curve)
    llm.scheduler.draft_policy.pool.hits = 0.0  # a pool that has seen drafts fail
    llm.scheduler.draft_policy.pool.trials = 50.0
    windows = _windows(llm, monkeypatch)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference
    m = llm.metrics()
    # Resting to position 16 at least (no window before), then windows that accept: the
    # 24 tokens left take fewer than 24 steps.
    assert windows and m["spec_accepted_tokens"] >= 3 * 8
    assert m["spec_accepted_tokens"] == m["spec_draft_tokens"]


def test_cheap_windows_and_accepted_drafts_go_widest(model, reference, monkeypatch):
    curve = _curve(1.0, {1: 1.05, 2: 1.1, 4: 1.2})
    llm = _engine(model, reference, lambda p: False, curve)
    windows = _windows(llm, monkeypatch)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference
    assert windows.count(4) >= len(windows) - 3  # the widest, but near each request's end
    m = llm.metrics()
    assert m["spec_accepted_tokens"] == m["spec_draft_tokens"]


def test_resting_rows_draft_in_windows_the_others_pay_for(model, reference, monkeypatch):
    """A request whose drafts fail rests (no window is worth paying for it alone), but in a
    step whose window the others' accepted drafts pay for it drafts up to the width: those
    drafts cost nothing more. A row with a repetition penalty never drafts. Left out, the
    resting row took one token from windows its batch ran anyway (0.86 of fixed k = 4 at
    B = 8, A = 0.75)."""
    import serving.speculative.steps as steps

    penalised = dataclasses.replace(GREEDY, repetition_penalty=2.0)
    plain = LLM(model, **SHAPES)
    want = plain.generate([PROMPTS[2]], penalised, use_tqdm=False)[0].token_ids
    truth = {tuple(p): r for p, r in zip(PROMPTS, reference, strict=True)}
    wrong = {tuple(PROMPTS[0]): lambda p: True, tuple(PROMPTS[1]): lambda p: False}
    wrong[tuple(PROMPTS[2])] = lambda p: False
    drafter = OracleDrafter(truth, model.config.vocab_size, wrong)
    spec = {"method": "ngram", "num_draft_tokens": 4, "width_policy": "cost"}
    llm = LLM(model, speculative=spec, drafter=drafter, **SHAPES)
    llm.runner.widths.curve = _curve(1.0, {1: 1.4, 2: 1.6, 4: 2.0})
    real, nums = steps.verify_step, []
    monkeypatch.setattr(steps, "verify_step", lambda *a, **kw: nums.append(a[4]) or real(*a, **kw))
    resting, schedule = [], llm.scheduler.schedule

    def spy():
        resting.append(schedule())
        return resting[-1]

    monkeypatch.setattr(llm.scheduler, "schedule", spy)
    params = [GREEDY, GREEDY, GREEDY, penalised]
    outs = llm.generate([*PROMPTS, PROMPTS[2]], params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [*reference, want]
    assert llm.scheduler.draft_policy.min_acceptance == pytest.approx(0.4)  # the break-even
    rested = [o for o in resting if outs[0].request_id in o.resting]
    assert len(rested) >= 10  # the failing request rests below the break-even (0.4) ...
    windows = [n for n in map(np.asarray, nums) if n[1] == 4]
    assert len(windows) >= 6 and all(n[0] > 0 for n in windows)  # ... and drafts in them
    assert all(n[3] == 0 for n in map(np.asarray, nums))  # the penalised row never drafts
    assert all(outs[3].request_id not in o.resting for o in resting)


@pytest.mark.parametrize("wrong", [False, True])
def test_steps_refresh_the_curve(model, reference, wrong):
    """Drafts always accepted: the windows the run used are measured live; always rejected:
    the requests rest, and the plain steps are measured."""
    llm = _engine(model, reference, lambda p: wrong)
    curve = llm.runner.widths.curve
    assert not curve.seconds  # only profiled so far
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(s > 0 and rows == 4 for (w, rows), s in curve.seconds.items())
    if wrong:
        assert (0, 4) in curve.seconds
    else:
        assert any(w > 0 for w, _ in curve.seconds)


def test_bad_width_policy(model):
    with pytest.raises(ValueError, match="width_policy must be one of"):
        LLM(model, speculative={"method": "ngram", "width_policy": "greedy"}, **SHAPES)


def test_draft_model_scores_resting_drafts_in_its_lag_pass(model, monkeypatch):
    """A draft model's resting rows run no draft step; the pass that writes their lag (every
    16 tokens) scores the draft's greedy token at each lag position but the last against the
    token that followed. Those shadows, which the scheduler records, equal the no-cache
    forward's argmax agreement with the sampled tokens; no probe window runs. The target
    drafts for itself, sampled: its greedy token is the sampled one only sometimes."""
    from flax import nnx

    from kimi_linear_jax.model import forward
    from serving.speculative.lag import MAX_LAG

    spec = {"method": "draft_model", "num_draft_tokens": 4, "model": model}
    llm = LLM(model, speculative={**spec, "width_policy": "cost"}, **SHAPES)
    # The profile timed a lag pass of one token (on padding rows: the shadows below are
    # still the forward's, so it wrote nothing of a request's).
    assert llm.runner.widths.lag[4] > 0
    llm.runner.widths.curve = _curve(1.0, {1: 10.0, 2: 10.0, 4: 10.0})  # no window pays
    recorded = collections.defaultdict(list)
    update = llm.scheduler.update

    def spy(output, sampled, num_drafts=None, shadows=None):
        for rid, hits in (shadows or {}).items():
            recorded[rid] += hits
        return update(output, sampled, num_drafts, shadows)

    monkeypatch.setattr(llm.scheduler, "update", spy)
    params = SamplingParams(temperature=0.1, seed=1, max_tokens=36, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.metrics()["spec_draft_tokens"] == 0
    graphdef, state, every = *nnx.split(model), []
    for prompt, out in zip(PROMPTS, outs, strict=True):
        tokens = prompt + out.token_ids
        logits = forward(graphdef, state, jnp.asarray([tokens], jnp.int32))[0]
        greedy = np.asarray(jnp.argmax(logits, axis=-1))
        # The decode steps consume positions P .. P + 34 (P: the first sampled token); each
        # full lag of 16 is written, scoring its first 15 positions.
        p, want = len(prompt), []
        for start in range(p, p + 35 - MAX_LAG + 1, MAX_LAG):
            want += [bool(greedy[q] == tokens[q + 1]) for q in range(start, start + MAX_LAG - 1)]
        assert recorded[out.request_id] == want
        every += want
    assert 0 < sum(every) < len(every)  # both outcomes occur


def _tracked_engine(model):
    """A cost-aware oracle engine with the prefix cache on, drafts wrong at every third
    position, and two prompts that pass the track point at 64 in the block tables the profile
    compiles (16 pages of 8): (engine, prompts, plain greedy outputs)."""
    shapes = {**SHAPES, "page_size": 8}
    prompts = [list(range(1, 31)), list(range(40, 75))]
    reference = [o.token_ids for o in LLM(model, **shapes).generate(prompts, GREEDY)]
    truth = {tuple(p): r for p, r in zip(prompts, reference, strict=True)}
    drafter = OracleDrafter(truth, model.config.vocab_size, lambda p: p % 3 == 2)
    spec = {"method": "ngram", "num_draft_tokens": 4, "width_policy": "cost"}
    llm = LLM(model, speculative=spec, drafter=drafter, enable_prefix_caching=True, **shapes)
    return llm, prompts, reference


def test_start_up_compiles_the_track_point_windows(model, monkeypatch):
    """With the prefix cache on, a step whose row reaches a track point verifies with the
    snapshot program, the others without: the profile compiles both of every width (and the
    one-token window of a step where only a track point verifies), so serving compiles no
    verify program, and the greedy output stays plain's."""
    import serving.speculative.steps as steps

    llm, prompts, reference = _tracked_engine(model)
    assert llm.track_interval == 64
    real, tracked = steps.verify_step, []

    def spy(*args, **kw):
        tracked.append(kw["track"])
        return real(*args, **kw)

    monkeypatch.setattr(steps, "verify_step", spy)
    compiled = real._cache_size()
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    assert True in tracked and False in tracked
    assert real._cache_size() == compiled


def test_start_up_compiles_the_windows_of_short_rows_at_every_batch_bucket(model, reference):
    """Rows shorter than `MIN_TABLE_WIDTH` pages (max_model_len 40: 10 pages of 4) step with
    a block table of 10 pages: the profile compiles its windows and plain steps at that width,
    so rows ending one by one (the batch going from bucket 4 to 2 to 1) compile none of them
    mid-run. It had compiled them at 16 pages, a program no step ran."""
    import serving.runner as runner
    import serving.speculative.steps as steps

    shapes = {**SHAPES, "batch_buckets": (1, 2, 4), "max_model_len": 40}
    truth = {tuple(p): r for p, r in zip(PROMPTS, reference, strict=True)}
    drafter = OracleDrafter(truth, model.config.vocab_size, lambda p: p % 3 == 2)
    spec = {"method": "ngram", "num_draft_tokens": 4, "width_policy": "cost"}
    llm = LLM(model, speculative=spec, drafter=drafter, **shapes)
    assert llm.runner.buckets.min_width == 10
    compiled = steps.verify_step._cache_size(), runner.decode_steps._cache_size()
    params = [dataclasses.replace(GREEDY, max_tokens=m) for m in (8, 14, 20)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [r[:m] for r, m in zip(reference, (8, 14, 20))]
    assert (steps.verify_step._cache_size(), runner.decode_steps._cache_size()) == compiled


def test_steps_with_a_track_point_do_not_price_their_width(model, monkeypatch):
    """A step where the prefix cache checkpoints a row runs the snapshot's program (dearer
    than the width's, or a one-token window where no row drafted): it leaves the curve as
    it was, and the other steps refresh it."""
    import serving.speculative.steps as steps

    llm, prompts, reference = _tracked_engine(model)
    curve, steps_seen = llm.runner.widths.curve, []
    observe, run = curve.observe, steps.Verifier.run

    def spy_run(self, output, result):
        steps_seen.append([bool(output.track)])
        return run(self, output, result)

    monkeypatch.setattr(curve, "observe", lambda *a: steps_seen[-1].append(a) or observe(*a))
    monkeypatch.setattr(steps.Verifier, "run", spy_run)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == reference
    tracked = [s for s in steps_seen if s[0]]
    assert tracked and all(len(s) == 1 for s in tracked)
    assert all(len(s) == 2 for s in steps_seen if not s[0])


def test_resting_rows_plan_a_track_point_only_where_they_reach_it(model, monkeypatch):
    """A request that rests computes one token a step: only the step that reaches the track
    point at 64 verifies (the one-token window with its snapshot), not each step whose
    reserved window of k + 1 would cross it; the checkpoint it leaves serves a prefix hit."""
    import serving.speculative.steps as steps

    shapes = {**SHAPES, "page_size": 8}
    prompts = [list(range(1, 31)), list(range(40, 75))]
    plain = LLM(model, **shapes)
    reference = [o.token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    truth = {tuple(p): r for p, r in zip(prompts, reference, strict=True)}
    drafter = OracleDrafter(truth, model.config.vocab_size, lambda p: True)
    spec = {"method": "ngram", "num_draft_tokens": 4, "width_policy": "cost"}
    llm = LLM(model, speculative=spec, drafter=drafter, enable_prefix_caching=True, **shapes)
    llm.runner.widths.curve = _curve(1.0, {1: 10.0, 2: 10.0, 4: 10.0})  # no window pays
    real, windows = steps.verify_step, []
    monkeypatch.setattr(steps, "verify_step", lambda *a, **kw: windows.append(kw) or real(*a, **kw))
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    assert len(windows) == 2 and all(kw["track"] for kw in windows)  # one per request
    follow = prompts[0] + reference[0][:40]
    (out,) = llm.generate([follow], GREEDY, use_tqdm=False)
    assert out.num_cached_tokens == 64
    assert out.token_ids == plain.generate([follow], GREEDY, use_tqdm=False)[0].token_ids
