"""The host heap under XLA:CPU: keep freed memory mapped, so that a compiled step does not
fault in a fresh temp buffer on every call.

XLA:CPU mallocs each call's temp buffer (46 MB for a `small` decode step at B = 8, 174 MB at
B = 32). glibc serves a request above its mmap threshold (32 MiB at most) with a new mapping,
and so do the arenas of threads other than the main one, whatever the threshold; every call
then touches fresh 4 KiB pages. At B = 32 that was 42,000 minor page faults per decode step,
about a third of its time (benchmarks/RESULTS.md, "page faults").

`keep_freed_memory()` sets three glibc options with `mallopt`: no mmap for allocations
(M_MMAP_MAX 0), one arena for every thread (M_ARENA_MAX 1, since other arenas mmap
regardless), and no trimming of the heap's top (M_TRIM_THRESHOLD). A freed temp buffer then
stays mapped and the next call reuses its pages. The price: the process keeps its peak heap
instead of returning it to the system.

The other price: with one arena, XLA's compiler threads wait on each other's mallocs. The test
suite, which compiles far more than it runs, took 1.24x as long. So it is for serving
processes, not a default of the package: `kimi-linear-jax generate` and `serve` call
`for_serving()` on start, and an offline script calls it first thing.

A thread keeps the arena it was first given, and XLA's threads allocate when the backend
starts, so this only works before JAX's first computation. It applies on glibc, for CPU-only
JAX. `KIMI_LINEAR_JAX_MALLOC=system` keeps glibc's defaults even in `for_serving`;
`KIMI_LINEAR_JAX_MALLOC=keep` sets the options when the package is imported.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import os
import platform
import warnings

# mallopt parameter numbers, from glibc's malloc.h.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8

ENV = "KIMI_LINEAR_JAX_MALLOC"
_applied = False


def keep_freed_memory() -> bool:
    """Set the options above; True when glibc took all three. False off glibc."""
    global _applied
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    ok = all(
        libc.mallopt(param, value) == 1
        for param, value in ((M_MMAP_MAX, 0), (M_ARENA_MAX, 1), (M_TRIM_THRESHOLD, 2**31 - 1))
    )
    _applied = _applied or ok
    return ok


def cpu_only() -> bool:
    """Whether JAX will run on the CPU, decided without starting a backend: JAX_PLATFORMS says
    cpu, or no accelerator plugin is installed (JAX finds them as `jax_plugins` entry points
    or modules)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    if importlib.metadata.entry_points(group="jax_plugins"):
        return False
    return importlib.util.find_spec("jax_plugins") is None


def _choice() -> str:
    choice = os.environ.get(ENV, "").lower()
    if choice not in ("", "keep", "system"):
        raise ValueError(f"{ENV} must be 'keep' or 'system', got {choice!r}")
    return choice


def for_serving() -> bool:
    """Keep freed memory on a CPU-only glibc host, unless KIMI_LINEAR_JAX_MALLOC=system.
    Call it before JAX's first computation."""
    if _choice() == "system" or not cpu_only():
        return False
    return keep_freed_memory()


def apply_from_env() -> bool:
    """At import: keep freed memory when KIMI_LINEAR_JAX_MALLOC=keep (and the host allows). A
    bad value warns here, so the package still imports; `for_serving` raises on it."""
    try:
        choice = _choice()
    except ValueError as e:
        warnings.warn(str(e), stacklevel=2)
        return False
    return choice == "keep" and cpu_only() and keep_freed_memory()


def applied() -> bool:
    """Whether this process runs with the options set (benchmarks record it)."""
    return _applied
