"""Speculative decoding: n-gram, draft model and an oracle against plain decoding; a verify
window's and a draft's price in plain steps; the verify's recurrent commit.

    python -m benchmarks speculative [--only oracle code window commit draft_cost] [--quick]

Greedy, EOS ignored, float32; every speculative run's tokens are compared with plain decoding's
("identical"). decode tok/s = rows (N - 1) / (t(N tokens) - t(1 token)) summed over the
prompts, so prefill and the first token are left out; best of N, the engines taking turns.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import random
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import serving.runner as runner_mod
import serving.speculative.draft_model as draft_mod
import serving.speculative.steps as steps_mod
from benchmarks.harness import Suite, Table, add_ratio, batch_shapes, interleaved, ints, repeats
from kimi_linear_jax import corpus, load_pretrained
from kimi_linear_jax.cache import contiguous_batch, init_cache
from kimi_linear_jax.checkpoint import BUILTIN_DRAFT, BUILTIN_MODEL, read_config, save_pretrained
from kimi_linear_jax.layers import linear
from kimi_linear_jax.model import HashedGraph, KimiLinearForCausalLM, merge
from kimi_linear_jax.presets import preset
from kimi_linear_jax.testing import random_model
from serving.core.sampling import SamplingBatch, SamplingParams
from serving.engine import LLM
from serving.speculative.ngram_table import table_from_corpus
from serving.speculative.oracle import OracleDrafter
from serving.speculative.verify import COMMITS, verify_step

SUITE = Suite("speculative", __doc__)
SUITE.option("--k", type=int, help="draft tokens per window (code: 8; oracle, draft_cost: 4)")
SUITE.option("--max-tokens", type=int, help="new tokens per prompt (code: 128, oracle: 64)")
SUITE.option("--prompts", type=int, help="code: held-out prompts (6)")
SUITE.option("--batch", type=int, default=1, help="code: prompts decoded together")
SUITE.option("--batches", help="oracle: batch sizes (1,8)")
SUITE.option("--rates", default="1,0.8,0.5,0", help="oracle: acceptance rates")
SUITE.option("--min-acceptance", type=float, help="code: speculative min_acceptance")
SUITE.option(
    "--draft-model",
    help="code: a draft checkpoint instead of the built-in one; 'random': the built-in "
    "draft's shapes with random weights (a draft that misses)",
)
SUITE.option("--lookup-k", type=int, help="code, lookup first: lookup drafts (8)")
SUITE.option("--lookup-model-k", type=int, help="code, lookup first: model drafts (2)")
SUITE.option("--corpus", default="stdlib", help="code, ngram+corpus: corpus ('' drops it)")
SUITE.option("--corpus-k", type=int, default=2, help="code, ngram+corpus: corpus drafts")
SUITE.option("--no-draft", action="store_true", help="code: leave the draft-model rows out")

COUNTERS = ("spec_draft_tokens", "spec_accepted_tokens", "spec_verify_steps", "steps")


# ---- shared: held-out prompts and timed generation --------------------------------------------
def held_out_prompts(tokenizer, prompt_len: int, need: int, limit: int) -> list[list[int]]:
    """The first ``prompt_len`` ids of each held-out standard-library file of the built-in
    model's ``data.json`` with at least ``need`` more, at most ``limit`` of them."""
    split = json.load(open(os.path.join(BUILTIN_MODEL, "data.json")))
    paths = (corpus.stdlib_dir() / name for name in split["held_out"])
    ids = (tokenizer.encode(p.read_text(encoding="utf-8")) for p in paths if p.is_file())
    return [x[:prompt_len] for x in ids if len(x) >= prompt_len + need][:limit]


class CallTimer:
    """Seconds inside the wrapped compiled calls (each blocked on), by key."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self._saved: list[tuple[object, str, object]] = []

    def wrap(self, owner, attr: str, key: str) -> None:
        real = getattr(owner, attr)
        self.totals.setdefault(key, 0.0)

        @functools.wraps(real)
        def timed(*a, **kw):
            t0 = time.perf_counter()
            out = jax.block_until_ready(real(*a, **kw))
            self.totals[key] += time.perf_counter() - t0
            return out

        self._saved.append((owner, attr, real))
        setattr(owner, attr, timed)

    def restore(self) -> None:
        for owner, attr, real in reversed(self._saved):
            setattr(owner, attr, real)
        self._saved.clear()


def generate_run(llm: LLM, prompt, n, timer: CallTimer | None = None) -> dict:
    """One ``generate`` of n tokens for a prompt (a list of ids) or a batch (a list of them;
    n may then be a list: each row's own count): wall time, tokens, and the deltas of the
    engine's counters and of ``timer``."""
    batch = isinstance(prompt[0], list)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, seed=0)
    if isinstance(n, list):
        params = [dataclasses.replace(params, max_tokens=m) for m in n]
    else:
        params = dataclasses.replace(params, max_tokens=n)
    before, timed = llm.metrics(), dict(timer.totals) if timer else {}
    t0 = time.perf_counter()
    outs = llm.generate(prompt if batch else [prompt], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = llm.metrics()
    tokens = [o.token_ids for o in outs]
    out = {"wall": wall, "tokens": tokens if batch else tokens[0]}
    out.update({k: after.get(k, 0) - before.get(k, 0) for k in (*COUNTERS, "step_seconds")})
    out.update({k: timer.totals[k] - timed[k] for k in timed})
    return out


def decode_rates(
    engines: dict[str, LLM], prompts: list, n, rounds: int, timer: CallTimer | None = None
) -> dict[str, dict]:
    """Per engine: decode tok/s over the prompts (the fastest 1- and n-token runs of each, the
    engines taking turns prompt by prompt, one untimed round first), the n-token runs' tokens
    and counters summed, ``delta``: each counter of the n-token runs less the 1-token ones, and
    ``round_decode_s``: per timed round, the n-token runs' wall less the 1-token ones' (the
    rounds of all engines ran side by side, so a ratio per round pairs like with like). n: the
    tokens of every row, or a list of each row's of a batch (every batch of that size)."""
    fns = {  # keyed 1 and "n": the n-token runs' n may be a list
        (name, i, key): functools.partial(generate_run, llm, p, m, timer)
        for i, p in enumerate(prompts)
        for name, llm in engines.items()
        for key, m in ((1, 1), ("n", n))
    }
    runs = interleaved(fns, warmup=1, repeats=rounds)
    rows = sum(len(p) if isinstance(p[0], list) else 1 for p in prompts)
    new_tokens = rows * n if isinstance(n, int) else len(prompts) * sum(n)
    out = {}
    for name in engines:
        first = [runs[(name, i, 1)].best_result for i in range(len(prompts))]
        last = [runs[(name, i, "n")].best_result for i in range(len(prompts))]
        keys = [k for k in last[0] if k != "tokens"]
        rec = {k: sum(r[k] for r in last) for k in keys}
        rec["delta"] = {k: rec[k] - sum(r[k] for r in first) for k in keys}
        rec["decode_tok_s"] = (new_tokens - rows) / rec["delta"]["wall"]
        rec["tokens"] = [r["tokens"] for r in last]
        rec["rows"], rec["new_tokens"] = rows, new_tokens
        rec["round_decode_s"] = [
            sum(
                runs[(name, i, "n")].results[r]["wall"] - runs[(name, i, 1)].results[r]["wall"]
                for i in range(len(prompts))
            )
            for r in range(rounds)
        ]
        out[name] = rec
    return out


def acceptance_columns(rec: dict) -> dict:
    """Acceptance (accepted / proposed drafts) and mean accepted length (tokens a row gains per
    verify: accepted drafts + the bonus token) over the n-token runs."""
    drafts, verifies = rec["spec_draft_tokens"], rec["spec_verify_steps"]
    accepted = rec["spec_accepted_tokens"]
    return {
        "acceptance": accepted / drafts if drafts else float("nan"),
        "mean_acc_len": (accepted + verifies) / verifies if verifies else 1.0,
        "calls_per_token": rec["steps"] / rec["new_tokens"],
    }


def _draft_model(name: str):
    """A draft checkpoint's path, or for "random" the built-in draft's shapes with random
    weights: its drafts miss, which is where each kind of window's own acceptance matters."""
    if name != "random":
        return name
    return random_model(read_config(BUILTIN_DRAFT), seed=3)


# ---- code continuation with the built-in models -----------------------------------------------
@SUITE.measure("code")
def code(args) -> Table:
    """Code continuation with the built-in models: plain, plain with async scheduling, n-gram
    (with and without draftless runs), n-gram with the corpus table, draft model, draft model
    with lookup first (fixed widths with and without draftless runs, and cost-aware).

    Prompts: the first 128 tokens of held-out standard-library files (the built-in model's
    ``data.json``), batch 1 by default (``--batch B``: groups of B prompts decoded together).
    speedup against plain decoding, vs_async against plain decoding with async scheduling.
    """
    quick = args.quick
    k = args.k or (2 if quick else 8)
    n = args.max_tokens or (16 if quick else 128)
    count = args.prompts or (1 if quick else 6)
    rounds = repeats(args, 3, 1)
    lookup_k = args.lookup_k or (2 if quick else 8)
    lookup_model_k = args.lookup_model_k or (1 if quick else 2)
    b = args.batch
    shapes = dict(max_num_seqs=b, num_pages=64 * b, dtype="float32")
    knobs = {"num_draft_tokens": k}
    if args.min_acceptance is not None:
        knobs["min_acceptance"] = args.min_acceptance
    ngram = {"method": "ngram", **knobs}
    engines = {
        "plain": LLM(**shapes),
        "plain async": LLM(async_scheduling=True, **shapes),
        "ngram": LLM(speculative=ngram, **shapes),
        "ngram, stepwise": LLM(speculative=ngram, **shapes),
    }
    # Each draftless step its own call.
    engines["ngram, stepwise"].runner.verifier.draftless_runs = False
    k_of = {"plain": 0, "plain async": 0}
    if args.corpus:  # built once and shared: tokenizing the standard library takes seconds
        table = table_from_corpus(args.corpus, engines["plain"].tokenizer)
        spec = {**ngram, "corpus": table, "corpus_num_tokens": args.corpus_k}
        engines["ngram+corpus"] = LLM(speculative=spec, **shapes)
        k_of["ngram+corpus"] = f"{k} / {args.corpus_k}"
    if not args.no_draft:
        draft = {"model": _draft_model(args.draft_model)} if args.draft_model else {}
        engines["draft"] = LLM(speculative={**knobs, "method": "draft_model", **draft}, **shapes)
        hybrid = {**knobs, "method": "draft_model", **draft}
        hybrid.update(num_draft_tokens=lookup_model_k, prompt_lookup_num_tokens=lookup_k)
        engines["draft, lookup first"] = LLM(speculative=hybrid, **shapes)
        # Each step where none drafts its own call (no draftless runs): the baseline of runs.
        engines["draft, lookup first, stepwise"] = LLM(speculative=hybrid, **shapes)
        engines["draft, lookup first, stepwise"].runner.verifier.draftless_runs = False
        # The same with cost-aware widths: lookup windows priced apart from the model's.
        hybrid_cost = {**hybrid, "width_policy": "cost"}
        engines["draft, lookup first, cost"] = LLM(speculative=hybrid_cost, **shapes)
        for name in (
            "draft, lookup first",
            "draft, lookup first, stepwise",
            "draft, lookup first, cost",
        ):
            k_of[name] = f"{lookup_model_k} / {lookup_k}"
    prompts = held_out_prompts(engines["plain"].tokenizer, 128, n, count)
    if b > 1:  # whole groups only
        prompts = [prompts[i : i + b] for i in range(0, len(prompts) - b + 1, b)]
    rates = decode_rates(engines, prompts, n, rounds)
    rows = []
    for name, rec in rates.items():
        row = {"config": name, "k": k_of.get(name, k), "decode_tok_s": rec["decode_tok_s"]}
        row.update(acceptance_columns(rec))
        row["identical"] = rec["tokens"] == rates["plain"]["tokens"]
        rows.append(row)
    add_ratio(rows, "decode_tok_s", rows[0], "speedup")
    add_ratio(rows, "decode_tok_s", rows[1], "vs_async")
    columns = ["config", "k", "decode_tok_s", "speedup", "vs_async", "acceptance"]
    columns += ["mean_acc_len", "calls_per_token", "identical"]
    title = (
        f"code continuation, {rates['plain']['rows']} held-out prompts of 128 tokens, B = {b}, "
        f"{n} new tokens, best of {rounds}"
    )
    meta = {"k": k, "B": b, "max_tokens": n, "draft_model": args.draft_model or "built-in"}
    meta.update(min_acceptance=args.min_acceptance, corpus=args.corpus or "off")
    return Table(title, rows, columns, meta)


# ---- the oracle at controlled acceptance ------------------------------------------------------
def window_wrong_positions(rate: float, k: int, horizon: int, first: int = 1) -> frozenset[int]:
    """Output positions to make wrong so that verify window i accepts
    c_i = floor((i+1) rate k) - floor(i rate k) of its k drafts (mean rate * k). Window i
    starts at s_i (s_0 = ``first``: the prefill emits position 0), its wrong draft sits at
    s_i + c_i (none when c_i = k), and the next window starts at s_i + c_i + 1."""
    target, wrong, s, i = rate * k, set(), first, 0
    while s < horizon:
        c = math.floor((i + 1) * target + 1e-9) - math.floor(i * target + 1e-9)
        if c < k:
            wrong.add(s + c)
        s, i = s + c + 1, i + 1
    return frozenset(wrong)


def hash_wrong(rate: float, seed: int = 0):
    """Every position wrong independently with probability 1 - rate (seeded). Memoised: a
    seeded `random.Random` costs 0.1 ms, which a speculative engine's every step (its
    shadow) paid against plain's, 1% of a B = 1 step."""

    @functools.cache
    def wrong(position: int) -> bool:
        return random.Random(seed * 1_000_003 + position).random() >= rate

    return wrong


@SUITE.measure("oracle")
def oracle(args) -> list[Table]:
    """An oracle drafter at controlled acceptance, the n-gram and a draft model against plain
    decoding, on the ``small`` preset with random weights, and where a step's time goes.

    The oracle replays plain decoding's continuation with wrong tokens placed so that each
    window accepts A% of its k drafts ("iid": each draft wrong with probability 1 - A, which
    also discards the drafts after it). The n-gram runs on prompts of a 4-token pattern
    repeated, against plain decoding of the same prompts (random weights do not continue the
    pattern). The draft is a random ``tiny`` model. Per decode step: device (the compiled
    decode / verify calls), propose (the drafter), host (the rest of ``LLM.step``).
    """
    quick = args.quick
    name = "tiny" if quick else "small"
    prompt_len, n = (16, 24) if quick else (32, args.max_tokens or 64)
    k = args.k or 4
    batches = ints(args.batches or ("1" if quick else "1,8"))
    rates = [float(x) for x in args.rates.split(",") if x.strip()]
    rounds = repeats(args, 2, 1)
    config = preset(name)
    model = random_model(config, seed=0, dtype=jnp.float32)
    draft = random_model(preset("tiny", vocab_size=config.vocab_size), seed=7)
    shapes = batch_shapes(batches, prompt_len, n)
    rng, vocab = np.random.default_rng(0), config.vocab_size
    ordinary = {b: rng.integers(0, vocab, (b, prompt_len)).tolist() for b in batches}
    repetitive = {
        b: [np.tile(p, prompt_len)[:prompt_len].tolist() for p in rng.integers(0, vocab, (b, 4))]
        for b in batches
    }
    timer = CallTimer()
    timer.wrap(runner_mod, "decode_steps", "device")
    timer.wrap(steps_mod, "verify_step", "device")
    timer.wrap(steps_mod, "decode_until_recurs", "device")
    try:
        baseline = LLM(model, **shapes)
        truth = {}
        for b in batches:
            for prompt, tokens in zip(
                ordinary[b], generate_run(baseline, ordinary[b], n)["tokens"]
            ):
                truth[tuple(prompt)] = tokens
        spec = {"method": "ngram", "num_draft_tokens": k}
        group = {"baseline": baseline}
        for rate, iid in [(r, False) for r in rates] + [(0.8, True)]:
            wrong = (
                hash_wrong(rate) if iid else window_wrong_positions(rate, k, n + k + 1).__contains__
            )
            drafter = OracleDrafter(truth, config.vocab_size, wrong)
            label = f"oracle {rate:.0%}" + (" iid" if iid else "")
            group[label] = LLM(model, speculative=spec, drafter=drafter, **shapes)
        dspec = {"method": "draft_model", "model": draft, "num_draft_tokens": k}
        group["draft model (random)"] = LLM(model, speculative=dspec, **shapes)
        rep_group = {"baseline, repetitive": baseline}
        rep_group["ngram, repetitive"] = LLM(model, speculative=spec, **shapes)
        for llm in [*group.values(), *rep_group.values()]:
            if llm.runner.drafter is not None:
                timer.wrap(llm.runner.drafter, "propose", "propose")
        rows = []
        for b in batches:
            for engines, prompts in ((group, ordinary), (rep_group, repetitive)):
                got = decode_rates(engines, [prompts[b]], n, rounds, timer)
                base = None
                for label, rec in got.items():
                    d = rec["delta"]
                    steps = max(d["steps"], 1)
                    row = {"config": label, "B": b, "decode_tok_s": rec["decode_tok_s"]}
                    row.update(acceptance_columns(rec))
                    row["identical"] = rec["tokens"] == next(iter(got.values()))["tokens"]
                    row["ms_per_step"] = 1e3 * d["step_seconds"] / steps
                    row["device_ms"] = 1e3 * d["device"] / steps
                    row["propose_ms"] = 1e3 * d["propose"] / steps
                    row["host_ms"] = row["ms_per_step"] - row["device_ms"] - row["propose_ms"]
                    base = base or row
                    add_ratio([row], "decode_tok_s", base, "vs_baseline")
                    rows.append(row)
    finally:
        timer.restore()
    columns = ["config", "B", "decode_tok_s", "vs_baseline", "acceptance", "mean_acc_len"]
    columns += ["identical"]
    steps = ["config", "B", "ms_per_step", "device_ms", "propose_ms", "host_ms"]
    title = (
        f"{name} preset, random weights, k = {k}, prompt {prompt_len}, N = {n}, best of {rounds}"
    )
    meta = {"preset": name, "k": k, "max_tokens": n, "prompt_len": prompt_len}
    return [
        Table(title, rows, columns, meta),
        Table("per decode step, ms (N-token runs less 1-token runs)", rows, steps),
    ]


# ---- the verify window's price ----------------------------------------------------------------
WIDTHS = (2, 3, 5, 9)


@SUITE.measure("window")
def window(args) -> Table:
    """A verify window's price in plain decode steps by width, on the built-in model at batch 1,
    with ``Linear``'s products of a few rows one row at a time (``ROW_PRODUCTS_UP_TO``, the
    default) and as one product.

    An n-gram engine (k = 8, always drafting, draftless steps one call each) continues a
    held-out prompt; its last decode call and last full-width verify call are captured, and
    each (decode; windows of 2, 3, 5, 9 tokens) is timed until ready, the cache fed back. The
    two settings take turns by round (each recompiles); per call the median.
    """
    rounds, calls = (1, 3) if args.quick else (repeats(args, 4), 25)
    spec = {"method": "ngram", "num_draft_tokens": max(WIDTHS) - 1, "min_acceptance": 0.0}
    llm = LLM(speculative=spec, max_num_seqs=1, num_pages=64, dtype="float32")
    llm.runner.verifier.draftless_runs = False  # so that a plain `decode_steps` call is made
    (prompt,) = held_out_prompts(llm.tokenizer, 128, 128, 1)
    captured, real_v, real_d = {}, steps_mod.verify_step, runner_mod.decode_steps

    def verify(*a, **kw):
        if a[3].shape[1] == max(WIDTHS) - 1:
            captured["verify"] = (a, kw)
        return real_v(*a, **kw)

    def decode(*a, **kw):
        captured["decode"] = (a, kw)
        return real_d(*a, **kw)

    steps_mod.verify_step, runner_mod.decode_steps = verify, decode
    try:
        generate_run(llm, prompt, 128)
    finally:
        steps_mod.verify_step, runner_mod.decode_steps = real_v, real_d
    (va, vk), (da, dk) = captured["verify"], captured["decode"]
    todo = {"decode": (real_d, list(da), dk, 3)}
    for w in WIDTHS:
        a = list(va)
        a[3], a[4] = np.asarray(va[3])[:, : w - 1], np.minimum(np.asarray(va[4]), w - 1)
        todo[f"window {w}"] = (real_v, a, vk, 5)
    cache = [llm.runner.cache]

    def once(fn, a, kw, at) -> float:
        a = list(a)
        a[at] = cache[0]
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*a, **kw))
        cache[0] = out[-1]
        return time.perf_counter() - t0

    settings = {"one product": 0, "rows": linear.ROW_PRODUCTS_UP_TO}
    times = {(name, s): [] for name in todo for s in settings}
    try:
        for _ in range(rounds):
            for s, limit in settings.items():
                linear.ROW_PRODUCTS_UP_TO = limit
                jax.clear_caches()
                for call in todo.values():
                    for _ in range(3):  # compile, warm
                        once(*call)
                for _ in range(calls):
                    for name, call in todo.items():
                        times[(name, s)].append(once(*call))
    finally:
        linear.ROW_PRODUCTS_UP_TO = settings["rows"]
    med = {key: statistics.median(v) for key, v in times.items()}
    rows = []
    for name in todo:
        one, by_row = med[(name, "one product")], med[(name, "rows")]
        rows.append(
            {
                "call": name,
                "rows_ms": 1e3 * by_row,
                "rows_steps": by_row / med[("decode", "rows")],
                "one_product_ms": 1e3 * one,
                "one_product_steps": one / med[("decode", "one product")],
                "rows_vs_one": by_row / one,
            }
        )
    title = f"built-in model, B = 1; steps = the call over a plain decode step; {rounds} x {calls}"
    meta = {"row_products_up_to": settings["rows"], "rounds": rounds, "calls": calls}
    return Table(title, rows, list(rows[0]), meta)


# ---- the verify's recurrent commit ------------------------------------------------------------
MIB = 2**20


def kept_bytes(config, batch: int, t: int, keep: str) -> int:
    """Bytes of what ``model.verify(keep=...)`` keeps for the commit, abstractly (bf16)."""
    dtype = jnp.bfloat16
    model = nnx.eval_shape(lambda: KimiLinearForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    cache = jax.eval_shape(
        functools.partial(
            init_cache, config, num_slots=batch + 1, num_pages=batch + 1, page_size=64, dtype=dtype
        )
    )
    b = contiguous_batch(batch, 64, 64, lengths=np.full(batch, t))
    ids = jax.ShapeDtypeStruct((batch, t), jnp.int32)
    kept = jax.eval_shape(
        lambda state, ids, cache: merge(graphdef, state).verify(ids, cache, b, keep=keep)[2],
        state,
        ids,
        cache,
    )
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(kept))


@SUITE.measure("commit")
def commit(args) -> list[Table]:
    """The verify's recurrent commit: replay (keep each step's inputs, re-run the accepted
    steps) against gather (keep each step's state, pick one), k = 4.

    Memory at the release's shapes (``kimi-linear-48b-a3b``, bf16, fp32 state) from the
    abstract model, beside a plain decode step's; and ``verify_step`` with each commit on the
    ``small`` shapes (f32, 64 cached tokens) here, best of N taking turns, with XLA's temp
    bytes of each compiled step.
    """
    k = args.k or 4
    batches = [1] if args.quick else [1, 8, 32]
    release = preset("kimi-linear-48b-a3b")
    memory = []
    for b in batches:
        decode = kept_bytes(release, b, 1, "states")
        gather, replay = (kept_bytes(release, b, k + 1, keep) for keep in ("states", "inputs"))
        memory.append(
            dict(batch=b, decode_MiB=decode / MIB, gather_MiB=gather / MIB)
            | dict(replay_MiB=replay / MIB, gather_over_replay=gather / replay)
        )
    config = preset("tiny" if args.quick else "small")
    graphdef, params = nnx.split(random_model(config))
    graphdef = HashedGraph(graphdef)
    timing = []
    for b in batches:
        cache = init_cache(
            config, num_slots=b + 1, num_pages=b * 2 + 1, page_size=64, dtype=jnp.float32
        )
        batch = contiguous_batch(b, 128, 64, start=np.full(b, 64), lengths=np.ones(b))
        sampling = SamplingBatch.from_params(
            [SamplingParams(temperature=0, seed=0)] * b, [0] * b, b
        )
        rng = np.random.default_rng(0)
        drafts = jnp.asarray(rng.integers(0, config.vocab_size, (b, k)), jnp.int32)
        zeros, none = jnp.zeros((b, 1), jnp.int32), jnp.full(b, -1, jnp.int32)
        base = (jnp.ones(b, jnp.int32), drafts, jnp.full(b, k, jnp.int32), cache, batch, sampling)
        base += (zeros, zeros.astype(bool), none, none)
        calls, temp = {}, {}
        for c in COMMITS:
            state = [graphdef, *jax.tree.map(jnp.copy, (params, *base))]
            lowered = verify_step.lower(*state, mode="greedy", commit=c)
            temp[c] = lowered.compile().memory_analysis().temp_size_in_bytes

            def call(state=state, c=c):
                out, state[5] = verify_step(*state, mode="greedy", commit=c)  # cache donated
                return out

            calls[c] = call
        runs = interleaved(calls, warmup=1, repeats=repeats(args, 5, 2), keep=False)
        timing.append(
            dict(batch=b, gather_ms=runs["gather"].best * 1e3, replay_ms=runs["replay"].best * 1e3)
            | dict(replay_over_gather=runs["replay"].best / runs["gather"].best)
            | dict(gather_temp_MiB=temp["gather"] / MIB, replay_temp_MiB=temp["replay"] / MIB)
        )
    return [
        Table(f"kept for the commit, kimi-linear-48b-a3b, k = {k}", memory, list(memory[0])),
        Table(
            f"verify_step, {'tiny' if args.quick else 'small'} shapes, f32", timing, list(timing[0])
        ),
    ]


# ---- the draft model's price ------------------------------------------------------------------
# A draft shape beside the shipped one (`pycode-draft`: 2 MLA layers, dense MLPs, width 128),
# as overrides of its preset: one MLA layer alone (random weights: a step's price does not
# depend on them).
CANDIDATES = {
    "1 MLA layer": dict(num_hidden_layers=1, full_attn_layers=(1,), first_k_dense_replace=1),
}
DRAFT_CALLS = [
    (runner_mod, "decode_steps", "plain"),
    (steps_mod, "verify_step", "verify"),
    (draft_mod, "draft_steps", "draft"),
    (draft_mod, "commit_window", "rollback"),
]


@SUITE.measure("draft_cost")
def draft_cost(args) -> Table:
    """What a draft-model window costs in plain decode steps of the built-in model, for the
    shipped draft and a one-layer one, and from that price the best speed-up any acceptance
    could give and the acceptance 1.5x needs.

    Each draft runs in an engine that drafts every step (``min_acceptance`` 0) continuing a
    held-out prompt; a plain engine continues the same prompt; the engines take turns. The
    compiled calls are timed until ready: the draft's k + 1 fused steps, the verify, the
    draft's rollback, a plain decode step (per call the median, per engine the best round).
    Window price P = (draft + verify + rollback) / plain step; speed-up (1 + a k) / P at
    acceptance a, so at most (1 + k) / P, and 1.5x needs a >= (1.5 P - 1) / k. Host work
    between calls is left out: a bound.
    """
    k = args.k or 4
    n = args.max_tokens or (16 if args.quick else 48)
    rounds = repeats(args, 3, 1)
    times: dict[tuple[str, str], list[float]] = {}
    current = [""]
    saved = []
    for module, fn, what in DRAFT_CALLS:
        real = getattr(module, fn)

        def timed(*a, _real=real, _what=what, **kw):
            t0 = time.perf_counter()
            out = jax.block_until_ready(_real(*a, **kw))
            times.setdefault((current[0], _what), []).append(time.perf_counter() - t0)
            return out

        saved.append((module, fn, real))
        setattr(module, fn, timed)
    best: dict[tuple[str, str], float] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            shapes = dict(max_num_seqs=1, num_pages=64, dtype="float32")
            spec = {"method": "draft_model", "num_draft_tokens": k, "min_acceptance": 0.0}
            shipped = load_pretrained(BUILTIN_DRAFT, dtype="float32")
            engines = {"plain": (LLM(**shapes), 0)}
            engines["pycode-draft (shipped)"] = (LLM(speculative=spec, **shapes), shipped)
            for name, overrides in CANDIDATES.items():
                path = os.path.join(tmp, name.replace(" ", "_"))
                model = random_model(preset("pycode-draft", **overrides))
                save_pretrained(model, path)
                engines[name] = (LLM(speculative={**spec, "model": path}, **shapes), model)
            (prompt,) = held_out_prompts(engines["plain"][0].tokenizer, 128, n, 1)
            for llm, _ in engines.values():  # compile
                generate_run(llm, prompt, n)
            for _ in range(rounds):
                for name, (llm, _) in engines.items():
                    times.clear()
                    current[0] = name
                    generate_run(llm, prompt, n)
                    for key, ts in times.items():
                        best[key] = min(best.get(key, float("inf")), statistics.median(ts))
    finally:
        for module, fn, real in saved:
            setattr(module, fn, real)
    plain = best[("plain", "plain")]
    rows = []
    for name, (_, model) in engines.items():
        if name == "plain":
            continue
        parts = {w: best.get((name, w), 0.0) for w in ("draft", "verify", "rollback")}
        price = sum(parts.values()) / plain
        params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        row = {"draft": name, "params": params, "k": k}
        row.update({f"{w}_ms": 1e3 * t for w, t in parts.items()})
        row.update(plain_ms=1e3 * plain, window_steps=price, ceiling=(1 + k) / price)
        row["acceptance_for_1.5x"] = (1.5 * price - 1) / k
        rows.append(row)
    title = f"built-in model, B = 1, k = {k}; window_steps = window / plain step, best of {rounds}"
    return Table(title, rows, list(rows[0]), {"k": k, "max_tokens": n})
