"""Decode time against the size of the cache pools (issue 13), greedy, unfused decode, ms per
generated token at batch 1 and 8. The engines of a comparison take turns, best of N, so the
ratio holds on a noisy machine.

- ``slots``: the built-in default model with a small state-slot pool (max_num_seqs =
  max(1, B), one checkpoint slot) and 97 slots (max_num_seqs 32 + 64 checkpoint slots).
- ``pages``: the ``small`` shapes with a 320-id vocabulary (random weights; two MLA layers,
  the model of ``decode_profile.py``) with 64 and with 4,096 latent pages (page size 16: 2.4
  and 151 MB per MLA layer), the same 8 state slots.

A step that copied a whole pool would slow down with its size.

Run: ``python benchmarks/pool_size.py [--repeats 3] [--only slots|pages] [--json NAME]``
(prints a table, writes ``results/pool_size.json`` or ``results/NAME.json``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax.numpy as jnp  # noqa: E402
from common import print_table, write_json  # noqa: E402

from kimi_linear_jax.presets import preset  # noqa: E402
from kimi_linear_jax.testing import random_model  # noqa: E402
from serving import LLM, SamplingParams  # noqa: E402

SLOT_POOLS = {
    "small pool": dict(max_num_seqs=1, num_checkpoint_slots=1),
    "97 slots": dict(max_num_seqs=32, num_checkpoint_slots=64),
}
PAGE_POOLS = {"64 pages": 64, "4,096 pages": 4096}
TOKENS = 40


def ms_per_token(llm: LLM, batch: int, seed: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    prompts = [[5 + seed, 6 + b, 7] for b in range(batch)]
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return (time.perf_counter() - t0) / TOKENS * 1e3


def slot_engines(batch: int) -> dict[str, LLM]:
    # max_num_seqs at least the batch (3 slots at B=1; B=8 needs 8 request slots).
    return {
        name: LLM(batch_buckets=(batch,), **{**kw, "max_num_seqs": max(kw["max_num_seqs"], batch)})
        for name, kw in SLOT_POOLS.items()
    }


def page_engines(batch: int, model) -> dict[str, LLM]:
    return {
        name: LLM(model, batch_buckets=(batch,), max_num_seqs=8, num_pages=n)
        for name, n in PAGE_POOLS.items()
    }


def compare(kind: str, batch: int, engines: dict[str, LLM], repeats: int) -> list[dict]:
    for llm in engines.values():
        ms_per_token(llm, batch, 0)  # compile
    best = {name: float("inf") for name in engines}
    for r in range(repeats):
        for name, llm in engines.items():
            best[name] = min(best[name], ms_per_token(llm, batch, r + 1))
    base = best[next(iter(engines))]
    return [
        dict(
            kind=kind,
            batch=batch,
            pool=name,
            slots=llm.layout.num_slots,
            pages=llm.layout.num_pages,
            ms_per_token=best[name],
            vs_smallest=best[name] / base,
        )
        for name, llm in engines.items()
    ]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", choices=("slots", "pages"))
    p.add_argument("--json", default="pool_size", help="results/<JSON>.json")
    a = p.parse_args(argv)
    kinds = [a.only] if a.only else ["slots", "pages"]
    rows = []
    for kind in kinds:
        if kind == "pages":
            model = random_model(preset("small", vocab_size=320), dtype=jnp.float32)
        for batch in (1, 8):
            engines = slot_engines(batch) if kind == "slots" else page_engines(batch, model)
            rows += compare(kind, batch, engines, a.repeats)
            del engines  # the 4,096-page pools: 300 MB
    print_table(rows, ["kind", "batch", "pool", "slots", "pages", "ms_per_token", "vs_smallest"])
    path = write_json(a.json, rows, {"tokens": TOKENS, "repeats": a.repeats})
    print(f"\nwrote {path}")
    return rows


if __name__ == "__main__":
    main()
