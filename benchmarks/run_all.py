"""Run every benchmark with its default settings (``make bench``).

Run from the repo root: ``python benchmarks/run_all.py``. Results land in
``benchmarks/results/*.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_forward  # noqa: E402
import bench_kda  # noqa: E402

BENCHMARKS = {"kda": bench_kda.main, "forward": bench_forward.main}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--only", choices=sorted(BENCHMARKS), nargs="+", help="run only these benchmarks"
    )
    a = p.parse_args(argv)
    for name in a.only or list(BENCHMARKS):
        print(f"==== {name} ====", flush=True)
        t0 = time.perf_counter()
        BENCHMARKS[name]([])
        print(f"({name}: {time.perf_counter() - t0:.0f} s)\n", flush=True)


if __name__ == "__main__":
    main()
