"""What a verify window costs in plain decode steps, by width, on the built-in model at batch 1,
with `Linear`'s products of a few rows done one row at a time (`ROW_PRODUCTS_UP_TO`, the
default) and as one product (the limit set to 0), same run.

An n-gram engine (k = 8, always drafting) continues a held-out prompt; the last verify call's
arguments and the last decode call's are captured, then each compiled call (decode, windows of
2, 3, 5 and 9 tokens) is timed until its results are ready, the cache fed back from call to
call. The two product settings take turns in `--rounds` rounds (each recompiles: the setting is
read when a step is traced); per call, the median. "steps" = the call's time over the plain
decode step's time in the same setting.

A second table (row products on) times the calls as a speculative engine runs them: a decode
step and a window taking turns, against each call repeated back to back. Taking turns makes
both slower here (the other program's buffers push this one's weights out of the caches), so
the price of a window in an engine is above the back-to-back figure.

Run: ``python benchmarks/verify_window.py [--rounds 4] [--calls 25]`` (about a minute and a
half).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from code_speculation import prompts_from_held_out  # noqa: E402
from common import print_table, serving_heap, write_json  # noqa: E402

import serving.runner as runner_mod  # noqa: E402
import serving.speculative.steps as steps_mod  # noqa: E402
from kimi_linear_jax.layers import linear  # noqa: E402
from serving.engine import LLM  # noqa: E402
from serving.sampling import SamplingParams  # noqa: E402

WIDTHS = (2, 3, 5, 9)


def capture(llm: LLM, prompt: list[int]) -> dict:
    """The runner's last decode call and last full-width verify call (args, kwargs)."""
    captured, real_v, real_d = {}, steps_mod.verify_step, runner_mod.decode_steps

    def verify(*args, **kwargs):
        if args[3].shape[1] == max(WIDTHS) - 1:
            captured["verify"] = (args, kwargs)
        return real_v(*args, **kwargs)

    def decode(*args, **kwargs):
        captured["decode"] = (args, kwargs)
        return real_d(*args, **kwargs)

    steps_mod.verify_step, runner_mod.decode_steps = verify, decode
    try:
        params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
        llm.generate([prompt], params, use_tqdm=False)
    finally:
        steps_mod.verify_step, runner_mod.decode_steps = real_v, real_d
    return captured


def calls(captured: dict) -> dict:
    """name -> (function, args, kwargs, index of the cache argument)."""
    (va, vk), (da, dk) = captured["verify"], captured["decode"]
    out = {"decode": (runner_mod.decode_steps, list(da), dk, 3)}
    for w in WIDTHS:
        args = list(va)
        args[3] = np.asarray(va[3])[:, : w - 1]
        args[4] = np.minimum(np.asarray(va[4]), w - 1)
        out[f"window {w}"] = (steps_mod.verify_step, args, vk, 5)
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--calls", type=int, default=25)
    a = p.parse_args(argv)
    serving_heap()
    spec = {"method": "ngram", "num_draft_tokens": max(WIDTHS) - 1, "min_acceptance": 0.0}
    llm = LLM(speculative=spec, max_num_seqs=1, num_pages=64, dtype="float32")
    # Draftless steps one call at a time, so that a plain decode call (`decode_steps`) is made
    # to capture; runs on device would call `decode_until_recurs` instead.
    llm.runner.draftless_runs = False
    (prompt,) = prompts_from_held_out(llm.tokenizer, 128, 128, 1)
    todo = calls(capture(llm, prompt))
    cache = [llm.runner.cache]

    def once(fn, args, kwargs, at) -> float:
        args = list(args)
        args[at] = cache[0]
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args, **kwargs))
        cache[0] = out[-1]
        return time.perf_counter() - t0

    settings = {"one product": 0, "rows": linear.ROW_PRODUCTS_UP_TO}
    times = {(name, s): [] for name in todo for s in settings}
    try:
        for _ in range(a.rounds):
            for s, limit in settings.items():
                linear.ROW_PRODUCTS_UP_TO = limit
                jax.clear_caches()
                for call in todo.values():
                    for _ in range(3):  # compile, warm
                        once(*call)
                for _ in range(a.calls):
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
                "one_product_ms": 1e3 * one,
                "one_product_steps": one / med[("decode", "one product")],
                "rows_ms": 1e3 * by_row,
                "rows_steps": by_row / med[("decode", "rows")],
                "rows_vs_one": by_row / one,
            }
        )
    print_table(rows, list(rows[0]))
    turns = alternating(todo, once, a.rounds, a.calls)
    print_table(turns, list(turns[0]))
    meta = {"rounds": a.rounds, "calls": a.calls, "row_products_up_to": settings["rows"]}
    print("wrote", write_json("verify_window", rows + turns, meta))
    return rows + turns


def alternating(todo: dict, once, rounds: int, calls: int) -> list[dict]:
    """Median ms of decode and of windows 5 and 9, back to back and taking turns."""
    jax.clear_caches()
    for call in todo.values():
        for _ in range(3):
            once(*call)
    times = collections.defaultdict(list)
    for _ in range(rounds):
        for name in ("decode", "window 5", "window 9"):
            times[("back to back", name)] += [once(*todo[name]) for _ in range(calls)]
        for window in ("window 5", "window 9"):
            for _ in range(calls):
                for name in ("decode", window):
                    times[(f"decode / {window}", name)].append(once(*todo[name]))
    alone = {
        name: statistics.median(times[("back to back", name)])
        for name in todo
        if ("back to back", name) in times
    }
    out = []
    for (order, name), t in times.items():
        ms = statistics.median(t)
        out.append(
            {"order": order, "call": name, "ms": 1e3 * ms, "vs_back_to_back": ms / alone[name]}
        )
    return out


if __name__ == "__main__":
    main()
