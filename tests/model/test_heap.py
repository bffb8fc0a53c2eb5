"""The host heap setup (kimi_linear_jax/heap.py): a compiled call with a temp buffer above
glibc's mmap threshold faults its pages in on every call with glibc's defaults, and not after
the package has set the heap up at import; the opt-out and the platform check."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from kimi_linear_jax import heap

PROGRAM = """
import json, resource
import kimi_linear_jax  # sets the heap up before JAX's first computation
import jax, jax.numpy as jnp

@jax.jit
def f(x, w):
    y = jnp.tanh(x @ w)  # [4096, 4096] f32: a 64 MiB temp buffer
    return jnp.sum(y @ w.T)

x = jnp.ones((4096, 64), jnp.float32)
w = jnp.ones((64, 4096), jnp.float32) / 64
for _ in range(2):
    f(x, w).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    f(x, w).block_until_ready()
after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
print(json.dumps({"faults": (after - before) / 4, "applied": kimi_linear_jax.heap.applied()}))
"""


def _run(choice: str) -> dict:
    env = {**os.environ, heap.ENV: choice, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setup is for glibc's malloc")
def test_kept_heap_stops_the_page_faults_of_each_call():
    system, kept = _run("system"), _run("keep")
    assert not system["applied"] and kept["applied"]
    pages = 4096 * 4096 * 4 // 4096
    assert system["faults"] > pages / 2, system  # glibc maps the temp buffer afresh each call
    assert kept["faults"] < pages / 100, kept


def test_opt_out_and_bad_value(monkeypatch):
    monkeypatch.setenv(heap.ENV, "system")
    assert heap.for_serving() is False and heap.apply_from_env() is False
    monkeypatch.delenv(heap.ENV)
    assert heap.apply_from_env() is False  # not a default of the package
    monkeypatch.setenv(heap.ENV, "sometimes")
    with pytest.raises(ValueError, match="KIMI_LINEAR_JAX_MALLOC must be 'keep' or 'system'"):
        heap.for_serving()
    with pytest.warns(UserWarning, match="must be 'keep' or 'system', got 'sometimes'"):
        assert heap.apply_from_env() is False  # importing the package still works


@pytest.mark.parametrize("platforms,expected", [("cpu", True), ("cuda,cpu", False), ("tpu", False)])
def test_cpu_only_follows_jax_platforms(monkeypatch, platforms, expected):
    monkeypatch.setenv("JAX_PLATFORMS", platforms)
    assert heap.cpu_only() is expected


ENTRY = """
import contextlib, io, sys
from kimi_linear_jax import heap
from serving import cli
sys.argv = ["kimi-linear-jax", *sys.argv[1:]]
with contextlib.redirect_stdout(io.StringIO()):
    try:
        cli.entry()
    except SystemExit:
        pass
print(heap.applied())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setup is for glibc's malloc")
@pytest.mark.parametrize("command,expected", [("generate", "True"), ("info", "False")])
def test_the_script_keeps_freed_memory_for_generate_and_serve(command, expected):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop(heap.ENV, None)
    out = subprocess.run(
        [sys.executable, "-c", ENTRY, command, "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == expected


def test_the_script_refuses_a_bad_setting():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", heap.ENV: "sometimes"}
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "serving.cli", "generate", "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "error: KIMI_LINEAR_JAX_MALLOC must be 'keep' or 'system', got 'sometimes'"
    )
