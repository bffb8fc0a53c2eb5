"""Test-wide setup: emulate 8 CPU devices (must happen before jax is imported anywhere)."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The tests run tiny models, so XLA's compile time dominates their run time: compile with less
# LLVM optimisation (about 30% faster for the suite). Floating-point semantics do not change
# (fast-math stays off), so the numerical comparisons hold as they are.
for flag in ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"):
    if flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " " + flag


import atexit  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

# Programs that several objects build alike compile once per run: each `Trainer` (a resume test
# builds three) and each engine jits its own functions, so jax's in-memory cache misses where
# XLA's persistent cache, keyed by the program itself, hits. One fresh directory per run, made by
# the first process (pytest-xdist's controller, whose environment the workers inherit), so test
# files on different workers that build the same engine shapes compile them once; the process
# that made it removes it at exit, so nothing carries over between runs (the resume tests took
# 121 s with three compiles, 75 s with one).
_JIT_CACHE = os.environ.get("KIMI_LINEAR_JAX_TEST_JIT_CACHE")
if not _JIT_CACHE:
    _JIT_CACHE = tempfile.mkdtemp(prefix="kimi-linear-jax-test-jit-")
    os.environ["KIMI_LINEAR_JAX_TEST_JIT_CACHE"] = _JIT_CACHE
    atexit.register(shutil.rmtree, _JIT_CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _JIT_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
if importlib.util.find_spec("filelock"):
    # A size limit makes jax lock the directory around each read and write, so one worker never
    # reads an entry another is still writing (without the lock such a read fails, is warned
    # about and recompiles). The limit itself is never reached.
    jax.config.update("jax_compilation_cache_max_size", 1 << 40)
# Corpus n-gram tables go to a fresh directory too, never the user's cache.
_TABLE_CACHE = tempfile.mkdtemp(prefix="kimi-linear-jax-test-cache-")
atexit.register(shutil.rmtree, _TABLE_CACHE, ignore_errors=True)
os.environ["KIMI_LINEAR_JAX_CACHE"] = _TABLE_CACHE


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop the jit caches after each test module. Every compiled XLA:CPU program keeps memory
    mappings of its code; the whole suite compiles thousands and once a process passes the
    kernel's limit (vm.max_map_count, 65,530) the next compile crashes with a segfault. A
    module's programs are not reused by the next module's shapes."""
    yield
    jax.clear_caches()
    gc.collect()


# The longest files first, longest first (seconds each took in a slow spell of the 2-core
# machine, 2026-12-03): `make test` runs each file on one worker (--dist loadfile), in
# collection order, so a long file that starts late runs alone at the end while the other
# worker idles. A stable sort: every worker collects the same order, as xdist needs.
LONGEST_FIRST = (
    "tests/serving/test_speculative.py",  # 338
    "tests/parallel/test_model_parallel.py",  # 127
    "tests/model/test_cached_forward.py",  # 108
    "tests/model/test_train.py",  # 105
    "tests/serving/test_prompt_logprobs.py",  # 97
    "tests/model/test_mla_moe.py",  # 95
    "tests/serving/test_cli.py",  # 90
    "tests/serving/test_prefix_cache.py",  # 86
    "tests/serving/test_async_scheduling.py",  # 83
    "tests/serving/test_ngram_table.py",  # 82
    "tests/parallel/test_engine_parallel.py",  # 74
    "tests/serving/test_engine.py",  # 68
    "tests/serving/test_server.py",  # 66
    "tests/serving/test_draftless_runs.py",  # 60
    "tests/model/test_builtin.py",  # 57
    "tests/serving/test_cuda_lowering.py",  # 55
    "tests/model/test_parity.py",  # 49
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
