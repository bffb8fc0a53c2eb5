"""Decode time against the size of the state-slot pool (issue 13): the built-in default model,
greedy, unfused decode, ms per generated token with a small pool (max_num_seqs = max(1, B),
one checkpoint slot) and 97 slots (max_num_seqs 32 + 64 checkpoint slots), at batch 1 and 8.
The engines take turns, best of N, so the ratio holds on a noisy machine.

Run: ``python benchmarks/pool_size.py [--repeats 3]`` (prints a table, writes
``results/pool_size.json``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import print_table, write_json  # noqa: E402

from serving import LLM, SamplingParams  # noqa: E402

POOLS = {
    "small pool": dict(max_num_seqs=1, num_checkpoint_slots=1),
    "97 slots": dict(max_num_seqs=32, num_checkpoint_slots=64),
}
TOKENS = 40


def ms_per_token(llm: LLM, batch: int, seed: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    prompts = [[5 + seed, 6 + b, 7] for b in range(batch)]
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return (time.perf_counter() - t0) / TOKENS * 1e3


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    rows = []
    for batch in (1, 8):
        # max_num_seqs at least the batch (3 slots at B=1; B=8 needs 8 request slots).
        engines = {
            name: LLM(
                batch_buckets=(batch,), **{**kw, "max_num_seqs": max(kw["max_num_seqs"], batch)}
            )
            for name, kw in POOLS.items()
        }
        for llm in engines.values():
            ms_per_token(llm, batch, 0)  # compile
        best = {name: float("inf") for name in engines}
        for r in range(a.repeats):
            for name, llm in engines.items():
                best[name] = min(best[name], ms_per_token(llm, batch, r + 1))
        base = best["small pool"]
        for name, llm in engines.items():
            rows.append(
                dict(
                    batch=batch,
                    pool=name,
                    slots=llm.layout.num_slots,
                    ms_per_token=best[name],
                    vs_small_pool=best[name] / base,
                )
            )
    print_table(rows, ["batch", "pool", "slots", "ms_per_token", "vs_small_pool"])
    path = write_json("pool_size", rows, {"tokens": TOKENS, "repeats": a.repeats})
    print(f"\nwrote {path}")
    return rows


if __name__ == "__main__":
    main()
