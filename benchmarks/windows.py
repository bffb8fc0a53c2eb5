"""Verify window shapes: fixed chain widths, cost-aware widths and draft trees, against plain
decoding in the same run.

    python -m benchmarks windows [--only oracle code] [--quick]

oracle: the ``small`` preset with random weights and an oracle drafter that replays plain
decoding's continuation, each draft wrong independently with probability 1 - A (so A is the
per-draft acceptance), at several A: plain, a fixed k of each candidate width and cost-aware
widths over the same candidates. Each prompt's wrong positions are drawn apart (seeded by its
row), and B = 1 runs ``--rows`` prompts one after another: one draw of 64 positions, shared by
a batch's rows, is far from A (at A = 0.5 the second draft of a window was accepted after the
first at 22%), and a fixed k chosen after the fact would win on that draw alone.
``--open C`` sends C prompts in one generate through B slots instead: a row that ends takes the
next prompt, a server's regime, where tokens per second is what counts. A closed batch ends
with its slowest row, and a wider window's tokens vary more from row to row: at A = 0.9, B = 8
fixed k = 4 beat k = 8 closed and lost to it open. ``--spread`` (with ``--open``) draws each
prompt's new tokens from N/4..N: with N for all, plain's rows end on one step and its next
prompts prefill together, where a speculating engine's rows end apart and prefill one by one.
code: the built-in model and its draft on held-out code.
Greedy, EOS ignored; every run's tokens are compared with plain decoding's ("identical");
speedup = decode tok/s over plain's, each engine's fastest round; paired_speedup = the median
over rounds of plain's decode time over the engine's in the same round (the engines take turns
prompt by prompt, so a round's pair shares the machine's state; this judge separated 1-2% where
best-of-each did not). A cost-aware row's paired_vs_fixed is its paired speed over the fixed
width it does worst against (worst_fixed): 1 or more means at least every fixed k.
"""

from __future__ import annotations

import statistics

import numpy as np

from benchmarks.harness import Suite, Table, add_ratio, batch_shapes, ints, repeats
from benchmarks.speculative import (
    acceptance_columns,
    decode_rates,
    generate_run,
    hash_wrong,
    held_out_prompts,
)
from kimi_linear_jax.presets import preset
from kimi_linear_jax.testing import random_model
from serving.engine import LLM
from serving.speculative.oracle import OracleDrafter
from serving.speculative.widths import candidate_widths

SUITE = Suite("windows", __doc__)
SUITE.option("--k", type=int, help="the most drafts per window (oracle: 8, code: 8)")
SUITE.option("--max-tokens", type=int, help="new tokens per prompt (oracle: 64, code: 128)")
SUITE.option("--batches", help="batch sizes (1,8)")
SUITE.option("--rates", default="0,0.25,0.5,0.75,0.9,1", help="oracle: per-draft acceptance")
SUITE.option("--prompts", type=int, help="code: held-out prompts (6)")
SUITE.option("--rows", type=int, help="oracle: prompts per batch size, in batches of B (8)")
SUITE.option("--open", type=int, help="oracle: this many prompts in one generate, through B slots")
SUITE.option(
    "--spread",
    action="store_true",
    help="oracle, with --open: each prompt's new tokens drawn from N/4..N, not N for all",
)


def _paired(rounds: list[float], base: list[float]) -> float:
    """The median over rounds of base's decode time over this row's: its speed over base's,
    each round a pair run side by side (a slow spell of the machine hits both alike)."""
    return statistics.median(b / r for r, b in zip(rounds, base, strict=True))


def _cost_row(rows: list[dict]) -> None:
    """Give each cost-aware row ("<drafter> cost ...") its speed over the fastest fixed
    width of the same drafter ("<drafter> fixed ...") in the same rounds (``vs_best_fixed``:
    best of each), and ``paired_vs_fixed``: the least, over the fixed widths, of its paired
    speed over that width (``worst_fixed``), so 1 or more is "at least every fixed k"."""
    for r in rows:
        drafter, _, rest = r["config"].partition(" ")
        if not rest.startswith("cost"):
            continue
        fixed = [f for f in rows if f["config"].startswith(f"{drafter} fixed")]
        if fixed:
            best = max(fixed, key=lambda f: f["decode_tok_s"])
            r["vs_best_fixed"] = r["decode_tok_s"] / best["decode_tok_s"]
            r["best_fixed"] = best["config"]
            paired = {f["config"]: _paired(r["round_decode_s"], f["round_decode_s"]) for f in fixed}
            r["worst_fixed"] = min(paired, key=paired.get)
            r["paired_vs_fixed"] = paired[r["worst_fixed"]]


def _table_rows(got: dict, extra: dict) -> list[dict]:
    rows = []
    plain = got["plain"]
    for label, rec in got.items():
        row = {"config": label, **extra, "decode_tok_s": rec["decode_tok_s"]}
        row["round_decode_s"] = rec["round_decode_s"]
        row["paired_speedup"] = _paired(rec["round_decode_s"], plain["round_decode_s"])
        row.update(acceptance_columns(rec))
        verifies = rec["spec_verify_steps"]
        row["tokens_per_verify"] = (
            (rec["spec_accepted_tokens"] + verifies) / verifies if verifies else 1.0
        )
        row["identical"] = rec["tokens"] == plain["tokens"]
        rows.append(row)
    add_ratio(rows, "decode_tok_s", rows[0], "speedup")
    _cost_row(rows)
    return rows


COLUMNS = ["config", "decode_tok_s", "speedup", "paired_speedup", "vs_best_fixed", "best_fixed"]
COLUMNS += ["paired_vs_fixed", "worst_fixed", "acceptance", "tokens_per_verify", "identical"]


@SUITE.measure("oracle")
def oracle(args) -> list[Table]:
    """Fixed widths against cost-aware widths at controlled per-draft acceptance (an oracle
    drafter on the small preset), at each batch size."""
    quick = args.quick
    if args.spread and not args.open:
        raise SystemExit("--spread draws each prompt's length in an open run: give --open C")
    name = "tiny" if quick else "small"
    prompt_len, n = (16, 24) if quick else (32, args.max_tokens or 64)
    k = args.k or (2 if quick else 8)
    batches = ints(args.batches or ("1" if quick else "1,8"))
    rates = [float(x) for x in args.rates.split(",") if x.strip()]
    if quick:
        rates = rates[:2]
    rounds = repeats(args, 3, 1)
    config = preset(name)
    model = random_model(config, seed=0)
    # Open: a row admitted alone prefills at its own size, not padded to B (a prefill of one
    # prompt padded to 8 rows cost what 8 cost, and the staggered ends of speculation paid it
    # for every admission: 19 prefill calls of 0.24 s to plain's 4 at A = 0.5).
    sizes = {2**i for b in batches for i in range(b.bit_length())} if args.open else set()
    shapes = batch_shapes([*batches, *sizes], prompt_len, n + k + 1)  # truth: k + 1 further
    rng = np.random.default_rng(0)
    count = args.open or args.rows or (1 if quick else 8)
    prompts = {}  # per batch size: its batches of prompts, run one after another
    for b in batches:
        rows = rng.integers(0, config.vocab_size, (max(b, count) // b * b, prompt_len)).tolist()
        # Open: every prompt in one generate, so a row that ends takes the next prompt (a
        # server's regime, where tokens per second is the aim); else closed batches of b.
        size = len(rows) if args.open else b
        prompts[b] = [rows[i : i + size] for i in range(0, len(rows), size)]
    # Spread: rows end at their own steps, plain decoding's too, as a server's requests do.
    # With N for all, plain's rows end on one step and the next prompts prefill together,
    # while a speculating engine's end apart and prefill one or two at a time (A = 0.5, B = 8:
    # 21 prefill calls to plain's 4, 13% of its time, its decode steps at plain's speed).
    counts = {  # new tokens: N, or with --spread each row's of the one open batch
        b: rng.integers(n // 4, n + 1, len(prompts[b][0])).tolist() if args.spread else n
        for b in batches
    }
    plain = LLM(model, **shapes)
    truth = {}
    for batch in (batch for b in batches for batch in prompts[b]):
        for p, tokens in zip(batch, generate_run(plain, batch, n + k + 1)["tokens"]):
            truth[tuple(p)] = tokens
    seeds = {p: i for i, p in enumerate(truth)}  # each prompt's wrong positions drawn apart
    tables = []
    for b in batches:
        rows = []
        for rate in rates:
            wrong = {p: hash_wrong(rate, seed) for p, seed in seeds.items()}
            engines = {"plain": plain}
            for w in candidate_widths(k):
                fixed = _oracle_llm(model, truth, wrong, w, "fixed", shapes)
                engines[f"oracle fixed k={w}"] = fixed
            engines[f"oracle cost k<={k}"] = _oracle_llm(model, truth, wrong, k, "cost", shapes)
            got = decode_rates(engines, prompts[b], counts[b], rounds)
            rows += _table_rows(got, {"A": rate, "B": b})
        title = f"{name} preset, random weights, oracle drafts, B = {b}, N = {n}"
        sent = sum(len(batch) for batch in prompts[b])
        title += f", {sent} prompts {'through B slots' if args.open else 'in batches of B'}"
        title += " (N/4..N tokens each)" if args.spread else ""
        title += f", {rounds} paired rounds"
        tables.append(Table(title, rows, ["A", "B", *COLUMNS], {"k": k, "B": b, "N": n}))
    return tables


def _oracle_llm(model, truth, wrong, k: int, policy: str, shapes) -> LLM:
    # min_acceptance 0 for the fixed widths: they draft every step, the width's own price.
    spec = {"method": "ngram", "num_draft_tokens": k, "width_policy": policy, "min_acceptance": 0}
    drafter = OracleDrafter(truth, model.config.vocab_size, wrong)
    return LLM(model, speculative=spec, drafter=drafter, **shapes)


@SUITE.measure("code")
def code(args) -> Table:
    """The built-in model on held-out code: plain, the draft model and the n-gram as chains
    of a fixed k, with cost-aware widths (k the most) and as trees of k nodes."""
    quick = args.quick
    k = args.k or (2 if quick else 8)
    n = args.max_tokens or (16 if quick else 128)
    count = args.prompts or (1 if quick else 6)
    rounds = repeats(args, 3, 1)
    batches = ints(args.batches or "1")
    tables_rows = []
    for b in batches:
        shapes = dict(max_num_seqs=b, num_pages=64 * b, dtype="float32")
        engines = {"plain": LLM(**shapes)}
        for method, topk in (("draft_model", 2), ("ngram", 3)):
            for policy in ("fixed", "cost"):
                spec = {"method": method, "num_draft_tokens": k, "width_policy": policy}
                engines[f"{method} {policy}"] = LLM(speculative=spec, **shapes)
            tree = {"method": method, "num_draft_tokens": k, "topk": topk}
            engines[f"{method} tree k={k} topk={topk}"] = LLM(speculative=tree, **shapes)
        prompts = held_out_prompts(engines["plain"].tokenizer, 128, n, count)
        if b > 1:
            prompts = [prompts[i : i + b] for i in range(0, len(prompts) - b + 1, b)]
        got = decode_rates(engines, prompts, n, rounds)
        tables_rows += _table_rows(got, {"B": b})
    title = f"built-in model, held-out code, {count} prompts of 128 tokens, k = {k}, {n} new tokens"
    title += f", {rounds} paired rounds"
    return Table(title, tables_rows, ["B", *COLUMNS], {"k": k, "N": n})
