"""``python -m benchmarks SUITE [--quick] [--out DIR] [--only MEASURE ...] [--repeats N]``.

``python -m benchmarks all [--quick] [--out DIR]`` runs every suite, each in a process of its
own, and ends with a table of their exit codes and wall times (``make bench``).
``python -m benchmarks SUITE --help`` lists a suite's measures and options.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import time

from benchmarks import SUITES, harness


def run_all(args: argparse.Namespace) -> int:
    """Every suite in its own process (a fresh heap, compile cache and device set each); a
    failing suite does not stop the others."""
    rows = []
    for name in SUITES:
        cmd = [sys.executable, "-m", "benchmarks", name]
        cmd += ["--quick"] * args.quick + (["--out", args.out] if args.out else [])
        cmd += ["--repeats", str(args.repeats)] if args.repeats else []
        print(f"\n######## python {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, cwd=harness.REPO).returncode
        rows.append({"suite": name, "rc": rc, "wall_s": time.perf_counter() - t0})
    harness.print_table(rows, ["suite", "rc", "wall_s"], "all suites (rc 0: every measure ran)")
    return int(any(r["rc"] for r in rows))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="suite", required=True, metavar="SUITE")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    suite = None
    for name, (module, summary) in SUITES.items():
        if name == wanted:  # only the suite that runs is imported
            suite = importlib.import_module(module).SUITE
            suite.add_parser(sub)
        else:
            sub.add_parser(name, help=summary, add_help=False)
    harness.common_options(sub.add_parser("all", help="every suite, each in its own process"))
    args = p.parse_args(argv)
    if args.suite == "all":
        return run_all(args)
    # Before JAX's first computation: the serving measures run with the CLI's heap.
    harness.serving_heap()
    os.makedirs(args.out or harness.RESULTS_DIR, exist_ok=True)
    return 1 if suite.run(args, argv) else 0


if __name__ == "__main__":
    sys.exit(main())
