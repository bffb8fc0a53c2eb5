"""Sampling on fixed logits against expectations computed independently in numpy."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

from serving.core.sampling import (
    MAX_LOGPROBS,
    SamplingBatch,
    SamplingParams,
    apply_bias,
    apply_penalties,
    resolve_seed,
    sample,
)
from tests.helpers import assert_close

# V = 8. Sorted by logit: ids 0 (2.0), 1 (1.5), 4 (1.0), 7 (0.8), 2 (0.3), 6 (0.0), 3, 5.
LOGITS = np.array([2.0, 1.5, 0.3, -0.5, 1.0, -1.2, 0.0, 0.8], np.float32)
V = LOGITS.size
DRAWS = 8000
# With DRAWS draws a frequency's std is <= 0.0056; 0.03 is over five of them.
FREQ_ATOL = 0.03

sample_jit = jax.jit(sample, static_argnames=("num_top_logprobs",))


def np_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def draw(params: SamplingParams, logits: np.ndarray = LOGITS, n: int = DRAWS) -> np.ndarray:
    """n draws of one request's distribution: n rows, seeds 0..n-1, step 0."""
    batch = SamplingBatch.from_params([params] * n, [0] * n, n, seeds=list(range(n)))
    tokens, _, _ = sample_jit(np.tile(logits, (n, 1)), batch)
    return np.asarray(tokens)


def freqs(tokens: np.ndarray) -> np.ndarray:
    return np.bincount(tokens, minlength=V) / tokens.size


def truncated(probs: np.ndarray, keep: set[int]) -> np.ndarray:
    out = np.where(np.isin(np.arange(V), sorted(keep)), probs, 0.0)
    return out / out.sum()


def nucleus(probs: np.ndarray, top_p: float) -> set[int]:
    """Smallest descending prefix whose mass reaches top_p, by walking the sorted list."""
    kept, mass = set(), 0.0
    for i in np.argsort(-probs):
        if mass >= top_p:
            break
        kept.add(int(i))
        mass += probs[i]
    return kept


def entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


# --- greedy -------------------------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = np.random.default_rng(0).normal(size=(5, 40)).astype(np.float32)
    batch = SamplingBatch.from_params([SamplingParams(temperature=0.0, seed=1)] * 5, [0] * 5, 5)
    tokens, _, _ = sample_jit(logits, batch)
    np.testing.assert_array_equal(np.asarray(tokens), logits.argmax(-1))


def test_greedy_rows_in_mixed_batch():
    logits = np.random.default_rng(1).normal(size=(8, 40)).astype(np.float32) * 0.1
    temps = [0.0, 1.0, 0.0, 2.0, 1e-7, 1.0, 0.0, 0.5]  # 1e-7 is below the greedy threshold
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate(temps)]
    greedy = np.array([t < 1e-5 for t in temps])
    hits = np.zeros(8, int)
    for step in range(20):
        batch = SamplingBatch.from_params(params, [step] * 8, 8)
        tokens = np.asarray(sample_jit(logits, batch)[0])
        np.testing.assert_array_equal(tokens[greedy], logits.argmax(-1)[greedy])
        hits += tokens == logits.argmax(-1)
    # Flat logits: sampled rows leave the argmax most of the time, so the flag really matters.
    assert np.all(hits[~greedy] < 20)


# --- truncation ---------------------------------------------------------------------------------


def test_top_k_only_largest_and_frequencies():
    tokens = draw(SamplingParams(top_k=2))
    assert set(np.unique(tokens)) == {0, 1}
    expected = truncated(np_softmax(LOGITS.astype(np.float64)), {0, 1})
    assert_close(freqs(tokens), expected, atol=FREQ_ATOL, rtol_rms=0.05, name="top_k freqs")


def test_top_p_nucleus_set_and_frequencies():
    probs = np_softmax(LOGITS.astype(np.float64))
    keep = nucleus(probs, 0.7)
    assert keep == {0, 1, 4}  # 0.368 + 0.223 = 0.591 < 0.7 <= 0.591 + 0.135
    tokens = draw(SamplingParams(top_p=0.7))
    assert set(np.unique(tokens)) == keep
    assert_close(freqs(tokens), truncated(probs, keep), atol=FREQ_ATOL, rtol_rms=0.05, name="top_p")


def test_top_k_then_top_p_renormalised():
    probs = np_softmax(LOGITS.astype(np.float64))
    top4 = set(np.argsort(-probs)[:4].tolist())
    keep = nucleus(truncated(probs, top4), 0.8)  # top-p on the top-k-renormalised distribution
    assert keep == {0, 1, 4}
    tokens = draw(SamplingParams(top_k=4, top_p=0.8))
    assert set(np.unique(tokens)) == keep
    assert_close(freqs(tokens), truncated(probs, keep), atol=FREQ_ATOL, rtol_rms=0.05, name="k+p")


def test_min_p_set_and_frequencies():
    probs = np_softmax(LOGITS.astype(np.float64))
    keep = {i for i in range(V) if probs[i] >= 0.25 * probs.max()}
    assert keep == {0, 1, 4, 7}
    tokens = draw(SamplingParams(min_p=0.25))
    assert set(np.unique(tokens)) == keep
    assert_close(freqs(tokens), truncated(probs, keep), atol=FREQ_ATOL, rtol_rms=0.05, name="min_p")


# --- temperature --------------------------------------------------------------------------------


def test_temperature_one_matches_softmax():
    tokens = draw(SamplingParams(temperature=1.0))
    expected = np_softmax(LOGITS.astype(np.float64))
    assert_close(freqs(tokens), expected, atol=FREQ_ATOL, rtol_rms=0.05, name="T=1")


def test_temperature_raises_entropy():
    ents = [entropy(freqs(draw(SamplingParams(temperature=t)))) for t in (0.5, 1.0, 2.0)]
    assert ents[0] < ents[1] < ents[2], ents
    expected = np_softmax(LOGITS.astype(np.float64) / 2.0)
    assert_close(
        freqs(draw(SamplingParams(temperature=2.0))), expected, atol=FREQ_ATOL, rtol_rms=0.05
    )


# --- penalties ----------------------------------------------------------------------------------


def np_penalties(logits, counts, prompt_mask, params):
    out = logits.astype(np.float64).copy()
    for b, p in enumerate(params):
        for v in range(logits.shape[1]):
            if prompt_mask[b, v] or counts[b, v] > 0:
                r = p.repetition_penalty
                out[b, v] = out[b, v] / r if out[b, v] > 0 else out[b, v] * r
            if counts[b, v] > 0:
                out[b, v] -= p.presence_penalty
            out[b, v] -= p.frequency_penalty * counts[b, v]
    return out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(repetition_penalty=0.7),
        SamplingParams(presence_penalty=0.5),
        SamplingParams(presence_penalty=-1.5),
        SamplingParams(frequency_penalty=0.4),
        SamplingParams(repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=-0.2),
    ],
    ids=lambda p: f"r{p.repetition_penalty}_p{p.presence_penalty}_f{p.frequency_penalty}",
)
def test_penalties_match_rule(params):
    rng = np.random.default_rng(2)
    B, Vp = 4, 12
    logits = rng.normal(size=(B, Vp)).astype(np.float32) * 3.0
    counts = rng.integers(0, 4, size=(B, Vp)).astype(np.int32) * (rng.random((B, Vp)) < 0.4)
    prompt = rng.random((B, Vp)) < 0.3
    # Row 3 is plain: the same params, but nothing seen, so it must come back untouched.
    counts[3] = 0
    prompt[3] = False
    rows = [dataclasses.replace(params, seed=i) for i in range(B)]
    batch = SamplingBatch.from_params(rows, [0] * B, B)
    out = jax.jit(apply_penalties)(logits, counts.astype(np.int32), prompt, batch)
    expected = np_penalties(logits, counts, prompt, rows)
    assert_close(out, expected, atol=1e-5, rtol_rms=1e-6, name="penalties")
    np.testing.assert_array_equal(np.asarray(out)[3], logits[3])


def test_neutral_penalties_are_identity():
    logits = np.random.default_rng(3).normal(size=(3, 10)).astype(np.float32)
    counts = np.ones((3, 10), np.int32)
    batch = SamplingBatch.from_params([SamplingParams(seed=0)] * 3, [0] * 3, 3)
    out = apply_penalties(logits, counts, np.ones((3, 10), bool), batch)
    np.testing.assert_array_equal(np.asarray(out), logits)


# --- seeds --------------------------------------------------------------------------------------


def run_request(seed: int, row: int, bucket: int, steps: int, logits: np.ndarray) -> list[int]:
    """One request at `row` of a `bucket`-row batch whose other rows are different requests."""
    rng = np.random.default_rng(seed + 1000 * row + bucket)
    out = []
    for step in range(steps):
        others = [
            SamplingParams(temperature=float(rng.uniform(0.5, 2)), top_k=int(rng.integers(0, 5)))
            for _ in range(bucket - 1)
        ]
        params = others[:row] + [SamplingParams(temperature=1.0)] + others[row:]
        seeds = [int(s) for s in rng.integers(0, 2**31, size=bucket)]
        seeds[row] = seed
        steps_ = [int(s) for s in rng.integers(0, 50, size=bucket)]
        steps_[row] = step
        batch_logits = rng.normal(size=(bucket, logits.size)).astype(np.float32)
        batch_logits[row] = logits
        batch = SamplingBatch.from_params(params, steps_, bucket, seeds=seeds)
        out.append(int(sample_jit(batch_logits, batch)[0][row]))
    return out


@functools.cache
def flat_logits() -> np.ndarray:
    return np.random.default_rng(4).normal(size=64).astype(np.float32) * 0.3


def test_same_seed_same_tokens_in_any_row_or_batch():
    a = run_request(1234, row=0, bucket=4, steps=8, logits=flat_logits())
    b = run_request(1234, row=5, bucket=8, steps=8, logits=flat_logits())
    c = run_request(1234, row=3, bucket=4, steps=8, logits=flat_logits())
    assert a == b == c
    assert len(set(a)) > 1  # the step counter moves the key


def test_different_seeds_differ():
    a = run_request(1234, row=0, bucket=4, steps=8, logits=flat_logits())
    b = run_request(1235, row=0, bucket=4, steps=8, logits=flat_logits())
    assert a != b


def test_large_and_negative_seeds_accepted():
    batch = SamplingBatch.from_params(
        [SamplingParams(), SamplingParams()], [0, 0], 2, seeds=[2**40 + 7, -3]
    )
    assert np.asarray(batch.seed).dtype == np.uint32
    tokens = np.asarray(sample_jit(np.tile(LOGITS, (2, 1)), batch)[0])
    assert np.all((tokens >= 0) & (tokens < V))


# --- logprobs -----------------------------------------------------------------------------------


def test_logprobs_chosen_and_top_n():
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(4, 30)).astype(np.float32) * 2.0
    params = [
        SamplingParams(temperature=0.0, seed=0),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=2.0, top_k=3, seed=2),
        SamplingParams(temperature=0.7, top_p=0.5, min_p=0.1, seed=3),
    ]
    batch = SamplingBatch.from_params(params, [0] * 4, 4)
    tokens, chosen, (ids, values) = sample_jit(logits, batch, num_top_logprobs=5)
    tokens = np.asarray(tokens)
    lp = np_log_softmax(logits.astype(np.float64))
    # Raw logprobs: temperature and truncation do not change them.
    assert_close(chosen, lp[np.arange(4), tokens], atol=1e-5, rtol_rms=1e-6, name="chosen")
    assert ids.shape == values.shape == (4, 5)
    np.testing.assert_array_equal(np.asarray(ids), np.argsort(-lp, axis=-1)[:, :5])
    assert_close(values, np.sort(lp, axis=-1)[:, ::-1][:, :5], atol=1e-5, rtol_rms=1e-6)


def test_top_logprobs_default_width_and_small_vocab():
    batch = SamplingBatch.from_params([SamplingParams(seed=0)], [0], 1)
    _, _, (ids, _) = sample_jit(np.zeros((1, 64), np.float32), batch)
    assert ids.shape == (1, MAX_LOGPROBS)
    _, _, (ids, _) = sample_jit(LOGITS[None], batch)
    assert ids.shape == (1, V)


# --- host side ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", -2),
        ("top_k", 101),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("max_tokens", 0),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logit_bias", {100: 1.0}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {3: -100.5}),
        ("logit_bias", {3: float("inf")}),
        ("logit_bias", ((3, 1.0), (3, 2.0))),
        ("logit_bias", {i: 1.0 for i in range(301)}),
    ],
)
def test_validate_rejects(field, value):
    params = dataclasses.replace(SamplingParams(), **{field: value})
    with pytest.raises(ValueError, match=field):
        params.validate(vocab_size=100)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=1.0, logprobs=20),
        SamplingParams(top_k=100, presence_penalty=2.0, frequency_penalty=-2.0, logprobs=0),
    ],
)
def test_validate_accepts(params):
    params.validate(vocab_size=100)


def test_from_params_pads_and_checks():
    batch = SamplingBatch.from_params(
        [SamplingParams(top_k=-1, seed=5), SamplingParams(top_k=7, temperature=0.5, seed=6)],
        [3, 4],
        4,
    )
    assert all(np.asarray(a).shape == (4,) for a in batch[:-2])
    assert batch.bias_ids.shape == batch.bias_values.shape == (4, 1)
    np.testing.assert_array_equal(np.asarray(batch.top_k), [0, 7, 0, 0])
    np.testing.assert_array_equal(np.asarray(batch.temperature), [1.0, 0.5, 0.0, 0.0])
    np.testing.assert_array_equal(np.asarray(batch.repetition_penalty), [1, 1, 1, 1])
    np.testing.assert_array_equal(np.asarray(batch.step), [3, 4, 0, 0])
    with pytest.raises(ValueError, match="seed"):
        SamplingBatch.from_params([SamplingParams()], [0], 2)
    with pytest.raises(ValueError, match="bucket_size"):
        SamplingBatch.from_params([SamplingParams(seed=1)] * 3, [0] * 3, 2)


def test_resolve_seed():
    assert resolve_seed(SamplingParams(seed=42)) == 42
    drawn = {resolve_seed(SamplingParams()) for _ in range(4)}
    assert all(0 <= s < 2**32 for s in drawn) and len(drawn) > 1


# --- logit_bias ---------------------------------------------------------------------------------


def test_apply_bias_adds_each_rows_entries_only():
    """Against a dense numpy add; the unbiased row and the padding entries stay bit-equal."""
    biases = [{1: 3.0, 5: -2.5}, {}, {0: 100.0, 7: -100.0, 3: 0.25}]
    params = [SamplingParams(seed=0, logit_bias=b) for b in biases]
    batch = SamplingBatch.from_params(params, [0] * 3, 4)
    assert batch.bias_ids.shape == (4, 300)
    logits = np.random.default_rng(0).normal(size=(4, V)).astype(np.float32)
    want = logits.copy()
    for row, bias in enumerate(biases):
        for token, value in bias.items():
            want[row, token] += np.float32(value)
    got = np.asarray(apply_bias(logits, batch))
    np.testing.assert_array_equal(got, want)
    unbiased = SamplingBatch.from_params([SamplingParams(seed=0)], [0], 2)
    assert unbiased.bias_ids.shape == (2, 1)  # no row asks: the arrays stay one entry wide
    np.testing.assert_array_equal(np.asarray(apply_bias(logits[:2], unbiased)), logits[:2])


def test_biased_draws_follow_the_biased_softmax():
    bias = {0: -100.0, 5: 2.0}
    biased = LOGITS + np.array([-100.0, 0, 0, 0, 0, 2.0, 0, 0], np.float32)
    params = SamplingParams(temperature=1.0, logit_bias=bias)
    batch = SamplingBatch.from_params([params] * DRAWS, [0] * DRAWS, DRAWS, seeds=range(DRAWS))
    logits = apply_bias(np.tile(LOGITS, (DRAWS, 1)), batch)
    tokens = np.asarray(sample_jit(logits, batch)[0])
    assert not np.any(tokens == 0)
    assert_close(freqs(tokens), np_softmax(biased), atol=FREQ_ATOL, rtol_rms=0.05, name="biased")


def test_logit_bias_forms_and_json_keys():
    from serving.core.sampling import logit_bias_from_json

    assert SamplingParams(logit_bias={4: 1.5}).logit_bias == ((4, 1.5),)
    assert SamplingParams(logit_bias=[[4, 1.5]]).logit_bias == ((4, 1.5),)
    assert SamplingParams(logit_bias={4: 1}).has_bias and not SamplingParams().has_bias
    assert logit_bias_from_json({"12": -3}) == ((12, -3),)
    for key in ("a", "-1", "1.0", " 1", "\u0663"):  # the last is an Arabic-Indic three
        with pytest.raises(ValueError, match="is not a token id"):
            logit_bias_from_json({key: 1})
    with pytest.raises(ValueError, match="logit_bias must be an object"):
        logit_bias_from_json([[1, 2]])
