"""A pytest plugin that logs every XLA compile of a test run: which test asked for it, the
program's name, its persistent-cache key, whether the cache had it, and the seconds spent.

Loaded by `suite_compiles.py` (`-p compile_log`, this folder on PYTHONPATH, so that the
pytest-xdist workers load it too); each process appends JSON lines to its own file under
`$KIMI_LINEAR_JAX_COMPILE_LOG`. It wraps `jax._src.compiler.compile_or_get_cached` and reads
the compiler's cache hit/miss log lines: jax internals, good for a measurement, never for the
product.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time

from jax._src import compiler

_OUT = os.environ.get("KIMI_LINEAR_JAX_COMPILE_LOG")
_CACHE_LINE = re.compile(r"(cache hit|CACHE MISS) for '(.*?)' with key '(.*?)'")
_now = {"test": None, "key": None, "hit": None}


class _CacheLines(logging.Handler):
    """Keeps the key and hit/miss of the compile in progress (logged before it returns)."""

    def emit(self, record: logging.LogRecord) -> None:
        found = _CACHE_LINE.search(record.getMessage())
        if found:
            _now["hit"], _now["key"] = found.group(1) == "cache hit", found.group(3)


def _program_name(computation) -> str:
    try:
        return str(computation.operation.attributes["sym_name"]).strip('"')
    except (AttributeError, KeyError):
        return "?"


def _install(path: str) -> None:
    out = open(path, "a", buffering=1)  # noqa: SIM115 - open for the process's life
    handler = _CacheLines(level=logging.DEBUG)
    log = logging.getLogger("jax._src.compiler")
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    real = compiler.compile_or_get_cached

    def logged(backend, computation, *args, **kwargs):
        _now["key"] = _now["hit"] = None
        start = time.perf_counter()
        result = real(backend, computation, *args, **kwargs)
        seconds = time.perf_counter() - start
        row = dict(test=_now["test"], name=_program_name(computation), key=_now["key"])
        out.write(json.dumps({**row, "hit": _now["hit"], "s": round(seconds, 4)}) + "\n")
        return result

    compiler.compile_or_get_cached = logged


if _OUT:
    os.makedirs(_OUT, exist_ok=True)
    _install(os.path.join(_OUT, f"{os.getpid()}.jsonl"))


def pytest_runtest_setup(item) -> None:
    _now["test"] = item.nodeid
