"""The parameters a serving step takes: a flat list of arrays (`model.split_flat`, what the
runner holds) against the nnx State it came from (what it held before), on the built-in model
at batch 1, float32, greedy, plus the dispatch cost of one jitted call with each.

Two engines over the same model; the second one's runner (and the draft's, for a draft-model
engine) gets its state back as an nnx State, which every step then flattens Variable by
Variable in Python. The engines take turns prompt by prompt (`--repeats` rounds, the held-out
code prompts of `code_speculation.py`); decode tok/s = (N - 1) / (t(N) - t(1)) as there.

Run: ``python benchmarks/flat_params.py [--method plain|ngram|draft_model]`` (about a minute).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import print_table, serving_heap, write_json  # noqa: E402

serving_heap()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from code_speculation import best_runs, prompts_from_held_out  # noqa: E402

from serving.engine import LLM  # noqa: E402


def as_state(holder) -> None:
    """Give a runner or drafter its parameters back as the nnx State they were flattened from."""
    holder.params = jax.tree.unflatten(holder.graphdef.treedef, holder.params)


def dispatch_us(params, calls: int = 2000) -> float:
    """Microseconds per call of a trivial jitted function that takes `params`."""
    f = jax.jit(lambda params, x: x + 1)
    x = jnp.zeros(4)
    jax.block_until_ready(f(params, x))
    t0 = time.perf_counter()
    for _ in range(calls):
        f(params, x)
    jax.block_until_ready(f(params, x))
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", choices=("plain", "ngram", "draft_model"), default="plain")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    shapes = dict(max_num_seqs=1, num_pages=64, dtype="float32")
    if a.method != "plain":
        shapes["speculative"] = {"method": a.method, "num_draft_tokens": a.k}
    llms = {"flat list": LLM(**shapes), "nnx State": LLM(**shapes)}
    as_state(llms["nnx State"].runner)
    if a.method == "draft_model":
        as_state(llms["nnx State"].runner.drafter)
    prompts = prompts_from_held_out(llms["flat list"].tokenizer, 128, a.max_tokens, a.prompts)
    n = a.max_tokens
    best = best_runs(llms, prompts, n, a.repeats)
    rows = []
    for name, llm in llms.items():
        dt = sum(
            best[(name, i, n)]["wall"] - best[(name, i, 1)]["wall"] for i in range(len(prompts))
        )
        rows.append(
            {
                "params": name,
                "method": a.method,
                "decode_tok_s": len(prompts) * (n - 1) / dt,
                "dispatch_us": dispatch_us(llm.runner.params),
            }
        )
    for row in rows:
        row["vs_state"] = row["decode_tok_s"] / rows[1]["decode_tok_s"]
    print_table(rows, ["params", "method", "decode_tok_s", "vs_state", "dispatch_us"])
    meta = {"prompts": len(prompts), "max_tokens": n, "k": a.k, "B": 1}
    print("wrote", write_json(f"flat_params_{a.method}", rows, meta))
    return rows


if __name__ == "__main__":
    main()
