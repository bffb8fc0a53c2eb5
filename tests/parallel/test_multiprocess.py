"""Several processes as one mesh (issue 14): `kimi-linear-jax generate` run as 2 processes x 4
CPU devices (gloo collectives, a free localhost port), tensor_parallel_size 8, gives the greedy
tokens of one process with one device; the follower writes nothing; a process that dies makes
the other exit with an error instead of hanging.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from kimi_linear_jax.checkpoint import save_pretrained
from kimi_linear_jax.generation import greedy_generate
from tests.parallel.test_model_parallel import base_model

PROMPTS = [[(7 * i) % 120 + 1 for i in range(30)] + [100 + q, 101] for q in range(3)]
MAX_TOKENS = 8
SHAPES = ["--num-pages", "48", "--page-size", "4", "--max-num-seqs", "4"]
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_tp8")
    save_pretrained(base_model(), path)
    lines = path / "prompts.jsonl"
    lines.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def _env() -> dict:
    env = dict(os.environ)
    # Each process emulates 4 devices: the 8 of the mesh are split between the two.
    flags = env.get("XLA_FLAGS", "").replace("device_count=8", "device_count=4")
    return {**env, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}


def _launch(checkpoint, out_dir, extra=(), num_processes=2):
    """Start the processes of one `generate` run; process i writes out_dir/out{i}.jsonl."""
    port = _free_port()
    procs = []
    for i in range(num_processes):
        cmd = [
            sys.executable, "-m", "serving.cli", "generate",
            "--model", str(checkpoint), "--dtype", "float32",
            "--input", str(checkpoint / "prompts.jsonl"),
            "--output", str(out_dir / f"out{i}.jsonl"),
            "--max-tokens", str(MAX_TOKENS), "--ignore-eos",
            "--tensor-parallel-size", "8",
            "--coordinator-address", f"localhost:{port}",
            "--num-processes", str(num_processes), "--process-id", str(i),
            *SHAPES, *extra,
        ]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=_env(), stderr=subprocess.PIPE, text=True))
    return procs


def _wait(procs):
    errors = []
    for p in procs:
        _, err = p.communicate(timeout=TIMEOUT_S)
        errors.append(err)
    return [p.returncode for p in procs], errors


def test_two_processes_generate_equals_one_device(checkpoint, tmp_path):
    """A JSONL batch with n-gram speculation (drafts accepted: the prompts repeat) across two
    processes equals plain greedy decoding on one device; only process 0 writes."""
    procs = _launch(checkpoint, tmp_path, ["--speculative-method", "ngram"])
    codes, errors = _wait(procs)
    assert codes == [0, 0], errors
    rows = [json.loads(line) for line in (tmp_path / "out0.jsonl").read_text().splitlines()]
    want = greedy_generate(base_model(), PROMPTS, MAX_TOKENS)
    assert [r["token_ids"] for r in rows] == want
    assert not (tmp_path / "out1.jsonl").exists()  # the follower writes nothing
    assert "tokens in" in errors[0] and "tokens in" not in errors[1]


@pytest.mark.slow
def test_plain_run_and_a_dying_process(checkpoint, tmp_path):
    """Without speculation the tokens are equal too; a process killed mid-run makes the other
    exit with an error (the coordination service's heartbeat), not hang."""
    codes, errors = _wait(_launch(checkpoint, tmp_path))
    assert codes == [0, 0], errors
    rows = [json.loads(line) for line in (tmp_path / "out0.jsonl").read_text().splitlines()]
    assert [r["token_ids"] for r in rows] == greedy_generate(base_model(), PROMPTS, MAX_TOKENS)
    lone = _launch(checkpoint, tmp_path / "x", num_processes=2)
    for line in lone[1].stderr:  # both joined and built the engine: now in its steps
        if "pools" in line:
            break
    lone[1].kill()
    _, err = lone[0].communicate(timeout=TIMEOUT_S)
    assert lone[0].returncode != 0
    assert "heartbeat" in err  # the coordination service names the task that stopped
    assert not (tmp_path / "x" / "out0.jsonl").exists()
