"""The `kimi-linear-jax` command line, run in-process on a tiny random checkpoint.

Every call uses the same engine flags (ENGINE), so the jitted steps compile once for the file
and the reference `LLM` shares them.
"""

from __future__ import annotations

import io
import json

import pytest

from kimi_linear_jax.testing import make_tiny_checkpoint
from serving import cli, generate_command
from serving.cli import main
from serving.core.sampling import SamplingParams
from serving.engine import LLM

# One running sequence: every step has batch bucket 1, so the whole file compiles one prefill and
# one decode shape (batch mode still runs its lines through one `generate` call).
ENGINE = dict(page_size=4, num_pages=32, max_num_seqs=1, max_num_batched_tokens=64, chunk_size=16)
FLAGS = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
# Both shorter than one prefill chunk: no chunked-prefill variant to compile.
PROMPTS = [[5, 6, 7], list(range(10, 22))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_checkpoint(path, seed=3)
    return str(path)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Greedy outputs of the offline API on the same checkpoint: 4 and 6 tokens."""
    llm = LLM(checkpoint, **ENGINE)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (4, 6)]
    return llm.generate(PROMPTS, params, use_tqdm=False)


def run(capsys, *argv):
    rc = main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_generate_greedy_equals_llm(checkpoint, reference, capsys):
    rc, out, _ = run(
        capsys,
        "generate",
        "--model",
        checkpoint,
        "--prompt-ids",
        "5,6,7",
        "--max-tokens",
        "4",
        *FLAGS,
    )
    assert rc == 0
    (line,) = out.strip().splitlines()
    got = json.loads(line)
    assert got["token_ids"] == reference[0].token_ids
    assert got["prompt_tokens"] == 3
    assert got["finish_reason"] == reference[0].finish_reason
    assert got["text"] is None  # no tokenizer files in this checkpoint
    assert "logprobs" not in got


def test_prompt_logprobs_flag_and_line_field(checkpoint, reference, capsys, tmp_path):
    """`--prompt-logprobs N` adds "prompt_logprobs" (entry 0 null, then token id -> logprob,
    as "logprobs"), equal to the offline API's; a JSONL line sets its own, a bad one fails
    alone."""
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)
    (want,) = LLM(checkpoint, **ENGINE).generate(PROMPTS[:1], params, use_tqdm=False)
    argv = ["generate", "--model", checkpoint, *FLAGS, "--max-tokens", "4"]
    rc, out, _ = run(capsys, *argv, "--prompt-ids", "5,6,7", "--prompt-logprobs", "2")
    assert rc == 0
    got = json.loads(out)
    assert got["token_ids"] == reference[0].token_ids
    assert got["prompt_logprobs"][0] is None and len(got["prompt_logprobs"]) == 3
    for line, entry in zip(got["prompt_logprobs"][1:], want.prompt_logprobs[1:], strict=True):
        assert {int(t): lp for t, lp in line.items()} == pytest.approx(entry)
    path = tmp_path / "in.jsonl"
    lines = [{"prompt": PROMPTS[0], "prompt_logprobs": 0}, {"prompt": PROMPTS[0]}]
    lines.append({"prompt": PROMPTS[0], "prompt_logprobs": -1})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    rc, out, _ = run(capsys, *argv[:-1], "2", "--input", str(path))
    rows = [json.loads(x) for x in out.strip().splitlines()]
    assert rc == 0 and [len(e) for e in rows[0]["prompt_logprobs"][1:]] == [1, 1]
    assert "prompt_logprobs" not in rows[1]
    assert "prompt_logprobs must be in [0, 20], got -1" in rows[2]["error"]


def test_batch_jsonl_bad_lines_fail_alone(checkpoint, reference, capsys, tmp_path, monkeypatch):
    BANNED = str(reference[0].token_ids[0])  # noqa: N806 - a line's logit_bias bans it
    lines = [
        json.dumps({"prompt": PROMPTS[0], "max_tokens": 4}),
        "this is not json",
        json.dumps({"prompt": [1, 2, 999], "max_tokens": 4}),  # token id past the vocabulary
        json.dumps({"prompt": PROMPTS[1], "temperature": -1}),
        json.dumps({"prompt": PROMPTS[1], "max_tokens": 6, "logprobs": 2}),
        json.dumps({"prompt": PROMPTS[0], "colour": "red"}),
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}),  # no tokenizer
        json.dumps({"prompt": PROMPTS[0], "seed": "abc"}),
        '{"prompt": [1e400]}',  # json reads inf
        json.dumps({"messages": [{"role": ["user"], "content": "x"}]}),
        json.dumps({"prompt": [1.5, 2]}),
        json.dumps({"prompt": PROMPTS[0], "max_tokens": 4, "logit_bias": {"x": 1}}),
        json.dumps({"prompt": PROMPTS[0], "max_tokens": 4, "logit_bias": [1]}),
        json.dumps({"prompt": PROMPTS[0], "max_tokens": 4, "logit_bias": {BANNED: -100}}),
    ]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    out_file = tmp_path / "out.jsonl"
    argv = ["generate", "--model", checkpoint, "--input", "-", "--output", str(out_file)]
    rc, out, _ = run(capsys, *argv, "--max-tokens", "3", *FLAGS)
    assert rc == 0 and out == ""
    rows = [json.loads(x) for x in out_file.read_text().splitlines()]
    assert len(rows) == len(lines)
    assert rows[0]["token_ids"] == reference[0].token_ids
    assert rows[4]["token_ids"] == reference[1].token_ids
    assert len(rows[4]["logprobs"]) == len(rows[4]["token_ids"])
    for n, match in [
        (1, "line 2: not JSON"),
        (2, "line 3: token id 999 is outside the vocabulary"),
        (3, "line 4: temperature must be >= 0"),
        (5, "line 6: unknown field(s) ['colour']"),
        (6, "line 7: messages need a tokenizer"),
        (7, "line 8: seed has the wrong type"),
        (8, "line 9: prompt must be a str or a list of token ids (ints), got inf"),
        (9, "line 10: messages[0]['role'] must be one of"),
        (10, "line 11: prompt must be a str or a list of token ids (ints), got 1.5"),
        (11, "line 12: logit_bias: key 'x' is not a token id"),
        (12, "line 13: logit_bias has the wrong type"),
    ]:
        assert set(rows[n]) == {"error"} and match in rows[n]["error"], rows[n]
    assert rows[13]["token_ids"][0] != reference[0].token_ids[0]


def test_batch_jsonl_file_to_stdout(checkpoint, reference, capsys, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[::-1]))
    rc, out, _ = run(
        capsys, "generate", "--model", checkpoint, "--input", str(path), *FLAGS, "--max-tokens", "4"
    )
    assert rc == 0
    rows = [json.loads(x) for x in out.strip().splitlines()]
    assert rows[1]["token_ids"] == reference[0].token_ids
    assert rows[0]["token_ids"] == reference[1].token_ids[:4]  # greedy: a prefix of 6


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--model", "{tmp}/nope", "--prompt", "hi"], "not a checkpoint"),
        (["--prompt-ids", "1,2", "--dcp-size", "64"], "(dcp_size 64) asks for more devices"),
        (["--prompt-ids", "1,2", "--temperature", "-1"], "temperature must be >= 0"),
        (["--prompt-ids", "1,2", "--prompt-logprobs", "21"], "prompt_logprobs must be in"),
        (["--prompt-ids", "1,x"], "--prompt-ids must be comma-separated integers"),
        (["--model", "{ckpt}", "--prompt", "hi"], "a text prompt needs a tokenizer"),
        (["--model", "{ckpt}", "--prompt-ids", "1,2,999"], "token id 999 is outside"),
        (["--input", "{tmp}/missing.jsonl"], "No such file"),
        (
            ["--model", "{ckpt}", "--prompt-ids", "1", "--speculative-method", "draft_model"],
            "drafts for the built-in default model only",
        ),
        (["--prompt-ids", "1", "--track-interval", "48"], "multiple of the checkpoint grid 64"),
        (
            ["--model", "{ckpt}", "--prompt-ids", "1", "--speculative-method", "ngram"]
            + ["--speculative-corpus", "{ckpt}/config.json"],
            "speculative corpus needs a tokenizer",
        ),
        (
            ["--prompt-ids", "1", "--speculative-method", "ngram"]
            + ["--speculative-corpus", "{tmp}/none", "--corpus-num-tokens", "2"],
            "none' is neither a file nor a directory",
        ),
        (
            ["--prompt-ids", "1", "--speculative-method", "ngram", "--speculative-topk", "9"],
            "speculative topk must be in",
        ),
        (["--prompt-ids", "1", "--num-processes", "2"], "missing --coordinator-address"),
        (
            [
                "--prompt-ids",
                "1",
                "--coordinator-address",
                "nohost",
                "--num-processes",
                "2",
                "--process-id",
                "0",
            ],
            "coordinator_address must be HOST:PORT",
        ),  # fmt: skip
        (
            [
                "--prompt-ids",
                "1",
                "--coordinator-address",
                "localhost:1",
                "--num-processes",
                "2",
                "--process-id",
                "2",
            ],
            "process_id must be in [0, 2)",
        ),  # fmt: skip
    ],
)
def test_bad_input_exits_2(checkpoint, capsys, tmp_path, argv, match):
    argv = [a.format(tmp=tmp_path, ckpt=checkpoint) for a in argv]
    rc, out, err = run(capsys, "generate", *argv, *FLAGS)
    assert rc == 2 and out == ""
    assert match in err and "Traceback" not in err


def test_argparse_error_exits_2(capsys):
    rc, _, err = run(capsys, "generate", "--max-tokens", "many", "--prompt", "x")
    assert rc == 2 and "invalid int value" in err


def test_info(capsys):
    rc, out, _ = run(capsys, "info", "--preset", "tiny")
    got = json.loads(out)
    assert rc == 0 and got["preset"] == "tiny" and got["parameters"] > 0


def test_speculative_flags_keep_greedy_output(checkpoint, reference, capsys):
    argv = ["generate", "--model", checkpoint, "--prompt-ids", "5,6,7", "--max-tokens", "4"]
    spec = ["--speculative-method", "ngram", "--num-draft-tokens", "2", "--no-prefix-caching"]
    rc, out, _ = run(capsys, *argv, *FLAGS, *spec)
    assert rc == 0 and json.loads(out)["token_ids"] == reference[0].token_ids


def test_lookup_first_flags_keep_greedy_output(checkpoint, reference, capsys, monkeypatch):
    built, real = [], generate_command.llm_from_args
    monkeypatch.setattr(
        generate_command, "llm_from_args", lambda args: built.append(real(args)) or built[-1]
    )
    argv = ["generate", "--model", checkpoint, "--prompt-ids", "5,6,7", "--max-tokens", "4"]
    spec = ["--speculative-method", "draft_model", "--draft-model", checkpoint]
    spec += ["--num-draft-tokens", "2", "--prompt-lookup-num-tokens", "4"]
    rc, out, _ = run(capsys, *argv, *FLAGS, *spec, "--no-prefix-caching")
    assert rc == 0 and json.loads(out)["token_ids"] == reference[0].token_ids
    config = built[0].speculative
    assert (config.num_draft_tokens, config.prompt_lookup_num_tokens) == (2, 4)


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        (["--speculative-topk", "2"], ("fixed", 2)),
        (["--speculative-width-policy", "cost"], ("cost", 1)),
    ],
)
def test_tree_and_width_flags_keep_greedy_output(
    checkpoint, reference, capsys, monkeypatch, flags, want
):
    built, real = [], generate_command.llm_from_args
    monkeypatch.setattr(
        generate_command, "llm_from_args", lambda args: built.append(real(args)) or built[-1]
    )
    argv = ["generate", "--model", checkpoint, "--prompt-ids", "5,6,7", "--max-tokens", "4"]
    spec = ["--speculative-method", "draft_model", "--draft-model", checkpoint]
    spec += ["--num-draft-tokens", "2", *flags, "--no-prefix-caching"]
    rc, out, _ = run(capsys, *argv, *FLAGS, *spec)
    assert rc == 0 and json.loads(out)["token_ids"] == reference[0].token_ids
    config = built[0].speculative
    assert (config.width_policy, config.topk) == want


def test_async_scheduling_flag_keeps_greedy_output(checkpoint, reference, capsys, monkeypatch):
    built, real = [], generate_command.llm_from_args
    monkeypatch.setattr(
        generate_command, "llm_from_args", lambda args: built.append(real(args)) or built[-1]
    )
    argv = ["generate", "--model", checkpoint, "--prompt-ids", "5,6,7", "--max-tokens", "4"]
    rc, out, _ = run(capsys, *argv, *FLAGS, "--async-scheduling")
    assert rc == 0 and json.loads(out)["token_ids"] == reference[0].token_ids
    assert built[0].async_scheduling and built[0].metrics()["overlapped_steps"] > 0


@pytest.mark.parametrize(
    "devices",
    [
        pytest.param(["-tp", "2"], marks=pytest.mark.heavy),
        ["--tensor-parallel-size", "4", "--dcp-size", "2"],
    ],
)
def test_parallel_flags_keep_greedy_output(checkpoint, reference, capsys, devices):
    argv = ["generate", "--model", checkpoint, "--prompt-ids", "5,6,7", "--max-tokens", "4"]
    rc, out, _ = run(capsys, *argv, *FLAGS, *devices)
    assert rc == 0 and json.loads(out)["token_ids"] == reference[0].token_ids


def test_config_of_a_wrong_type_exits_2(capsys, tmp_path):
    """Issue 12, defect 9: a config.json field of the wrong type is a named error, exit 2."""
    from kimi_linear_jax.presets import preset

    hf = preset("tiny").to_hf_config()
    hf["hidden_size"] = "64"
    (tmp_path / "config.json").write_text(json.dumps(hf))
    (tmp_path / "model.safetensors").write_bytes(b"unused")
    rc, out, err = run(capsys, "generate", "--model", str(tmp_path), "--prompt-ids", "1")
    assert rc == 2 and "hidden_size must be an integer >= 1, got '64'" in err


def test_tp_not_dividing_the_heads_exits_2(checkpoint, capsys):
    rc, out, err = run(capsys, "generate", "--prompt-ids", "1", "-tp", "3", *FLAGS)
    # The built-in model has 4 MLA and KDA heads: 3 does not divide them.
    assert rc == 2 and "tensor_parallel_size 3 must divide the MLA heads" in err


# ---- plan ----------------------------------------------------------------------------------------

PLAN_KEYS = {
    "weights_bytes_per_device",
    "kv_bytes_per_token_per_device",
    "state_bytes_per_slot_per_device",
    "num_pages",
    "page_size",
    "num_state_slots",
    "max_num_seqs",
    "max_tokens_in_cache",
    "activation_bytes",
    "fits",
    "reason",
}


def test_plan_json_has_the_keys(capsys):
    rc, out, _ = run(
        capsys,
        *("plan", "--preset", "kimi-linear-48b-a3b", "--tensor-parallel-size", "8"),
        *("--dcp-size", "8", "--device-memory", "80GiB", "--gpu-memory-utilization", "0.9"),
        *("--max-model-len", "131072", "--num-draft-tokens", "4", "--json"),
    )
    assert rc == 0
    plan = json.loads(out)
    assert PLAN_KEYS <= set(plan)
    assert plan["fits"] is True and plan["reason"] is None and plan["dtype"] == "bfloat16"
    assert plan["kv_bytes_per_token_per_device"] == 7 * 576 * 2 / 8
    # 20 KDA layers x (S: 32/8 heads x 128 x 128 fp32 + 3 conv windows of 3 x 4096/8 bf16)
    assert plan["state_bytes_per_slot_per_device"] == 20 * (4 * 128 * 128 * 4 + 3 * 3 * 512 * 2)
    assert plan["max_tokens_in_cache"] == (plan["num_pages"] - 1) * 16 * 8


def test_plan_that_does_not_fit_exits_1_with_the_reason(capsys):
    rc, out, _ = run(capsys, "plan", "--device-memory", "80GB", "--max-model-len", "4096")
    assert rc == 1
    assert "fits" in out and "no: weights 91.50 GiB" in out


def test_plan_of_a_config_json_takes_its_torch_dtype(checkpoint, capsys):
    rc, out, _ = run(capsys, "plan", "--config", checkpoint, "--device-memory", "64MiB", "--json")
    assert rc == 0
    plan = json.loads(out)
    assert plan["dtype"] == "float32"  # the tiny checkpoint was saved in float32
    assert plan["kv_bytes_per_token_per_device"] == 1 * (32 + 8) * 4


def test_plan_bad_input_exits_2(capsys):
    rc, out, err = run(capsys, "plan", "--device-memory", "80 furlongs")
    assert rc == 2 and out == "" and "cannot read '80 furlongs'" in err


def test_plan_needs_a_device_memory_or_a_target(capsys):
    rc, out, err = run(capsys, "plan", "--preset", "pycode")
    assert rc == 2 and out == "" and "--device-memory is needed without --target" in err


def test_plan_unknown_target_names_the_known_ones(capsys):
    rc, out, err = run(capsys, "plan", "--preset", "pycode", "--target", "h900")
    assert rc == 2 and out == "" and "unknown GPU target 'h900'; known: ['h200']" in err


def test_plan_target_without_the_cuda_plugin_says_how_to_get_it(capsys, monkeypatch):
    from jax.experimental import topologies

    from kernels import gpu_target

    def no_plugin(*args, **kwargs):  # what jax raises where no CUDA plugin is installed
        raise NotImplementedError("Topology descriptions are not implemented for cuda")

    monkeypatch.setattr(topologies, "get_topology_desc", no_plugin)
    gpu_target.topology.cache_clear()
    try:
        rc, out, err = run(capsys, "plan", "--preset", "pycode", "--target", "h200")
    finally:
        gpu_target.topology.cache_clear()
    assert rc == 2 and out == ""
    assert "deviceless GPU compiles need the CUDA plugin: pip install -e '.[gpu-compile]'" in err


def _as_follower(monkeypatch, follow):
    """`serve` as process 1 of a group: no model load, no process group (stubs)."""
    import serving.launcher
    import serving.lockstep

    monkeypatch.setattr(cli, "llm_from_args", lambda args: "llm")
    monkeypatch.setattr(cli, "_leader", lambda: False)
    monkeypatch.setattr(serving.lockstep, "follow", follow)
    monkeypatch.setattr(serving.launcher, "serve", lambda *a, **k: pytest.fail("served"))


def test_serve_on_a_follower_replays_process_0_and_prints_nothing(monkeypatch, capsys):
    """Several processes (issue 14): process 0 serves; another runs the lockstep follower
    (no HTTP server) and exits 0 when process 0 stops."""
    followed = []
    _as_follower(monkeypatch, followed.append)
    rc, out, err = run(capsys, "serve", "--port", "1")
    assert (rc, out, err, followed) == (0, "", "", ["llm"])


def test_serve_on_a_follower_out_of_step_exits_1_at_once(monkeypatch, capsys):
    """A follower that can no longer follow names why and leaves without jax's exit barrier
    (process 0 would never reach it)."""

    def follow(llm):
        raise RuntimeError("process 0 stopped the engine: boom")

    class Exited(Exception):
        pass

    def exit_now(code):
        raise Exited(code)

    _as_follower(monkeypatch, follow)
    monkeypatch.setattr(cli.os, "_exit", exit_now)
    with pytest.raises(Exited) as exited:
        main(["serve"])
    assert exited.value.args == (1,)
    assert "error: RuntimeError: process 0 stopped the engine: boom" in capsys.readouterr().err


def test_serve_passes_the_keep_alive_and_refuses_a_bad_one(monkeypatch, capsys):
    """`--timeout-keep-alive` reaches uvicorn; one that is not > 0 is refused before any model
    loads."""
    import serving.launcher

    seen = {}
    monkeypatch.setattr(cli, "llm_from_args", lambda args: "llm")
    monkeypatch.setattr(cli, "_leader", lambda: True)
    monkeypatch.setattr(serving.launcher, "serve", lambda llm, **kw: seen.update(kw))
    assert run(capsys, "serve", "--timeout-keep-alive", "75")[0] == 0
    assert seen["timeout_keep_alive"] == 75
    rc, out, err = run(capsys, "serve", "--timeout-keep-alive", "0")
    assert (rc, out) == (2, "")
    assert "--timeout-keep-alive must be > 0, got 0" in err and "Traceback" not in err
