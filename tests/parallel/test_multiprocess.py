"""Several processes as one mesh (issue 14): `kimi-linear-jax generate` run as 2 processes x 4
CPU devices (gloo collectives, a free localhost port), tensor_parallel_size 8, gives the greedy
tokens of one process with one device; the follower writes nothing; a process that dies makes
the other exit with an error instead of hanging. `kimi-linear-jax serve` the same way: process 0
answers HTTP requests with the one-device tokens, and the follower exits 0 when it stops.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from kimi_linear_jax.checkpoint import save_pretrained
from kimi_linear_jax.generation import greedy_generate
from tests.parallel.test_model_parallel import base_model

PROMPTS = [[(7 * i) % 120 + 1 for i in range(30)] + [100 + q, 101] for q in range(3)]
MAX_TOKENS = 8
SHAPES = ["--num-pages", "48", "--page-size", "4", "--max-num-seqs", "4"]
TIMEOUT_S = 240
# What gloo writes to stdout on connecting: "[Gloo] Rank 5 is connected to 7 peer ranks.
# Expected number of connected peer ranks is : 7", one `<<` piece at a time.
GLOO_PIECES = "|".join(
    (r"\[Gloo\]", "Rank", "is connected to", r"peer ranks\.", "Expected number of connected",
     r"peer ranks is :", r"\d+", r"\s")
)  # fmt: skip


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


# `kimi-linear-jax` whose model load starts {late_s} s late.
LATE_LOAD = """
import time
import serving.engine as engine
load = engine._load_model
def late(*args):
    time.sleep({late_s})
    return load(*args)
engine._load_model = late
from serving.cli import entry
entry()
"""


def _launch(checkpoint, out_dir, extra=(), num_processes=2, late_s=0):
    """Start the processes of one `generate` run; process i writes out_dir/out{i}.jsonl.
    late_s: process 1 loads the model that much later than process 0."""
    port = _free_port()
    procs = []
    for i in range(num_processes):
        late = i == 1 and late_s > 0
        cli = ["-c", LATE_LOAD.format(late_s=late_s)] if late else ["-m", "serving.cli"]
        cmd = [
            sys.executable, *cli, "generate",
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


@pytest.mark.slow  # make test-heavy has the two-process serve test, the same lockstep engine
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


@pytest.mark.heavy  # 63 s, 35 of them waiting
def test_a_process_late_past_gloos_window_still_joins(checkpoint, tmp_path):
    """gloo gives every process 30 s to reach a device group's first collective; process 1
    loads its model 35 s after process 0, and the run still equals one device: the engine
    opens its groups after a barrier of the coordination service (`open_groups`)."""
    codes, errors = _wait(_launch(checkpoint, tmp_path, late_s=35))
    assert codes == [0, 0], errors
    rows = [json.loads(line) for line in (tmp_path / "out0.jsonl").read_text().splitlines()]
    assert [r["token_ids"] for r in rows] == greedy_generate(base_model(), PROMPTS, MAX_TOKENS)


def _launch_serve(checkpoint, log_dir, http_port: int):
    """Start the processes of one `serve`; process i logs to log_dir/{out,err}{i}.txt."""
    port = _free_port()
    procs = []
    for i in range(2):
        cmd = [
            sys.executable, "-m", "serving.cli", "serve",
            "--model", str(checkpoint), "--dtype", "float32", "--port", str(http_port),
            "--tensor-parallel-size", "8",
            "--coordinator-address", f"localhost:{port}",
            "--num-processes", "2", "--process-id", str(i),
            *SHAPES,
        ]  # fmt: skip
        with open(log_dir / f"out{i}.txt", "w") as out, open(log_dir / f"err{i}.txt", "w") as err:
            procs.append(subprocess.Popen(cmd, env=_env(), stdout=out, stderr=err))
    return procs


def _logs(log_dir) -> str:
    return "\n".join(f"{p.name}:\n{p.read_text()}" for p in sorted(log_dir.glob("*.txt")))


def _wait_healthy(url: str, procs, log_dir) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        assert all(p.poll() is None for p in procs), _logs(log_dir)
        assert time.monotonic() < deadline, "the server did not start\n" + _logs(log_dir)
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)


def _complete(url: str, prompt: list[int], log_dir) -> httpx.Response:
    body = dict(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    try:
        return httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT_S)
    except httpx.TransportError as e:  # a server process died: its logs say why
        pytest.fail(f"{type(e).__name__}: {e}\n{_logs(log_dir)}")


def _tokens(response: httpx.Response) -> list[int]:
    """Greedy token ids (the checkpoint has no tokenizer: they come back as logprob keys)."""
    tokens = response.json()["choices"][0]["logprobs"]["tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens]


@pytest.mark.heavy  # 54 s; the default run keeps the follower test
def test_two_processes_serve_equals_one_device(checkpoint, tmp_path):
    """Process 0 serves HTTP, process 1 follows its engine loop: two concurrent requests (one
    batch) and one alone give the one-device greedy tokens; on SIGINT to process 0 both exit
    0 and the follower has written nothing."""
    http_port = _free_port()
    url = f"http://127.0.0.1:{http_port}"
    procs = _launch_serve(checkpoint, tmp_path, http_port)
    try:
        _wait_healthy(url, procs, tmp_path)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            responses = list(pool.map(lambda p: _complete(url, p, tmp_path), PROMPTS[:2]))
        responses.append(_complete(url, PROMPTS[2], tmp_path))
        time.sleep(1)  # idle: the follower waits on process 0's empty messages
        procs[0].send_signal(signal.SIGINT)
        codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [r.status_code for r in responses] == [200] * 3, _logs(tmp_path)
    assert codes == [0, 0], _logs(tmp_path)
    got = [_tokens(r) for r in responses]
    assert got == greedy_generate(base_model(), PROMPTS, MAX_TOKENS), _logs(tmp_path)
    # gloo's connection lines aside (its threads may interleave their pieces), the follower
    # writes nothing.
    out = (tmp_path / "out1.txt").read_text()
    assert re.sub(GLOO_PIECES, "", out) == "", out
    follower_err = (tmp_path / "err1.txt").read_text()
    assert "token_id" not in follower_err and "Uvicorn" not in follower_err, follower_err


def test_a_follower_ends_when_process_0_dies(checkpoint, tmp_path):
    """Process 0 killed while idle (no stop message can come): the follower, waiting in the
    next broadcast, exits with an error instead of hanging (the broken collective or the
    coordination service ends it, within its 30 s heartbeat at most)."""
    http_port = _free_port()
    procs = _launch_serve(checkpoint, tmp_path, http_port)
    try:
        _wait_healthy(f"http://127.0.0.1:{http_port}", procs, tmp_path)
        procs[0].kill()
        t0 = time.monotonic()
        code = procs[1].wait(timeout=TIMEOUT_S)
        waited = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert code != 0 and waited < 60, _logs(tmp_path)
    err = (tmp_path / "err1.txt").read_text()
    assert re.search(r"^error: |JAX distributed service detected fatal errors", err, re.M), err
