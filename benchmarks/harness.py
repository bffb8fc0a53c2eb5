"""The harness every suite runs on: warm-up, interleaved best-of-N timing, one table printer, one
JSON writer with the environment's metadata, and the command line of ``python -m benchmarks``.

A suite is a module holding a :class:`Suite` whose measures are functions of the parsed command
line, each returning one or more :class:`Table`. The harness runs the measures asked for,
prints each table and writes ``<out>/<suite>_<measure>.json`` (default ``benchmarks/results``).
The machines are shared and noisy: every table carries ratios against a baseline measured in the
same run, with the calls of the configurations compared taking turns (:func:`interleaved`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import textwrap
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICE_FLAG = "--xla_force_host_platform_device_count"


# ---- timing -----------------------------------------------------------------------------------
def _ready(out: Any) -> Any:
    import jax

    return jax.block_until_ready(out)


@dataclasses.dataclass
class Runs:
    """The timed calls of one function: seconds per call and what each call returned."""

    times: list[float]
    results: list[Any]

    @property
    def best(self) -> float:
        """The fastest call: the one the machine disturbed least."""
        return min(self.times)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def best_result(self) -> Any:
        """What the fastest call returned."""
        return self.results[self.times.index(self.best)]

    def summary(self) -> dict[str, Any]:
        return {"median_s": self.median, "min_s": self.best, "all": list(self.times)}


def interleaved(
    fns: dict[str, Callable[[], Any]], *, warmup: int = 1, repeats: int = 3, keep: bool = True
) -> dict[str, Runs]:
    """Best-of-N timing of several functions taking turns call by call, so that a slow spell of
    a shared machine hits all of them alike and their ratios hold.

    ``warmup`` untimed rounds first (compilation belongs there), then ``repeats`` timed rounds
    of one call each; every result is blocked on (``jax.block_until_ready``) inside its time,
    and kept (``keep``; None otherwise: device buffers would stay alive).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        for fn in fns.values():
            _ready(fn())
    runs = {name: Runs([], []) for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            out = _ready(fn())
            runs[name].times.append(time.perf_counter() - t0)
            runs[name].results.append(out if keep else None)
            del out
    return runs


def timeit(fn: Callable[[], Any], *, warmup: int = 1, repeats: int = 5) -> dict[str, Any]:
    """:func:`interleaved` of one function: ``dict(median_s, min_s, all)``."""
    return interleaved({"fn": fn}, warmup=warmup, repeats=repeats, keep=False)["fn"].summary()


def timeit_interleaved(
    fns: dict[str, Callable[[], Any]], *, warmup: int = 1, repeats: int = 5
) -> dict[str, dict[str, Any]]:
    """:func:`interleaved`, as ``{name: dict(median_s, min_s, all)}``."""
    runs = interleaved(fns, warmup=warmup, repeats=repeats, keep=False)
    return {name: r.summary() for name, r in runs.items()}


def add_ratio(
    rows: Sequence[dict[str, Any]],
    key: str,
    base: dict[str, Any] | Callable[[dict[str, Any]], dict[str, Any] | None],
    column: str,
    *,
    invert: bool = False,
) -> None:
    """``row[column] = row[key] / base[key]`` for every row (``base[key] / row[key]`` with
    ``invert``: a speed-up from times). ``base`` is a row, or a function from a row to its
    baseline row (e.g. the baseline of the same batch size); rows without one are left out."""
    for row in rows:
        ref = base(row) if callable(base) else base
        value = row.get(key)
        ref_value = ref.get(key) if ref else None
        if not isinstance(value, int | float) or not isinstance(ref_value, int | float):
            continue
        num, den = (ref_value, value) if invert else (value, ref_value)
        row[column] = num / den if den else float("nan")


# ---- the host heap and the environment --------------------------------------------------------
def serving_heap() -> bool:
    """The host heap `kimi-linear-jax generate` and `serve` run with (kimi_linear_jax/heap.py:
    freed memory kept mapped on a CPU). Called before JAX computes anything;
    KIMI_LINEAR_JAX_MALLOC=system measures glibc's defaults instead."""
    from kimi_linear_jax import heap

    return heap.for_serving()


def environment() -> dict[str, Any]:
    """Where the numbers came from."""
    import jax

    from kimi_linear_jax import heap

    dev = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "device_kind": dev.device_kind,
        "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        # Other load on the machine skews timings (multi-threaded torch most of all).
        "loadavg_1_5_15m": list(os.getloadavg()),
        "heap_kept": heap.applied(),
        "git_commit": _git_commit(),
    }


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


# ---- tables and JSON --------------------------------------------------------------------------
@dataclasses.dataclass
class Table:
    """Rows to print (the given columns, all of each row in the JSON) under a title."""

    title: str
    rows: list[dict[str, Any]]
    columns: list[str]
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        if value == 0 or 1e-3 <= abs(value) < 1e6:
            return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.0f}"
        return f"{value:.3e}"
    return str(value)


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str], title: str = "") -> None:
    """Print the given columns of ``rows`` as an aligned plain-text table."""
    if title:
        print(f"\n{title}")
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    # Text columns to the left, numbers to the right.
    text = [
        all(isinstance(r.get(c), str | None) and not isinstance(r.get(c), bool) for r in rows)
        for c in columns
    ]

    def line(values) -> str:
        return "  ".join(
            v.ljust(w) if t else v.rjust(w) for v, w, t in zip(values, widths, text)
        ).rstrip()

    print(line(columns))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print(line(row))
    sys.stdout.flush()


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float | int | str | bool) or value is None:
        return value
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return value.tolist()
    return str(value)


def write_json(
    name: str,
    rows: Sequence[dict[str, Any]],
    meta: dict[str, Any] | None = None,
    out_dir: str | None = None,
) -> str:
    """Write ``<out_dir>/<name>.json`` (default ``benchmarks/results``): the rows, and the meta
    with the environment added. Returns the path."""
    out_dir = out_dir or RESULTS_DIR
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    payload = {"name": name, "meta": {**environment(), **(meta or {})}, "rows": list(rows)}
    with open(path, "w") as f:
        json.dump(_jsonable(payload), f, indent=2)
        f.write("\n")
    return path


def write_tables(
    name: str, tables: Sequence[Table], meta: dict[str, Any], out_dir: str | None
) -> str:
    """Several tables in one JSON file: every row tagged with its table's title."""
    rows = [{"table": t.title, **r} for t in tables for r in t.rows]
    meta = {**meta, **{f"{t.title}: {k}": v for t in tables for k, v in t.meta.items()}}
    return write_json(name, rows, meta, out_dir)


# ---- suites -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Measure:
    name: str
    fn: Callable[[argparse.Namespace], Table | list[Table]]
    help: str
    devices: int = 1  # emulated CPU devices it needs (run in a process of its own)


class Suite:
    """Measures behind one command: ``python -m benchmarks NAME [--quick] [--only ...]``."""

    def __init__(self, name: str, doc: str | None) -> None:
        self.name = name
        self.doc = (doc or "").strip()
        self.measures: dict[str, Measure] = {}
        self.options: list[tuple[tuple[str, ...], dict[str, Any]]] = []

    def measure(self, name: str, *, devices: int = 1):
        """Register a measure (its docstring's first paragraph is its help)."""

        def register(fn):
            help_ = " ".join((fn.__doc__ or "").strip().split("\n\n")[0].split())
            self.measures[name] = Measure(name, fn, help_, devices)
            return fn

        return register

    def option(self, *flags: str, **kwargs: Any) -> None:
        """A command-line option of this suite (for one or several of its measures)."""
        self.options.append((flags, kwargs))

    def add_parser(self, subparsers) -> argparse.ArgumentParser:
        summary = " ".join(self.doc.split("\n\n")[0].split())
        epilog = "measures:\n" + "\n".join(
            textwrap.fill(m.help, 96, initial_indent=f"  {m.name:<12} ", subsequent_indent=" " * 15)
            for m in self.measures.values()
        )
        p = subparsers.add_parser(
            self.name,
            help=summary,
            description=self.doc,
            epilog=epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        common_options(p)
        p.add_argument("--only", nargs="+", choices=list(self.measures), help="these measures")
        for flags, kwargs in self.options:
            p.add_argument(*flags, **kwargs)
        return p

    def run(self, args: argparse.Namespace, argv: list[str]) -> int:
        """Run the measures asked for; those needing emulated devices this process lacks run
        in a child process. Returns the count of failed measures."""
        names = args.only or list(self.measures)
        here = [n for n in names if self.measures[n].devices <= host_devices()]
        away = [n for n in names if n not in here]
        failed = 0
        for name in here:
            failed += not self._run_one(self.measures[name], args, argv)
        if away:
            failed += self._run_child(away, argv, max(self.measures[n].devices for n in away))
        return failed

    def _run_one(self, m: Measure, args: argparse.Namespace, argv: list[str]) -> bool:
        print(f"\n==== {self.name} {m.name}", flush=True)
        print(textwrap.fill(m.help, 100), flush=True)
        t0 = time.perf_counter()
        try:
            out = m.fn(args)
        except Exception:  # noqa: BLE001 - one failing measure must not stop the others
            traceback.print_exc()
            print(f"FAILED: {self.name} {m.name} ({time.perf_counter() - t0:.0f} s)", flush=True)
            return False
        tables = [out] if isinstance(out, Table) else list(out)
        for t in tables:
            columns = [c for c in dict.fromkeys(t.columns) if any(c in r for r in t.rows)]
            print_table(t.rows, columns, t.title)
        wall = time.perf_counter() - t0
        meta = {"suite": self.name, "measure": m.name, "quick": args.quick, "wall_s": wall}
        meta["command"] = "python -m benchmarks " + " ".join(argv)
        path = write_tables(f"{self.name}_{m.name}", tables, meta, args.out)
        shown = os.path.relpath(path)
        shown = path if shown.startswith("..") else shown
        print(f"\nwrote {shown} ({self.name} {m.name}: {wall:.0f} s)", flush=True)
        return True

    def _run_child(self, names: list[str], argv: list[str], devices: int) -> int:
        """The measures in a process with ``devices`` emulated CPU devices (XLA reads its flags
        once per process; the other measures keep the devices they run on)."""
        env = dict(os.environ)
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {DEVICE_FLAG}={devices}".strip()
        env["JAX_PLATFORMS"] = "cpu"
        cmd = [sys.executable, "-m", "benchmarks", *_without_only(argv), "--only", *names]
        print(f"\n(in a process with {devices} emulated CPU devices: {' '.join(names)})")
        sys.stdout.flush()
        rc = subprocess.run(cmd, env=env, cwd=REPO).returncode
        return 0 if rc == 0 else len(names)


def batch_shapes(batches: Sequence[int], prompt_len: int, n: int) -> dict[str, Any]:
    """`LLM` options under which the largest batch prefills in one [B, prompt_len] call and
    then decodes together: no chunking, batch buckets the measured batch sizes, one token
    bucket, pages for prompt + n per row, prefix caching off (timed runs repeat prompts)."""
    top, page = max(batches), 16
    return dict(
        dtype="float32",
        max_num_seqs=top,
        page_size=page,
        num_pages=top * -(-(prompt_len + n) // page) + 2,
        max_num_batched_tokens=top * prompt_len,
        max_model_len=prompt_len + n,
        chunk_size=prompt_len,
        batch_buckets=tuple(sorted(set(batches))),
        token_buckets=(prompt_len,),
        enable_prefix_caching=False,
    )


def host_devices() -> int:
    """Emulated CPU devices this process has (from XLA_FLAGS, without starting JAX)."""
    m = re.search(DEVICE_FLAG + r"=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(m.group(1)) if m else 1


def _without_only(argv: list[str]) -> list[str]:
    out, skipping = [], False
    for tok in argv:
        if tok == "--only":
            skipping = True
            continue
        if tok.startswith("--only="):
            continue
        if skipping and not tok.startswith("-"):
            continue
        skipping = False
        out.append(tok)
    return out


def common_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="smoke run: tiny shapes, few repeats")
    p.add_argument("--out", help="directory for the JSON (default: benchmarks/results)")
    p.add_argument(
        "--repeats", type=int, help="timed rounds, best of N (each measure has its default)"
    )


def repeats(args: argparse.Namespace, default: int, quick: int = 1) -> int:
    """The ``--repeats`` asked for, else the measure's default (``quick`` in a smoke run)."""
    return args.repeats or (quick if args.quick else default)


def ints(text: str | Iterable[int]) -> list[int]:
    """``"1,8,32"`` -> ``[1, 8, 32]``."""
    if not isinstance(text, str):
        return [int(x) for x in text]
    return [int(x) for x in text.split(",") if x.strip()]
