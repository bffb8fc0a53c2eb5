"""The built-in model served in float32 (what `dtype="auto"` picks for it) and in bfloat16 (its
checkpoint's dtype) on code continuation, batch 1, greedy: plain decoding and the n-gram, same
run, the engines taking turns call by call (`code_speculation.best_runs`).

Why float32 for the built-in model: on XLA:CPU a bfloat16 product of one row (a decode step's
every projection) is a slow loop, while from two rows on bfloat16 products run about twice as
fast as float32 ones; this measures which wins for whole steps and verify windows.

Run from the repo root: ``python benchmarks/dtype_decode.py [--k 8] [--prompts 6]`` (prints a
table, writes ``results/dtype_decode.json``).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from code_speculation import best_runs, prompts_from_held_out  # noqa: E402
from common import print_table, serving_heap, write_json  # noqa: E402

from serving.engine import LLM  # noqa: E402


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args(argv)
    serving_heap()
    ngram = {"method": "ngram", "num_draft_tokens": a.k}
    engines = {}
    for dtype in ("float32", "bfloat16"):
        shapes = dict(max_num_seqs=1, num_pages=64, dtype=dtype)
        engines[(dtype, "plain")] = LLM(**shapes)
        engines[(dtype, "ngram")] = LLM(speculative=ngram, **shapes)
    tokenizer = engines[("float32", "plain")].tokenizer
    prompts = prompts_from_held_out(tokenizer, 128, a.max_tokens, a.prompts)
    n = a.max_tokens
    best = best_runs(engines, prompts, n, a.repeats)
    rows = []
    for dtype, config in engines:
        key = (dtype, config)
        dt = sum(best[(key, i, n)]["wall"] - best[(key, i, 1)]["wall"] for i in range(len(prompts)))
        plain = (dtype, "plain")
        same = all(
            best[(key, i, n)]["tokens"] == best[(plain, i, n)]["tokens"]
            for i in range(len(prompts))
        )
        rows.append(
            {
                "dtype": dtype,
                "config": config if config == "plain" else f"ngram k {a.k}",
                "decode_tok_s": len(prompts) * (n - 1) / dt,
                "identical_to_its_plain": "yes" if same else "NO",
            }
        )
    base = rows[0]["decode_tok_s"]
    for row in rows:
        row["vs_float32_plain"] = row["decode_tok_s"] / base
    for plain_row, ngram_row in zip(rows[::2], rows[1::2], strict=True):
        ngram_row["vs_own_plain"] = ngram_row["decode_tok_s"] / plain_row["decode_tok_s"]
    columns = ["dtype", "config", "decode_tok_s", "vs_float32_plain", "vs_own_plain"]
    print_table(rows, columns + ["identical_to_its_plain"])
    meta = {"prompts": len(prompts), "prompt_len": 128, "max_tokens": n, "B": 1, "k": a.k}
    print("wrote", write_json("dtype_decode", rows, meta))
    return rows


if __name__ == "__main__":
    main()
