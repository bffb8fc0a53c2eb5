"""Building the corpus n-gram table at an engine start, against loading the one an earlier
start kept (`serving/speculative/ngram_table.py`, `table_from_corpus`): the standard library's
training split with the built-in model's tokenizer.

Each round uses a fresh cache directory: the first call builds (tokenize, count, write the
file), the second loads it; both tables are compared. Then `LLM(speculative={"method":
"ngram", "corpus": "stdlib"})` is started against that warm cache and against none
(`KIMI_LINEAR_JAX_CACHE=off`), taking turns. Median of `--rounds`.

Run: ``python benchmarks/corpus_table.py [--rounds 3]`` (prints a table, writes
``results/corpus_table.json``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from common import print_table, write_json  # noqa: E402

from kimi_linear_jax.checkpoint import BUILTIN_MODEL  # noqa: E402
from kimi_linear_jax.tokenizer import load_tokenizer  # noqa: E402
from serving.engine import LLM  # noqa: E402
from serving.speculative.ngram_table import CACHE_ENV, table_from_corpus  # noqa: E402

SPEC = {"method": "ngram", "num_draft_tokens": 8, "corpus": "stdlib"}


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def same_table(a, b) -> bool:
    return (a.bits, a.orders) == (b.bits, b.orders) and all(
        np.array_equal(x, y) for n in a.orders for x, y in zip(a.tables[n], b.tables[n])
    )


def rounds(n: int, tokenizer) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {}
    for _ in range(n):
        with tempfile.TemporaryDirectory() as cache:
            os.environ[CACHE_ENV] = cache
            built, t_build = timed(lambda: table_from_corpus("stdlib", tokenizer))
            loaded, t_load = timed(lambda: table_from_corpus("stdlib", tokenizer))
            assert same_table(built, loaded), "the kept table differs from the built one"
            _, t_warm = timed(lambda: LLM(speculative=SPEC, max_num_seqs=1, num_pages=64))
            os.environ[CACHE_ENV] = "off"
            _, t_off = timed(lambda: LLM(speculative=SPEC, max_num_seqs=1, num_pages=64))
        for key, t in (
            ("table, built", t_build),
            ("table, kept", t_load),
            ("engine start, cache off", t_off),
            ("engine start, table kept", t_warm),
        ):
            times.setdefault(key, []).append(t)
    return times


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    tokenizer = load_tokenizer(BUILTIN_MODEL, 4096)
    before = os.environ.get(CACHE_ENV)
    try:
        times = rounds(a.rounds, tokenizer)
    finally:  # `make bench` runs the other benchmarks in this process next
        if before is None:
            os.environ.pop(CACHE_ENV, None)
        else:
            os.environ[CACHE_ENV] = before
    rows = [
        {"what": k, "median_s": statistics.median(v), "min_s": min(v)} for k, v in times.items()
    ]
    for row, base in ((rows[1], rows[0]), (rows[3], rows[2])):
        row["speedup"] = base["median_s"] / row["median_s"]
    print_table(rows, ["what", "median_s", "min_s", "speedup"])
    print("wrote", write_json("corpus_table", rows, {"rounds": a.rounds, "corpus": "stdlib"}))
    return rows


if __name__ == "__main__":
    main()
