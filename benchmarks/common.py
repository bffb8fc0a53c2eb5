"""Shared helpers for the benchmark scripts: timing, result files and tables."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def timeit(fn: Callable[[], Any], *, warmup: int = 1, repeats: int = 5) -> dict[str, Any]:
    """Wall time of ``fn()`` (results blocked on with ``jax.block_until_ready``).

    ``warmup`` untimed calls first (compilation belongs there), then ``repeats`` timed ones.
    Returns ``dict(median_s, min_s, all)`` with ``all`` the list of timings in seconds.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "all": times}


def timeit_interleaved(
    fns: dict[str, Callable[[], Any]], *, warmup: int = 1, repeats: int = 5
) -> dict[str, dict[str, Any]]:
    """:func:`timeit` for several functions at once, taking turns call by call, so that on a
    shared, noisy machine slow spells hit all of them alike and their ratios stay meaningful.

    Returns ``{name: dict(median_s, min_s, all)}``.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        for fn in fns.values():
            jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
    return {
        name: {"median_s": statistics.median(ts), "min_s": min(ts), "all": ts}
        for name, ts in times.items()
    }


def serving_heap() -> bool:
    """The host heap `kimi-linear-jax generate` and `serve` run with (kimi_linear_jax/heap.py:
    freed memory kept mapped on a CPU), for the benchmarks of serving; call it before JAX
    computes anything. KIMI_LINEAR_JAX_MALLOC=system measures glibc's defaults instead."""
    from kimi_linear_jax import heap

    return heap.for_serving()


def environment() -> dict[str, Any]:
    """Where the numbers came from."""
    dev = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "device_kind": dev.device_kind,
        "cpu_count": os.cpu_count(),
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        # Other load on the machine skews timings (multi-threaded torch most of all).
        "loadavg_1_5_15m": list(os.getloadavg()),
        # Allocator settings change CPU step times (decode_profile.py: fresh temp pages).
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "heap_kept": _heap_kept(),
    }


def _heap_kept() -> bool:
    from kimi_linear_jax import heap

    return heap.applied()


def write_json(
    name: str,
    rows: Sequence[dict[str, Any]],
    meta: dict[str, Any] | None = None,
    out_dir: str | None = None,
) -> str:
    """Write ``<out_dir>/<name>.json`` (default ``benchmarks/results``) with the rows and meta
    (environment added); returns the path."""
    out_dir = out_dir or RESULTS_DIR
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    payload = {"name": name, "meta": {**environment(), **(meta or {})}, "rows": list(rows)}
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
    return path


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value == 0 or 1e-3 <= abs(value) < 1e6:
            return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.0f}"
        return f"{value:.3e}"
    return str(value)


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    """Print the given columns of ``rows`` as an aligned plain-text table."""
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
