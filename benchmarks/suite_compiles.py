"""Where the test suite's time goes: XLA compiles per test file and per program.

The tests run tiny models, so their time is mostly spent making programs (tracing, lowering,
compiling), not running them. This runs pytest (by default `make test`'s run: every default
test, one xdist worker per core) with `compile_log.py` loaded, then prints:

- per test file: its tests' seconds (pytest's durations), the compiles it asked for and their
  seconds, and how many the run's shared persistent cache already had;
- per program name (`prefill_step`, `verify_step`, ...): distinct programs and their seconds,
  the numbers to look at before changing engine shapes in the tests.

Compile seconds are wall time inside `compile_or_get_cached` in each worker (XLA compiles on
several threads), so they are a share of the run, not CPU time.

Run: ``python benchmarks/suite_compiles.py [pytest args]`` (as long as `make test`), e.g.
``python benchmarks/suite_compiles.py tests/serving/test_engine.py -n 0`` for one file.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import print_table, write_json  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_ARGS = ["-q", "-n", "auto", "--dist", "loadfile", "--no-loadscope-reorder"]
DURATION = re.compile(r"^([\d.]+)s (call|setup|teardown)\s+(\S+)")


def run_suite(pytest_args: list[str], log_dir: str) -> tuple[int, dict[str, float]]:
    """pytest with the compile log; returns (exit code, seconds per test file)."""
    env = {**os.environ, "KIMI_LINEAR_JAX_COMPILE_LOG": log_dir}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pytest", "-p", "compile_log", "--durations=0", *pytest_args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    print(proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-2000:])
    seconds: dict[str, float] = collections.Counter()
    for line in proc.stdout.splitlines():
        found = DURATION.match(line)
        if found:
            seconds[found.group(3).split("::")[0]] += float(found.group(1))
    return proc.returncode, seconds


def read_log(log_dir: str) -> list[dict]:
    return [json.loads(line) for f in Path(log_dir).glob("*.jsonl") for line in f.open()]


def by_file(compiles: list[dict], test_seconds: dict[str, float]) -> list[dict]:
    rows: dict[str, dict] = {}
    for c in compiles:
        path = (c["test"] or "(collection)").split("::")[0]
        row = rows.setdefault(path, dict(file=path, compiles=0, cache_hits=0, compile_s=0.0))
        row["compiles"] += 1
        row["cache_hits"] += bool(c["hit"])
        row["compile_s"] += c["s"]
    for path in test_seconds:
        rows.setdefault(path, dict(file=path, compiles=0, cache_hits=0, compile_s=0.0))
    for row in rows.values():
        row["test_s"] = test_seconds.get(row["file"], 0.0)
        row["compile_share"] = row["compile_s"] / row["test_s"] if row["test_s"] else float("nan")
    return sorted(rows.values(), key=lambda r: -r["test_s"])


def by_program(compiles: list[dict]) -> list[dict]:
    rows: dict[str, dict] = {}
    for c in compiles:
        row = rows.setdefault(c["name"], dict(program=c["name"], compiles=0, compile_s=0.0))
        row.setdefault("keys", set()).add(c["key"])
        row["compiles"] += 1
        row["compile_s"] += c["s"]
    for row in rows.values():
        row["distinct"] = len(row.pop("keys"))
        row["s_per_compile"] = row["compile_s"] / row["compiles"]
    return sorted(rows.values(), key=lambda r: -r["compile_s"])


def main() -> int:
    args = sys.argv[1:] or DEFAULT_ARGS
    with tempfile.TemporaryDirectory(prefix="kimi-linear-jax-compiles-") as log_dir:
        code, test_seconds = run_suite(args, log_dir)
        compiles = read_log(log_dir)
    files, programs = by_file(compiles, test_seconds), by_program(compiles)
    total_test = sum(test_seconds.values())
    total_compile = sum(c["s"] for c in compiles)
    print(f"\ntests {total_test:.0f} s, compiles {len(compiles)} taking {total_compile:.0f} s")
    print_table(
        files[:30], ["file", "test_s", "compiles", "cache_hits", "compile_s", "compile_share"]
    )
    print()
    print_table(programs[:25], ["program", "compiles", "distinct", "compile_s", "s_per_compile"])
    meta = dict(pytest_args=args, exit_code=code, test_s=total_test, compile_s=total_compile)
    meta |= dict(compiles=len(compiles), programs=programs)
    path = write_json("suite_compiles", files, meta)
    print(f"wrote {path}")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
