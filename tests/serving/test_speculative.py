"""Speculative decoding: greedy output equals plain greedy token for token with every drafter
(oracle with injected errors, n-gram, a draft model; also at dcp 4), penalised rows do not
speculate, the committed recurrent state equals plain decoding of the accepted tokens (and
drifts without the commit), rejection sampling keeps the target law at every emitted position,
pages past the accepted tokens come back after each verify, and the tracking-point index math.

Engines share the shapes of test_engine.py so the jitted steps compile once per shape.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_linear_jax.cache import Batch, init_cache
from kimi_linear_jax.model import decode_step, prefill_step
from kimi_linear_jax.presets import preset
from kimi_linear_jax.testing import random_model
from serving.core.sampling import SamplingBatch, SamplingParams
from serving.core.track import (
    TrackPoint,
    can_track,
    checkpoint_grid,
    resolve_track_interval,
    track_point,
)
from serving.engine import LLM
from serving.speculative.ngram import ngram_lookup, ngram_lookup_reference
from serving.speculative.oracle import OracleDrafter
from serving.speculative.verify import accept, target_probs, verify_step

PROMPTS = [list(range(1, 6)), list(range(10, 30)), list(range(40, 51))]
K = 4
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SHAPES = dict(
    num_pages=15,
    page_size=4,
    max_num_seqs=4,
    batch_buckets=(4,),
    token_buckets=(64,),
    max_num_batched_tokens=64,
    chunk_size=16,
)


@pytest.fixture(scope="module")
def model():
    return random_model(preset("tiny"))


@pytest.fixture(scope="module")
def reference(model):
    return [o.token_ids for o in LLM(model, **SHAPES).generate(PROMPTS, GREEDY, use_tqdm=False)]


def spec_llm(model, drafter=None, **kw):
    spec = kw.pop("speculative", {"method": "ngram", "num_draft_tokens": K})
    return LLM(model, speculative=spec, drafter=drafter, **{**SHAPES, **kw})


def oracle(model, reference, wrong):
    truth = {tuple(p): r for p, r in zip(PROMPTS, reference, strict=True)}
    return OracleDrafter(truth, model.config.vocab_size, wrong)


def assert_drained(llm):
    assert llm.cache.allocator.num_free == llm.cache.allocator.capacity
    llm.cache.allocator.check_invariants()
    assert llm.cache.state_pool.num_free == llm.cache.state_pool.num_slots - 1


# ---- greedy with speculation == greedy without --------------------------------------------------


def _error_at(e: int):
    """A wrong draft at every output position p with p % K == e."""
    return lambda p: p % K == e


ERRORS = {
    "all_accepted": lambda p: False,
    "none_accepted": lambda p: True,
    **{f"error_at_{e}": _error_at(e) for e in range(K)},
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_oracle_greedy_equals_plain(model, reference, case):
    llm = spec_llm(model, oracle(model, reference, ERRORS[case]))
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference
    m = llm.metrics()
    assert m["spec_draft_tokens"] > 0
    if case == "all_accepted":
        assert m["spec_accepted_tokens"] == m["spec_draft_tokens"]
    if case == "none_accepted":
        assert m["spec_accepted_tokens"] == 0
    assert_drained(llm)


def test_oracle_draws_each_prompts_wrong_positions_apart():
    """A mapping of prompts to wrong-position functions: each request's drafts are wrong where
    its own prompt's function says (the benchmark's independent rows), in chains and trees."""
    from serving.core.request import Request

    truth = {(1,): [5, 6, 7, 8], (2,): [5, 6, 7, 8]}
    wrong = {(1,): lambda p: p == 1, (2,): lambda p: p == 2}
    oracle = OracleDrafter(truth, 50, wrong)
    one, two = Request("a", [1], SamplingParams()), Request("b", [2], SamplingParams())
    assert oracle.propose_tokens(one, 4) == [5, 7, 7, 8]
    assert oracle.propose_tokens(two, 4) == [5, 6, 8, 8]
    assert [t for t, _ in oracle.propose_tree_tokens(two, 4, 1)] == [5, 6, 8]  # ends at the wrong


def test_draft_model_preemption_keeps_outputs(model, reference):
    """Preempted requests recompute from scratch in both models: outputs stay plain's, and the
    target drafting for itself still has every draft accepted after the recomputation."""
    spec = {"method": "draft_model", "num_draft_tokens": K, "model": model, "min_acceptance": 0}
    llm = spec_llm(model, speculative=spec)
    outs = llm.generate(PROMPTS + PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference + reference
    m = llm.metrics()
    assert m["preemptions"] > 0
    assert m["spec_accepted_tokens"] == m["spec_draft_tokens"] > 0
    assert_drained(llm)


@pytest.mark.heavy  # 21-26 s; also in make test-py312
def test_bfloat16_model_verifies_wide_windows():
    """A bfloat16 model serves prompts and verify windows of 8+ tokens (both went through a
    product XLA:CPU could not run in bfloat16, and every such request failed), and greedy
    speculation still equals plain decoding: the oracle drafts plain's own tokens, 8 at a time."""
    model = random_model(preset("tiny"), dtype=jnp.bfloat16)
    plain = LLM(model, **SHAPES).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.error for o in plain] == [None] * len(PROMPTS)
    reference = [o.token_ids for o in plain]
    spec = {"method": "ngram", "num_draft_tokens": 8}
    llm = spec_llm(model, oracle(model, reference, ERRORS["all_accepted"]), speculative=spec)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.error for o in outs] == [None] * len(PROMPTS)
    assert [o.token_ids for o in outs] == reference
    m = llm.metrics()
    assert m["spec_accepted_tokens"] == m["spec_draft_tokens"] > 0
    assert_drained(llm)


def test_adaptive_drafting_backs_off_when_drafts_fail(model, reference):
    """Requests whose drafts keep failing stop drafting (one-token windows); output unchanged."""
    never = oracle(model, reference, ERRORS["none_accepted"])
    runs = {}
    for floor in (0.0, 0.25):
        spec = {"method": "ngram", "num_draft_tokens": K, "min_acceptance": floor}
        llm = spec_llm(model, never, speculative=spec)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference
        runs[floor] = llm.metrics()["spec_draft_tokens"]
    assert 0 < runs[0.25] < runs[0.0] / 2, runs


def test_steps_without_drafts_run_the_decode_program(model, reference, monkeypatch):
    """When adaptive drafting stops every row, the step runs the plain decode program, not a
    one-token verify window; a verify program runs only when some row drafts."""
    import serving.runner as runner_module
    import serving.speculative.steps as steps_module

    calls = collections.Counter()

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            if name == "verify":
                assert np.asarray(args[4]).any(), "a verify window without any draft"
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(steps_module, "verify_step", counted("verify", verify_step))
    monkeypatch.setattr(
        runner_module, "decode_steps", counted("decode", runner_module.decode_steps)
    )
    spec = {"method": "ngram", "num_draft_tokens": K, "min_acceptance": 0.25}
    llm = spec_llm(model, oracle(model, reference, ERRORS["none_accepted"]), speculative=spec)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference
    assert calls["verify"] > 0 and calls["decode"] > calls["verify"], calls
    assert_drained(llm)


def test_ngram_greedy_equals_plain(model, reference):
    # A repetitive prompt so that prompt lookup proposes (and some drafts are accepted).
    prompts = PROMPTS + [[5, 6, 7, 8] * 6]
    plain = [o.token_ids for o in LLM(model, **SHAPES).generate(prompts, GREEDY, use_tqdm=False)]
    llm = spec_llm(model)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == plain
    assert llm.metrics()["spec_draft_tokens"] > 0
    assert_drained(llm)


def test_draft_model_greedy_equals_plain(model, reference):
    # Random weights: drafts are almost always rejected, so the rollback runs every step.
    draft = random_model(preset("tiny"), seed=5)
    llm = spec_llm(
        model, speculative={"method": "draft_model", "num_draft_tokens": 3, "model": draft}
    )
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference
    m = llm.metrics()
    assert m["spec_draft_tokens"] > 0 and m["spec_accepted_tokens"] < m["spec_draft_tokens"]
    assert_drained(llm)
    # The draft agreeing with the target (itself as draft) accepts everything it proposes.
    same = spec_llm(
        model, speculative={"method": "draft_model", "num_draft_tokens": 3, "model": model}
    )
    assert [o.token_ids for o in same.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference
    m = same.metrics()
    assert m["spec_accepted_tokens"] == m["spec_draft_tokens"] > 0


def test_draft_model_keeps_in_step_through_draftless_steps(model, reference):
    """In a step in which no row drafts the draft runs no step; the tokens it missed are
    written before it drafts again. The draft (the target itself here) must then have
    consumed every token, so each later window accepts all it drafts."""
    llm = spec_llm(
        model, speculative={"method": "draft_model", "num_draft_tokens": 3, "model": model}
    )
    scheduler = llm.scheduler
    schedule, max_drafts, steps = scheduler.schedule, scheduler._max_drafts, [0]

    def counted_schedule():
        steps[0] += 1
        return schedule()

    def every_other_step(request, room):  # no row drafts in every second step
        return max_drafts(request, room) if steps[0] % 2 else 0

    scheduler.schedule, scheduler._max_drafts = counted_schedule, every_other_step
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference
    m = llm.metrics()
    assert m["spec_accepted_tokens"] == m["spec_draft_tokens"] > 0, m
    assert m["spec_verify_steps"] > m["spec_draft_tokens"] / 3, m  # draftless steps ran
    assert_drained(llm)


ATTENTION_ONLY = dict(num_hidden_layers=2, kda_layers=(), full_attn_layers=(1, 2))


def test_attention_only_draft_needs_no_rollback(model, reference, monkeypatch):
    """A draft of MLA layers alone keeps no per-step states and makes no rollback call: its
    KV past the accepted length is overwritten by the next window. Itself as its own draft it
    still accepts every draft, so it stays in step; as the draft of the KDA model (random
    weights, drafts mostly rejected) the output is still plain decoding's."""
    import serving.speculative.draft_model as draft_mod

    rollbacks = []
    real = draft_mod.commit_window
    monkeypatch.setattr(draft_mod, "commit_window", lambda *a: rollbacks.append(1) or real(*a))
    attn = random_model(preset("tiny", **ATTENTION_ONLY), seed=7)
    assert not attn.has_recurrent_state
    plain = [o.token_ids for o in LLM(attn, **SHAPES).generate(PROMPTS, GREEDY, use_tqdm=False)]
    spec = {"method": "draft_model", "num_draft_tokens": 3, "model": attn}
    same = spec_llm(attn, speculative=spec)
    assert [o.token_ids for o in same.generate(PROMPTS, GREEDY, use_tqdm=False)] == plain
    m = same.metrics()
    assert m["spec_accepted_tokens"] == m["spec_draft_tokens"] > 0, m
    llm = spec_llm(model, speculative=spec)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference
    assert llm.metrics()["spec_draft_tokens"] > 0
    assert rollbacks == []
    assert_drained(same)
    assert_drained(llm)


# 27 s; the default run verifies windows on DCP 4, rejected ones too, in
# test_lookup_first_keeps_the_draft_in_step[4].
@pytest.mark.heavy
def test_dcp4_greedy_equals_plain(model, reference):
    llm = spec_llm(model, oracle(model, reference, ERRORS["error_at_2"]), dcp_size=4)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference
    assert_drained(llm)


def test_pages_after_each_verify_follow_the_accepted_length(model, reference):
    """A verify reserves pages for its whole window; after it a row keeps the pages of the
    tokens it has (prompt + emitted; at most those of the window, as the bonus token's KV comes
    next step): the rejected tail goes back to the free list."""
    llm = spec_llm(model, oracle(model, reference, ERRORS["error_at_1"]))
    tokens_per_page = SHAPES["page_size"]  # dcp 1
    schedule, reserved = llm.scheduler.schedule, {}

    def recording_schedule():
        out = schedule()
        reserved.clear()
        for r in out.decode:  # pages held for the window, before the verify runs
            reserved[r.request_id] = len(llm.cache.allocator.pages(r.request_id))
        return out

    llm.scheduler.schedule = recording_schedule
    prompts = {llm.add_request(p, GREEDY): len(p) for p in PROMPTS}
    verified = released = whole = 0
    while llm.has_unfinished_requests():
        emitted = {o.request_id: len(o.token_ids) for o in llm.step() if not o.finished}
        live = {r.request_id for r in llm.scheduler.running}
        for rid, held in reserved.items():
            if rid not in live:
                continue
            want = min(-(-(prompts[rid] + emitted[rid]) // tokens_per_page), held)
            assert len(llm.cache.allocator.pages(rid)) == want, (rid, emitted[rid], held)
            verified += 1
            released += held > want
        if reserved and set(reserved) == live:  # every page in use is a verified row's
            want = sum(
                min(-(-(prompts[r] + emitted[r]) // tokens_per_page), reserved[r]) for r in live
            )
            assert llm.cache.allocator.num_used == want
            whole += 1
    # Windows were rejected past a page boundary (else there would be nothing to release).
    assert verified > 0 and released > 0 and whole > 0, (verified, released, whole)
    assert_drained(llm)


@pytest.mark.heavy  # 14 s; n-gram on a mesh runs by default in test_engine_parallel
def test_dcp4_ngram_greedy_equals_plain(model):
    prompts = PROMPTS + [[5, 6, 7, 8] * 6]  # repetitive: prompt lookup proposes and is accepted
    plain = [o.token_ids for o in LLM(model, **SHAPES).generate(prompts, GREEDY, use_tqdm=False)]
    # Lookups of one token: they propose after single-token matches too, some of which the
    # random model accepts, so accepted drafts commit at dcp 4 (the default needs two).
    spec = {"method": "ngram", "num_draft_tokens": K, "prompt_lookup_min": 1}
    llm = spec_llm(model, dcp_size=4, speculative=spec)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == plain
    m = llm.metrics()
    assert m["spec_draft_tokens"] > m["spec_accepted_tokens"] > 0, m
    assert_drained(llm)


# 41 s; heavy: the default run's test_lookup_first_keeps_the_draft_in_step[4] runs the same
# draft (the target itself, its caches on the DCP 4 mesh) with every model draft accepted.
@pytest.mark.heavy
def test_dcp4_draft_model_greedy_equals_plain(model, reference):
    """The draft shares the DCP mesh and keeps its own DCP caches: the target as its own draft
    proposes exactly the target's tokens, so everything it drafts is accepted."""
    spec = {"method": "draft_model", "num_draft_tokens": K, "model": model}
    llm = spec_llm(model, speculative=spec, dcp_size=4)
    assert llm.runner.drafter.par.dcp == 4
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference
    m = llm.metrics()
    assert m["spec_accepted_tokens"] == m["spec_draft_tokens"] > 0, m
    assert_drained(llm)


def test_without_commit_output_drifts(model, reference):
    """The same run with the recurrent commit switched off gives other tokens: the tests above
    would see drift."""
    llm = spec_llm(model, oracle(model, reference, ERRORS["error_at_1"]))
    llm.runner.verifier.commit_recurrent = False
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] != reference


def test_sampled_speculation_is_reproducible(model, reference):
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=10, ignore_eos=True)
    runs = [
        [
            o.token_ids
            for o in spec_llm(model, oracle(model, reference, ERRORS["error_at_1"])).generate(
                PROMPTS, params, use_tqdm=False
            )
        ]
        for _ in range(2)
    ]
    assert runs[0] == runs[1] and all(len(t) == 10 for t in runs[0])


def test_penalised_rows_do_not_speculate(model, reference):
    """A penalty's counts change inside a window, so a penalised row verifies one token at a
    time: no drafts for it even from a drafter that knows its exact continuation, and its
    output is the plain engine's; the greedy rows beside it still speculate."""
    pen = SamplingParams(temperature=0, repetition_penalty=1.8, max_tokens=12, ignore_eos=True)
    plain = [o.token_ids for o in LLM(model, **SHAPES).generate(PROMPTS, pen, use_tqdm=False)]
    assert plain != reference  # the penalty changes the greedy output
    knows = OracleDrafter(
        {tuple(p): out for p, out in zip(PROMPTS, plain, strict=True)}, model.config.vocab_size
    )
    llm = spec_llm(model, knows)
    assert [o.token_ids for o in llm.generate(PROMPTS, pen, use_tqdm=False)] == plain
    assert llm.metrics()["spec_draft_tokens"] == 0
    # Mixed with greedy rows (one batch, the penalised mode): only those draft.
    mixed = spec_llm(model, oracle(model, reference, ERRORS["all_accepted"]))
    outs = mixed.generate(PROMPTS, [pen, GREEDY, GREEDY], use_tqdm=False)
    assert [o.token_ids for o in outs] == [plain[0], *reference[1:]]
    m = mixed.metrics()
    assert m["spec_accepted_tokens"] == m["spec_draft_tokens"] > 0
    assert_drained(llm)
    assert_drained(mixed)


# ---- the committed state equals plain decoding of the accepted tokens --------------------------


def _setup(model):
    graphdef, params = nnx.split(model)
    cfg = model.config
    cache = init_cache(cfg, num_slots=3, num_pages=8, page_size=16, dtype=model.dtype)
    prompt = jnp.asarray([PROMPTS[1]], jnp.int32)
    n = prompt.shape[1]
    table = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
    batch = Batch(jnp.asarray([1]), table, jnp.asarray([0]), jnp.asarray([n]))
    logits, cache = prefill_step(graphdef, params, prompt, cache, batch)
    return graphdef, params, cache, table, n, int(jnp.argmax(logits[0]))


def _plain(graphdef, params, cache, table, start, tokens):
    """Decode `tokens` one at a time; return (argmax after each, cache)."""
    out = []
    for i, t in enumerate(tokens):
        batch = Batch(jnp.asarray([1]), table, jnp.asarray([start + i]), jnp.asarray([1]))
        logits, cache = decode_step(graphdef, params, jnp.asarray([[t]]), cache, batch)
        out.append(int(jnp.argmax(logits[0, -1])))
    return out, cache


def _verify(
    graphdef,
    params,
    cache,
    table,
    start,
    last,
    drafts,
    *,
    commit=True,
    track=(-1, -1),
    how="replay",
):
    batch = Batch(jnp.asarray([1]), table, jnp.asarray([start]), jnp.asarray([1]))
    sampling = SamplingBatch.from_params([SamplingParams(temperature=0, seed=0)], [0], 1)
    counts, mask = jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), bool)
    return verify_step(
        graphdef,
        params,
        jnp.asarray([last]),
        jnp.asarray([drafts], jnp.int32),
        jnp.asarray([len(drafts)]),
        cache,
        batch,
        sampling,
        counts,
        mask,
        jnp.asarray([track[0]]),
        jnp.asarray([track[1]]),
        mode="greedy",
        commit_recurrent=commit,
        commit=how,
    )


def _copy(cache):
    return jax.tree.map(jnp.copy, cache)


@pytest.mark.parametrize("how", ["replay", "gather"])
@pytest.mark.parametrize("wrong_at", [0, 2, None])
def test_committed_state_equals_plain_decoding(model, wrong_at, how):
    graphdef, params, cache, table, n, first = _setup(model)
    # The true greedy continuation after `first` (K drafts and the bonus), then drafts with one
    # wrong token.
    seq = [first]
    plain_cache = _copy(cache)
    for i in range(K + 1):
        nxt, plain_cache = _plain(graphdef, params, plain_cache, table, n + i, [seq[-1]])
        seq.append(nxt[0])
    drafts = seq[1 : K + 1]
    if wrong_at is not None:
        drafts[wrong_at] = (drafts[wrong_at] + 1) % model.config.vocab_size
    (tokens, commit_lens, *_), got = _verify(
        graphdef, params, _copy(cache), table, n, first, drafts, how=how
    )
    accepted = K if wrong_at is None else wrong_at
    assert int(commit_lens[0]) == accepted + 1
    assert tokens[0, : accepted + 1].tolist() == seq[1 : accepted + 2]
    _, want = _plain(graphdef, params, _copy(cache), table, n, seq[: accepted + 1])
    for layer, (g, w) in enumerate(zip(got.kda, want.kda, strict=True)):
        for name, a, b in zip(g._fields, g, w, strict=True):
            np.testing.assert_allclose(a[1], b[1], rtol=1e-5, atol=1e-6, err_msg=f"{layer} {name}")
    # Switched off, the slot keeps the end-of-window state: it differs from the accepted one.
    if wrong_at is not None:
        _, drift = _verify(graphdef, params, _copy(cache), table, n, first, drafts, commit=False)
        differs = [not np.allclose(d.S[1], w.S[1], atol=1e-6) for d, w in zip(drift.kda, want.kda)]
        assert all(differs)


@pytest.mark.parametrize("how", ["replay", "gather"])
def test_track_slot_gets_the_state_at_the_point(model, how):
    graphdef, params, cache, table, n, first = _setup(model)
    seq, c = [first], _copy(cache)
    for i in range(K):
        nxt, c = _plain(graphdef, params, c, table, n + i, [seq[-1]])
        seq.append(nxt[0])
    ith = 1  # the state after window step 1, i.e. after n + 2 tokens
    run = dict(track=(2, ith), how=how)
    _, got = _verify(graphdef, params, _copy(cache), table, n, first, seq[1:], **run)
    _, want = _plain(graphdef, params, _copy(cache), table, n, seq[: ith + 1])
    for g, w in zip(got.kda, want.kda, strict=True):
        for a, b in zip(g, w, strict=True):
            np.testing.assert_allclose(a[2], b[1], rtol=1e-5, atol=1e-6)
    # A step past commit_lens is not tracked: slot 2 stays zero.
    drafts = [seq[1] + 1] + seq[2:]  # rejects everything: commit_lens 1
    _, got = _verify(graphdef, params, _copy(cache), table, n, first, drafts, **run)
    assert all(float(jnp.abs(g.S[2]).max()) == 0.0 for g in got.kda)


@pytest.mark.parametrize("accept_all", [False, True])
def test_replay_commit_equals_gather_commit(model, accept_all):
    """The replay commit and its reference leave the same cache, every slot and page, with a
    track point inside the accepted prefix."""
    graphdef, params, cache, table, n, first = _setup(model)
    seq, c = [first], _copy(cache)
    for i in range(K):  # the target's own greedy choices: every draft accepted
        nxt, c = _plain(graphdef, params, c, table, n + i, [seq[-1]])
        seq.append(nxt[0])
    drafts = seq[1:] if accept_all else [(seq[1] + 1) % model.config.vocab_size] + seq[2:]
    caches = {}
    for how in ("gather", "replay"):
        args = (graphdef, params, _copy(cache), table, n, first, drafts)
        (_, commit_lens, *_), caches[how] = _verify(*args, track=(2, 0), how=how)
        assert int(commit_lens[0]) == (K + 1 if accept_all else 1)
    flat = [jax.tree.leaves(caches[h]) for h in ("gather", "replay")]
    for a, b in zip(*flat, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert float(jnp.abs(caches["replay"].kda[0].S[2]).max()) > 0  # the track slot was written


def test_verify_rejects_unknown_commit(model):
    graphdef, params, cache, table, n, first = _setup(model)
    with pytest.raises(ValueError, match="commit must be one of"):
        _verify(graphdef, params, cache, table, n, first, [1] * K, how="copy")


# ---- rejection sampling keeps the target distribution -------------------------------------------

CHI2_CRIT_DF5_P001 = 20.515  # chi-square critical value, 5 degrees of freedom, p = 0.001


@pytest.mark.parametrize(("draft", "top_k"), [(0, 0), (3, 0), (5, 3)])
def test_rejection_sampling_keeps_target_distribution(draft, top_k):
    v, b = 6, 20_000
    logits = jnp.asarray([1.2, 0.3, -0.5, 0.9, 0.0, -1.0], jnp.float32)
    params = SamplingParams(temperature=0.8, top_k=top_k, seed=0)
    sampling = SamplingBatch.from_params([params] * b, [0] * b, b, seeds=range(b))
    window = jnp.broadcast_to(logits, (b, 2, v))
    tokens, accepted = accept(
        window, jnp.full((b, 1), draft), jnp.ones(b, jnp.int32), sampling, sample=True
    )
    p = np.asarray(
        target_probs(
            logits[None],
            sampling._replace(**{f: getattr(sampling, f)[:1] for f in sampling._fields}),
        )[0],
        np.float64,
    )
    counts = np.bincount(np.asarray(tokens[:, 0]), minlength=v)
    support = p > 0
    assert counts[~support].sum() == 0  # nothing outside top-k
    expected = b * p[support]
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_CRIT_DF5_P001, (chi2, counts, expected)
    # Acceptance rate of the draft is its target probability.
    assert (
        abs(float(accepted.mean()) - p[draft]) < 4 * np.sqrt(p[draft] * (1 - p[draft]) / b) + 1e-9
    )


# Per window position a different target (logits) and draft: a bug that reads another position's
# distribution, or skips a draw, changes the law of the emitted tokens.
WINDOW_LOGITS = np.asarray(
    [
        [1.2, 0.3, -0.5, 0.9, 0.0, -1.0],
        [-0.8, 1.5, 0.2, -0.3, 0.7, 0.0],
        [0.1, -1.0, 1.3, 0.4, -0.2, 0.9],
        [0.6, 0.2, -0.4, -1.2, 1.4, 0.3],
    ]
)
WINDOW_TEMPERATURE = 0.8
_accept_sampled = jax.jit(functools.partial(accept, sample=True))


def _numpy_target(logits: np.ndarray, top_k: int) -> np.ndarray:
    """softmax(logits / T) over the top_k largest logits (all when top_k is 0), float64."""
    z = logits / WINDOW_TEMPERATURE
    if top_k:
        z = np.where(z >= np.sort(z)[-top_k], z, -np.inf)
    e = np.exp(z - z.max())
    return e / e.sum()


def _speculative_law(p: np.ndarray, drafts: list[int], n: int) -> dict[tuple[int, int], float]:
    """Exact law of what a row emits, as cells (accepted m, token emitted at position m): the
    law of sampling x_0 ~ p_0, x_1 ~ p_1, ... autoregressively (the targets do not depend on the
    prefix here) and stopping after the first x_m != d_m or after x_n. Cells of probability 0
    (a draft itself at its own rejection, tokens outside top-k) are left out."""
    law, reach = {}, 1.0
    for m in range(n + 1):
        for x in range(p.shape[1]):
            if (m == n or x != drafts[m]) and reach * p[m, x] > 0:
                law[(m, x)] = reach * p[m, x]
        if m < n:
            reach *= p[m, drafts[m]]
    return law


@pytest.mark.parametrize(
    ("drafts", "num_drafts", "top_k"),
    [
        ([0, 1, 2], 3, 0),  # every draft likely: all positions and the bonus are reached often
        ([0, 1, 2], 2, 0),  # a window longer than the drafts: the bonus at position 2
        ([0, 1, 2], 3, 3),  # top-k: only the support counts
        ([3, 4, 0], 3, 3),  # the last draft is outside top-k: always rejected
    ],
)
def test_rejection_sampling_law_of_every_emitted_position(drafts, num_drafts, top_k):
    """The emitted sequence (tokens[:accepted + 1]) has the law of sampling each position from
    its own target; chi-square over every cell of positive probability (df = cells - 1)."""
    b, (t, v) = 40_000, WINDOW_LOGITS.shape
    params = SamplingParams(temperature=WINDOW_TEMPERATURE, top_k=top_k, seed=0)
    sampling = SamplingBatch.from_params([params] * b, [0] * b, b, seeds=range(b))
    window = jnp.broadcast_to(jnp.asarray(WINDOW_LOGITS, jnp.float32), (b, t, v))
    tokens, accepted = _accept_sampled(
        window,
        jnp.broadcast_to(jnp.asarray(drafts, jnp.int32), (b, t - 1)),
        jnp.full(b, num_drafts, jnp.int32),
        sampling,
    )
    tokens, accepted = np.asarray(tokens), np.asarray(accepted)
    assert accepted.min() >= 0 and accepted.max() <= num_drafts
    # What a row emits before its last token is its drafts, in order.
    for m in range(1, num_drafts + 1):
        np.testing.assert_array_equal(tokens[accepted >= m, m - 1], drafts[m - 1])
    p = np.stack([_numpy_target(row, top_k) for row in WINDOW_LOGITS])
    law = _speculative_law(p, drafts, num_drafts)
    observed = collections.Counter(zip(accepted.tolist(), tokens[np.arange(b), accepted].tolist()))
    assert set(observed) <= set(law), sorted(set(observed) - set(law))  # nothing impossible
    cells = sorted(law)
    expected = b * np.asarray([law[c] for c in cells])
    counts = np.asarray([observed[c] for c in cells])
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # Chi-square survival function with len(cells) - 1 degrees of freedom.
    p_value = float(jax.scipy.special.gammaincc((len(cells) - 1) / 2, chi2 / 2))
    assert p_value > 1e-3, (chi2, len(cells) - 1, dict(zip(cells, counts)), expected)


# ---- tracking points and the drafters' host logic -----------------------------------------------


def test_track_point_index_math():
    # Window from 30 to 35 tokens crosses 32: the state after 32 tokens is step 32 - 30 - 1 = 1.
    assert track_point(30, 35, 16) == TrackPoint(True, 32, 1)
    assert can_track(track_point(30, 35, 16), commit_lens=2)
    assert not can_track(track_point(30, 35, 16), commit_lens=1)  # ith >= commit_lens
    # No crossing.
    assert not track_point(33, 40, 16).to_track
    # Landing exactly on the multiple: the last step of the window.
    assert track_point(28, 32, 16) == TrackPoint(True, 32, 3)
    # Crossing two multiples: the later one is tracked.
    assert track_point(14, 50, 16) == TrackPoint(True, 48, 33)
    # Starting exactly on a multiple does not re-track it.
    assert not track_point(32, 40, 16).to_track


def test_track_interval_resolved_on_the_checkpoint_grid():
    assert checkpoint_grid(16, 1) == 64 and checkpoint_grid(64, 8) == 512
    assert checkpoint_grid(128, 1) == 128 and checkpoint_grid(16, 4) == 64
    assert resolve_track_interval(None, 64, 4) == 256
    assert resolve_track_interval(512, 64, 4) == 512
    with pytest.raises(ValueError, match="multiple of the checkpoint grid 256"):
        resolve_track_interval(320, 64, 4)


def test_ngram_lookup():
    assert ngram_lookup([1, 2, 3, 9, 1, 2, 3], 3, max_n=3) == [9, 1, 2]
    assert ngram_lookup([1, 2, 3, 4], 2, max_n=2) == []
    # A tie goes to the latest match; shorter n-grams are tried when longer ones miss.
    assert ngram_lookup([5, 1, 7, 5, 1, 8, 0, 1], 2, max_n=2) == [8, 0]
    # (1, 2) went on with 7 twice and 9 once: 7, then the two occurrences that took it go on
    # voting (1, 2, then a tie of 7 and 9 that the later one wins), then one is left.
    assert ngram_lookup([1, 2, 7, 1, 2, 7, 1, 2, 9, 1, 2], 5, max_n=2) == [7, 1, 2, 9, 1]
    # The draft stops where the voting occurrences run into the end of the tokens.
    assert ngram_lookup([3, 4, 5, 3, 4, 6, 3, 4], 5, max_n=2) == [6, 3, 4]
    assert ngram_lookup([1, 2, 3, 1, 2], 4, max_n=3, min_n=3) == []


def test_ngram_lookup_equals_its_reference():
    rng = np.random.default_rng(0)
    for trial in range(300):
        tokens = rng.integers(0, 2 + trial % 5, size=int(rng.integers(0, 40))).tolist()
        k, max_n = int(rng.integers(1, 9)), int(rng.integers(1, 5))
        min_n = int(rng.integers(1, max_n + 1))
        assert ngram_lookup(tokens, k, max_n, min_n) == ngram_lookup_reference(
            tokens, k, max_n, min_n
        ), (tokens, k, max_n, min_n)


def test_ngram_shadow_is_the_first_draft_of_any_room():
    """The shadow (the lookup's first draft, where a row verifies nothing) reuses the step's
    lookup: it must be the first draft at any room, and not a shorter context's."""
    import types

    from serving.speculative.ngram import NgramDrafter

    rng = np.random.default_rng(1)
    drafter = NgramDrafter(3, 2)
    for trial in range(300):
        tokens = rng.integers(0, 2 + trial % 5, size=int(rng.integers(0, 40))).tolist()
        request = types.SimpleNamespace(request_id=str(trial % 3), all_token_ids=tokens)
        first = ngram_lookup(tokens, 1, 3, 2)
        drafter.propose_tokens(request, int(rng.integers(1, 9)))
        if rng.random() < 0.3:  # the request grew since the lookup: its own lookup
            tokens.append(int(rng.integers(0, 3)))
            first = ngram_lookup(tokens, 1, 3, 2)
        assert drafter.shadow(request) == (first[0] if first else None), tokens


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"method": "eagle"}, "method must be one of"),
        ({"method": "ngram", "num_draft_tokens": 0}, r"num_draft_tokens must be in \[1, 16\]"),
        ({"method": "draft_model"}, "drafts for the built-in default model only"),
        ({"method": "ngram", "k": 3}, r"unknown keys \['k'\]"),
        ({"method": "ngram", "prompt_lookup_num_tokens": 4}, "is for method 'draft_model'"),
        (
            {"method": "draft_model", "prompt_lookup_num_tokens": 17},
            r"prompt_lookup_num_tokens must be in \[0, 16\], got 17",
        ),
    ],
)
def test_bad_speculative_config(model, spec, match):
    with pytest.raises(ValueError, match=match):
        LLM(model, speculative=spec, **SHAPES)


# ---- draft model with lookup first -------------------------------------------------------------

REPETITIVE = [[5, 6, 7, 8] * 6, [9, 3, 9, 3, 9, 4] * 3]


def _record_windows(drafter):
    """Per verify window: (rows that drafted by lookup, drafts per row, accepted lengths)."""
    windows, propose, rollback = [], drafter.propose, drafter.rollback

    def recording_propose(*a, **kw):
        drafts, num = propose(*a, **kw)
        lookup = drafter._window[0] if drafter._window is not None else np.zeros(len(num), bool)
        windows.append([lookup.copy(), np.asarray(num).copy(), None])
        return drafts, num

    def recording_rollback(slots, commit_lens, *track):
        if windows and windows[-1][2] is None:
            windows[-1][2] = np.asarray(commit_lens).copy()
        rollback(slots, commit_lens, *track)

    drafter.propose, drafter.rollback = recording_propose, recording_rollback
    return windows


class _SometimesOracle(OracleDrafter):
    """Lookup stand-in: the true continuation (wrong at output positions 2 mod 4), proposed
    at every other call of each request, the requests out of phase by their first prompt
    token's parity, so that windows mix lookup rows and model rows."""

    def __init__(self, *args):
        super().__init__(*args)
        self.calls = collections.Counter()

    def propose_tokens(self, request, max_drafts):
        self.calls[request.request_id] += 1
        if (self.calls[request.request_id] + request.prompt_token_ids[0]) % 2:
            return []
        return super().propose_tokens(request, max_drafts)


LONGER = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _lookup_spec(draft):
    return {
        "method": "draft_model",
        "num_draft_tokens": 2,
        "prompt_lookup_num_tokens": 5,
        "model": draft,
        "min_acceptance": 0.0,
    }


def _by_source(windows):
    """(lookup drafts, model drafts, accepted model drafts, windows mixing both) of verifies."""
    lookup = model_drafts = accepted = mixed = 0
    for rows, num, commit_lens in windows:
        if commit_lens is None:  # a draftless step: a plain decode
            continue
        lookup += int(num[rows].sum())
        model_drafts += int(num[~rows].sum())
        accepted += int((commit_lens - 1)[~rows & (num > 0)].sum())
        mixed += bool(num[rows].any() and num[~rows].any())
    return lookup, model_drafts, accepted, mixed


# One device is heavy (23 s): DCP 4 runs the same windows with the draft cache spread.
@pytest.mark.parametrize("dcp", [pytest.param(1, marks=pytest.mark.heavy), 4])
def test_lookup_first_keeps_the_draft_in_step(model, dcp):
    """Lookup rows run no draft-model step in their window; after the verify the draft
    writes their accepted tokens. With the target as its own draft every model draft is
    then accepted, which needs the draft's KDA state and MLA KV to hold exactly the accepted
    tokens after each lookup window, also in windows that mix lookup and model rows (and
    with the draft's MLA cache spread over 4 devices)."""
    plain = LLM(model, **SHAPES).generate(PROMPTS, LONGER, use_tqdm=False)
    plain = [o.token_ids for o in plain]
    llm = spec_llm(model, speculative=_lookup_spec(model), dcp_size=dcp)
    assert llm.runner.drafter.par.dcp == dcp
    truth = {tuple(p): r for p, r in zip(PROMPTS, plain, strict=True)}
    llm.runner.drafter.lookup = _SometimesOracle(truth, model.config.vocab_size, _error_at(2))
    windows = _record_windows(llm.runner.drafter)
    assert [o.token_ids for o in llm.generate(PROMPTS, LONGER, use_tqdm=False)] == plain
    lookup, model_drafts, accepted, mixed = _by_source(windows)
    m = llm.metrics()
    assert m["spec_lookup_draft_tokens"] == lookup > 0, m
    assert model_drafts + lookup == m["spec_draft_tokens"]
    assert mixed > 0 and max(int(num.max()) for _, num, _ in windows) == 5
    assert accepted == model_drafts > 0
    assert m["spec_accepted_tokens"] < m["spec_draft_tokens"]  # lookup errors were injected
    assert_drained(llm)


def test_lookup_first_draft_model_greedy_equals_plain(model):
    """The n-gram lookup in front of another draft model: output is plain decoding's."""
    prompts = PROMPTS + REPETITIVE
    plain = LLM(model, **SHAPES).generate(prompts, LONGER, use_tqdm=False)
    llm = spec_llm(model, speculative=_lookup_spec(random_model(preset("tiny"), seed=5)))
    out = llm.generate(prompts, LONGER, use_tqdm=False)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    m = llm.metrics()
    assert 0 < m["spec_lookup_draft_tokens"] < m["spec_draft_tokens"], m
    assert_drained(llm)


def test_lookup_first_model_misses_rest_the_model_alone(model):
    """With lookup first and min_acceptance, the draft model's drafts are judged by their own
    record: a draft model whose drafts miss (random weights) rests, drafting in probes only,
    while the request's lookup windows, which hold, go on each time the lookup proposes (every
    other step). Counted in the request's acceptance, the model's misses rested the whole
    request, and its lookup windows with it."""
    prompt = PROMPTS[1]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    shapes = {**SHAPES, "num_pages": 32}
    plain = LLM(model, **shapes).generate([prompt], params, use_tqdm=False)[0].token_ids
    assert len(plain) == 40
    spec = {**_lookup_spec(random_model(preset("tiny"), seed=5)), "min_acceptance": 0.5}
    llm = spec_llm(model, speculative=spec, num_pages=32)
    drafter = llm.runner.drafter
    drafter.lookup = _SometimesOracle(
        {tuple(prompt): plain}, model.config.vocab_size, ERRORS["all_accepted"]
    )
    rooms, windows, propose = [], [], drafter.propose

    def recording_propose(requests, max_drafts, *a, **kw):
        drafts, num = propose(requests, max_drafts, *a, **kw)
        rooms.append(int(max_drafts[0]))
        windows.append((drafter._window is not None, int(np.asarray(num)[0])))
        return drafts, num

    drafter.propose = recording_propose
    assert llm.generate([prompt], params, use_tqdm=False)[0].token_ids == plain
    model_windows = sum(n > 0 and not looked for looked, n in windows)
    lookup_windows = sum(looked for looked, _ in windows)
    assert min(rooms) > 0, rooms  # the scheduler never rested the request
    assert lookup_windows == len(windows) // 2, windows  # every other step, to the end
    # The model drafted twice (1.0 -> 0.7 -> 0.49 < 0.5 after two misses), then rested.
    assert model_windows == 2 and len(windows) - lookup_windows > 4, windows
    m = llm.metrics()  # every lookup draft is accepted, none of the model's
    assert m["spec_accepted_tokens"] == m["spec_lookup_draft_tokens"] < m["spec_draft_tokens"]
    assert_drained(llm)


def test_resting_rows_lag_and_catch_up(monkeypatch):
    """Rows that rest run no draft step; their tokens are written in one pass when the draft
    drafts for them again, when 16 have gathered (`MAX_LAG`), and when the target checkpoints
    the row's state, since the prefix cache then hands those pages to other requests' drafts.
    An attention-only model drafts for itself: request A always rests, past the checkpoint at
    64 tokens and to its end, and its pages up to 64 must then hold the same latents in the
    draft's cache as in the target's; B extends A's text (a prefix hit at 64, the draft
    reading A's draft KV) and C rests 20 steps, then drafts: every draft is accepted."""
    import serving.speculative.draft_model as draft_mod
    from serving.speculative.lag import MAX_LAG

    widths = []
    real = draft_mod.write_lag
    monkeypatch.setattr(
        draft_mod,
        "write_lag",
        lambda g, p, ids, cache, batch: (
            widths.append((ids.shape[1], max(batch.lengths))) or real(g, p, ids, cache, batch)
        ),
    )
    attn = random_model(preset("tiny", **ATTENTION_ONLY), seed=7)
    shapes = {**SHAPES, "num_pages": 64, "max_num_seqs": 2}
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    a, c = list(range(3, 43)), list(range(50, 80))
    plain = LLM(attn, **shapes)
    spec = {"method": "draft_model", "num_draft_tokens": 3, "model": attn, "min_acceptance": 0}
    llm = LLM(attn, speculative=spec, **shapes)
    assert llm.cache.prefix_cache is not None and llm.track_interval == 64
    max_drafts, calls = llm.scheduler._max_drafts, collections.Counter()

    def rests(request, room):
        calls[request.request_id] += 1
        if request.prompt_token_ids[0] == 3 and len(request.prompt_token_ids) == 40:
            return 0  # A
        if request.prompt_token_ids[0] == 50 and calls[request.request_id] <= 20:
            return 0  # C's first 20 steps
        return max_drafts(request, room)

    llm.scheduler._max_drafts = rests
    first = [o.token_ids for o in llm.generate([a, c], params, use_tqdm=False)]
    assert first == [o.token_ids for o in plain.generate([a, c], params, use_tqdm=False)]
    b = a + first[0][:30]
    # A's pages up to its checkpoint hold the same latents in the draft as in the target.
    hit = llm.cache.prefix_cache.lookup(b)
    llm.cache.prefix_cache.end_step([hit])  # a look only: unlock its checkpoint
    pages = np.asarray(hit.pages)
    assert len(pages) == 16
    for target, draft in zip(llm.runner.cache.mla, llm.runner.drafter.cache.mla, strict=True):
        np.testing.assert_allclose(draft.latent[pages], target.latent[pages], atol=1e-5)
    before = llm.metrics()
    (out,) = llm.generate([b], params, use_tqdm=False)
    assert out.num_cached_tokens == 64
    assert out.token_ids == plain.generate([b], params, use_tqdm=False)[0].token_ids
    m = llm.metrics()
    assert m["spec_accepted_tokens"] == m["spec_draft_tokens"] > before["spec_draft_tokens"], m
    assert max(w for w, _ in widths) == MAX_LAG and (MAX_LAG, MAX_LAG) in widths, widths
    llm.reset_prefix_cache()
    assert_drained(llm)


class _LookupFor(OracleDrafter):
    """Lookup stand-in: the true continuation for the requests whose prompt starts with one of
    `firsts`, nothing for the others."""

    def __init__(self, firsts, *args):
        super().__init__(*args)
        self.firsts = firsts

    def propose_tokens(self, request, max_drafts):
        if request.prompt_token_ids[0] not in self.firsts:
            return []
        return super().propose_tokens(request, max_drafts)


@pytest.mark.heavy  # 68 s; also in make test-py312
def test_kda_draft_snapshots_at_track_points(model):
    """A draft with KDA layers writes its own state into the checkpoint slot where the
    target's verify snapshots a track point, for each kind of row in the window: one that
    drafts with the model (A), one that drafts by lookup (L) and one that rests (R). A prefix
    hit restores that slot into both caches; left unwritten, the draft restarted from a stale
    state and accepted 6 of 67 drafts after a hit instead of all. The target drafts for itself,
    so both caches must hold the same state there, and a request extending A's text, hit at
    64, accepts every draft. (Lookup and model windows are 3 drafts wide alike: fewer
    programs to compile.)"""
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    prompts = {"A": list(range(3, 59)), "L": list(range(60, 116)), "R": list(range(130, 186))}
    shapes = {**SHAPES, "num_pages": 64}
    plain_llm = LLM(model, **shapes)
    plain = plain_llm.generate(list(prompts.values()), params, use_tqdm=False)
    truth = {tuple(p): o.token_ids for p, o in zip(prompts.values(), plain, strict=True)}
    spec = {**_lookup_spec(model), "num_draft_tokens": 3, "prompt_lookup_num_tokens": 3}
    llm = LLM(model, speculative=spec, **shapes)
    assert llm.cache.prefix_cache is not None and llm.track_interval == 64
    llm.runner.drafter.lookup = _LookupFor({60}, truth, model.config.vocab_size, lambda p: False)
    max_drafts = llm.scheduler._max_drafts

    def rests(request, room):
        return 0 if request.prompt_token_ids[0] == 130 else max_drafts(request, room)

    llm.scheduler._max_drafts = rests
    out = llm.generate(list(prompts.values()), params, use_tqdm=False)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    assert llm.metrics()["spec_lookup_draft_tokens"] > 0
    llm.scheduler._max_drafts = max_drafts
    for name, o in zip(prompts, out, strict=True):
        hit = llm.cache.prefix_cache.lookup(prompts[name] + o.token_ids)
        llm.cache.prefix_cache.end_step([hit])  # a look only: unlock its checkpoint
        assert hit.depth == 64 and hit.checkpoint is not None, name
        for target, draft in zip(llm.runner.cache.kda, llm.runner.drafter.cache.kda, strict=True):
            for field, t, d in zip(target._fields, target, draft, strict=True):
                np.testing.assert_allclose(
                    d[hit.checkpoint], t[hit.checkpoint], atol=1e-5, err_msg=f"{name} {field}"
                )
    before = llm.metrics()
    b = prompts["A"] + out[0].token_ids
    (again,) = llm.generate([b], params, use_tqdm=False)
    assert again.num_cached_tokens == 64
    assert again.token_ids == plain_llm.generate([b], params, use_tqdm=False)[0].token_ids
    m = llm.metrics()
    drafted = m["spec_draft_tokens"] - before["spec_draft_tokens"]
    assert m["spec_accepted_tokens"] - before["spec_accepted_tokens"] == drafted > 0
    llm.reset_prefix_cache()
    assert_drained(llm)


# ---- a seed's text does not depend on the batch or on speculating (issue 36, defect 4) -----


def test_a_seed_gives_the_same_text_alone_batched_and_speculating(model):
    """Sampled verify positions are the plain sampler's own draws (its key for that output
    index), so what a seed gives does not depend on the drafts or on the rows beside it."""
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=10, ignore_eos=True)
    mates = [
        SamplingParams(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    ]
    plain = LLM(model, **SHAPES)
    (want,) = plain.generate(PROMPTS[:1], seeded, use_tqdm=False)
    got = plain.generate(PROMPTS, [seeded, *mates], use_tqdm=False)[0]
    assert got.token_ids == want.token_ids
    self_draft = {"method": "draft_model", "num_draft_tokens": K, "model": model}
    for spec in ({"method": "ngram", "num_draft_tokens": K}, {**self_draft, "min_acceptance": 0}):
        llm = spec_llm(model, speculative=spec)
        (alone,) = llm.generate(PROMPTS[:1], seeded, use_tqdm=False)
        batched = llm.generate(PROMPTS, [seeded, *mates], use_tqdm=False)[0]
        assert alone.token_ids == batched.token_ids == want.token_ids, spec["method"]
        m = llm.metrics()
        assert m["spec_draft_tokens"] > 0, spec["method"]
        if spec["method"] == "draft_model":  # the target drafting for itself: draws agree often
            assert m["spec_accepted_tokens"] > 0


def test_logit_bias_holds_inside_verify_windows(model, reference):
    """Issue 36, defect 7: the verify adds the bias at every window position, so a biased
    request speculating (an oracle drafting the unbiased text, n-gram, the target as its own
    draft) gives the plain engine's biased text, greedy and seeded."""
    banned = reference[0][2]
    greedy = dataclasses.replace(GREEDY, logit_bias={banned: -100.0, 3: 1.5})
    seeded = SamplingParams(temperature=0.9, seed=5, max_tokens=10, ignore_eos=True)
    seeded = dataclasses.replace(seeded, logit_bias={banned: -100.0, 11: 3.0})
    params = [greedy, seeded, GREEDY]
    want = [o.token_ids for o in LLM(model, **SHAPES).generate(PROMPTS, params, use_tqdm=False)]
    assert want[0] != reference[0] and banned not in want[0] + want[1]
    assert want[2] == reference[2]
    self_draft = {"method": "draft_model", "num_draft_tokens": K, "model": model}
    engines = [
        spec_llm(model, drafter=oracle(model, reference, ERRORS["all_accepted"])),
        spec_llm(model),
        spec_llm(model, speculative={**self_draft, "min_acceptance": 0}),
    ]
    for llm in engines:
        got = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert got == want
        assert llm.metrics()["spec_draft_tokens"] > 0
        assert_drained(llm)
