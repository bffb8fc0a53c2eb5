"""`kimi-linear-jax` command line: `generate` (one prompt, or a JSONL batch), `serve` (the
OpenAI-compatible server), `plan` (memory per device of a hypothetical device set) and `info`
(a preset's parameter count).

Bad command-line input (a path that is not a checkpoint, a TP size past the device count, a
sampling value out of range) exits with status 2 and one line on stderr naming the problem. In
batch mode a bad line fails alone: its output line has an "error" field.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import sys
import time

from kimi_linear_jax.parallel.mesh import COMBINES
from kimi_linear_jax.tokenizer import validate_messages
from serving.plan_command import add_plan_parser
from serving.sampling import SamplingParams
from serving.train_command import add_train_parser

# Engine flags shared by `generate` and `serve`: (flag, type, default, help), with `LLM`'s
# defaults; each maps onto the `LLM` argument of the same name.
ENGINE_FLAGS = (
    ("--max-num-seqs", int, None, "requests running at once (default: planned, else 8)"),
    ("--page-size", int, 16, "tokens per cache page (per device under DCP)"),
    ("--num-pages", int, None, "pages in the MLA cache pool (default: planned, else 256)"),
    ("--gpu-memory-utilization", float, 0.9, "share of device memory for weights and pools"),
    ("--device-memory", str, None, "bytes per device where the backend reports none: 80GiB"),
    ("--state-memory-ratio", float, 0.9, "planned split: state gets r / (1 + r) of the rest"),
    ("--max-model-len", int, None, "context limit (default: what the model and pool allow)"),
    ("--num-scheduler-steps", int, 1, "decode steps fused into one device call"),
    ("--max-num-batched-tokens", int, 256, "token budget of one step"),
    ("--chunk-size", int, 64, "prefill chunk length"),
)
# Fields a JSONL line may set besides its prompt (the SamplingParams ones) and their JSON types;
# checked here because a wrong type would otherwise fail deep in the engine, not alone.
_NUMBER = (int, float)
LINE_FIELDS = {
    "temperature": _NUMBER,
    "top_p": _NUMBER,
    "top_k": int,
    "min_p": _NUMBER,
    "repetition_penalty": _NUMBER,
    "presence_penalty": _NUMBER,
    "frequency_penalty": _NUMBER,
    "seed": (int, type(None)),
    "max_tokens": int,
    "stop": (str, list),
    "stop_token_ids": (int, list),
    "ignore_eos": bool,
    "logprobs": (int, type(None)),
    "prompt_logprobs": (int, type(None)),
}
assert set(LINE_FIELDS) == {f.name for f in dataclasses.fields(SamplingParams)}


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint dir (default: built-in model)")
    p.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float32"],
        default="auto",
        help="auto: the checkpoint's torch_dtype, float32 for the built-in model",
    )
    for flag, kind, default, text in ENGINE_FLAGS:
        p.add_argument(flag, type=kind, default=default, help=text)
    p.add_argument(
        "--async-scheduling",
        action="store_true",
        help="dispatch the next decode step before the last one's tokens reach the host",
    )
    par = p.add_argument_group("devices (one mesh: TP over heads, experts and vocab; DCP in it)")
    par.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=None,
        help="devices to shard the model over (default: --dcp-size, else 1)",
    )
    par.add_argument(
        "--dcp-size",
        type=int,
        default=None,
        help="spread each sequence's MLA cache over N of the TP devices (divides TP)",
    )
    par.add_argument(
        "--replicate-q-proj",
        action="store_true",
        help="keep q_proj / W_UK whole in each DCP group (no query all-gather)",
    )
    par.add_argument("--dcp-combine", choices=COMBINES, default="ag_rs")
    spec = p.add_argument_group("speculative decoding (off unless --speculative-method)")
    spec.add_argument("--speculative-method", choices=["ngram", "draft_model"], default=None)
    spec.add_argument("--num-draft-tokens", type=int, default=4)
    spec.add_argument("--draft-model", default=None, help="draft checkpoint (draft_model)")
    spec.add_argument("--prompt-lookup-max", type=int, default=3)
    spec.add_argument("--prompt-lookup-min", type=int, default=1)
    hosts = p.add_argument_group(
        "several processes (hosts): one mesh over all their devices; run the same command on "
        "each, with its own --process-id (or set KIMI_COORDINATOR_ADDRESS, KIMI_NUM_PROCESSES, "
        "KIMI_PROCESS_ID)"
    )
    hosts.add_argument("--coordinator-address", default=None, help="HOST:PORT of process 0")
    hosts.add_argument("--num-processes", type=int, default=None)
    hosts.add_argument("--process-id", type=int, default=None)
    cache = p.add_argument_group("prefix caching (on by default)")
    cache.add_argument("--no-prefix-caching", action="store_true")
    cache.add_argument("--num-checkpoint-slots", type=int, default=None)
    cache.add_argument("--track-interval", type=int, default=None)


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("sampling (greedy unless --temperature > 0)")
    s.add_argument("--max-tokens", type=int, default=32)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=-1)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--presence-penalty", type=float, default=0.0)
    s.add_argument("--frequency-penalty", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--stop-token-ids", default="", help="comma-separated token ids")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--logprobs", type=int, default=None, help="return the top N logprobs")
    s.add_argument(
        "--prompt-logprobs",
        type=int,
        default=None,
        help="return each prompt token's logprob and the top N there",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kimi-linear-jax")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate from one prompt or a JSONL file of prompts")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    src.add_argument("--input", help="JSONL file of requests ('-' for stdin)")
    g.add_argument("--chat", action="store_true", help="wrap --prompt in the chat template")
    g.add_argument("--output", default=None, help="JSONL output file (default: stdout)")
    g.add_argument(
        "--output-format",
        choices=["json", "text"],
        default="json",
        help="text: print the prompt and its continuation as plain text (one --prompt)",
    )
    _add_model_flags(g)
    _add_sampling_flags(g)
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_model_flags(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--max-queue", type=int, default=256, help="waiting requests before 503")
    s.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    s.add_argument("--enable-docs", action="store_true", help="serve /docs and /openapi.json")
    s.set_defaults(func=cmd_serve)

    add_plan_parser(sub)
    add_train_parser(sub)

    i = sub.add_parser("info", help="parameter count of a preset (abstract, nothing allocated)")
    i.add_argument("--preset", default="kimi-linear-48b-a3b")
    i.set_defaults(func=cmd_info)
    return p


# ---- building things from flags ----------------------------------------------------------------


def _ids(text: str, what: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None


def sampling_from_args(args):
    """SamplingParams from the flags, checked at once (the vocabulary bound waits for the
    model) so a bad value fails before the model loads."""
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
        stop_token_ids=tuple(_ids(args.stop_token_ids, "--stop-token-ids")),
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs,
    )
    params.validate(sys.maxsize)
    return params


class _Stderr(logging.Handler):
    """Writes to the sys.stderr of the moment (a StreamHandler keeps the stream it was given,
    which a test's capture may have closed since)."""

    def emit(self, record) -> None:
        print(self.format(record), file=sys.stderr)


def _show_engine_log() -> None:
    """The engine's start-up line (its memory plan) on stderr; stdout stays the results."""
    log = logging.getLogger("kimi_linear_jax.engine")
    if not any(isinstance(h, _Stderr) for h in log.handlers):
        log.addHandler(_Stderr())
        log.setLevel(logging.INFO)


def llm_from_args(args):
    from serving.engine import LLM

    _show_engine_log()
    names = [flag[2:].replace("-", "_") for flag, *_ in ENGINE_FLAGS]
    speculative = None
    if args.speculative_method is not None:
        speculative = {
            "method": args.speculative_method,
            "num_draft_tokens": args.num_draft_tokens,
            "model": args.draft_model,
            "prompt_lookup_max": args.prompt_lookup_max,
            "prompt_lookup_min": args.prompt_lookup_min,
        }
    return LLM(
        args.model,
        distributed=_distributed(args),
        dtype=args.dtype,
        speculative=speculative,
        enable_prefix_caching=not args.no_prefix_caching,
        num_checkpoint_slots=args.num_checkpoint_slots,
        track_interval=args.track_interval,
        tensor_parallel_size=args.tensor_parallel_size,
        dcp_size=args.dcp_size,
        replicate_q_proj=args.replicate_q_proj,
        dcp_combine=args.dcp_combine,
        async_scheduling=args.async_scheduling,
        **{name: getattr(args, name) for name in names},
    )


def _distributed(args) -> dict | None:
    """The three process flags together, or none (then the environment decides)."""
    given = {
        "coordinator_address": args.coordinator_address,
        "num_processes": args.num_processes,
        "process_id": args.process_id,
    }
    if all(v is None for v in given.values()):
        return None
    missing = [f"--{k.replace('_', '-')}" for k, v in given.items() if v is None]
    if missing:
        raise ValueError(f"several processes need all three flags; missing {', '.join(missing)}")
    return given


def _leader() -> bool:
    """Whether this process writes results (process 0; the only one without several)."""
    from kimi_linear_jax.parallel.distributed import is_leader

    return is_leader()


# ---- generate ----------------------------------------------------------------------------------


def _result(out) -> dict:
    """One output line."""
    if out.finish_reason == "error":
        return {"error": re.sub(r"^prompt \d+: ", "", out.error or "error")}
    line = {
        "prompt_tokens": len(out.prompt_token_ids),
        "token_ids": out.token_ids,
        "text": out.text,
        "finish_reason": out.finish_reason,
    }
    if out.logprobs is not None:
        line["logprobs"] = [{str(t): lp for t, lp in d.items()} for d in out.logprobs]
    if out.prompt_logprobs is not None:
        line["prompt_logprobs"] = [
            None if d is None else {str(t): lp for t, lp in d.items()} for d in out.prompt_logprobs
        ]
    return line


def _single(args, llm, params, prompt) -> int:
    if args.chat:
        (out,) = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)
    else:
        (out,) = llm.generate([prompt], params, use_tqdm=False)
    if out.finish_reason == "error":
        raise ValueError(_result(out)["error"])
    if args.output_format == "text" and _leader():
        shown = prompt if isinstance(prompt, str) and not args.chat else ""
        sys.stdout.write(shown + (out.text or "") + "\n")
    else:
        _write_lines(args.output, [_result(out)])
    return len(out.token_ids)


def parse_line(line: str, defaults, llm):
    """(prompt, SamplingParams) of one JSONL line; raises ValueError naming the problem."""
    try:
        request = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(request, dict):
        raise ValueError("a line must be a JSON object")
    unknown = set(request) - set(LINE_FIELDS) - {"prompt", "messages"}
    if unknown:
        raise ValueError(f"unknown field(s) {sorted(unknown)}")
    fields = {k: _typed(k, v) for k, v in request.items() if k in LINE_FIELDS}
    params = dataclasses.replace(defaults, **fields)
    params.validate(llm.config.vocab_size)
    return _line_prompt(request, llm), params


def _typed(name: str, value):
    """A line's sampling field, type-checked; stop / stop_token_ids as tuples."""
    ok = isinstance(value, LINE_FIELDS[name]) and (name == "ignore_eos") == isinstance(value, bool)
    if name in ("stop", "stop_token_ids"):
        value = value if isinstance(value, list) else [value]
        kind = str if name == "stop" else int
        ok = ok and all(isinstance(v, kind) and not isinstance(v, bool) for v in value)
        value = tuple(value)
    if not ok:
        raise ValueError(f"{name} has the wrong type: {value!r:.60}")
    return value


def _line_prompt(request: dict, llm):
    if ("prompt" in request) == ("messages" in request):
        raise ValueError('a line needs exactly one of "prompt" and "messages"')
    if "prompt" in request:
        prompt = request["prompt"]
        if not isinstance(prompt, str | list):
            raise ValueError("prompt must be a string or a list of token ids")
        return prompt
    validate_messages(request["messages"])
    if llm.tokenizer is None:
        raise ValueError("messages need a tokenizer; this model has none")
    return llm.tokenizer.encode_chat(request["messages"])  # content stays plain text


def _batch(args, llm, defaults, lines: list[str]) -> int:
    """Every valid line goes to one `generate` call (so they batch); bad lines get an error
    line in their place."""
    results: list[dict | None] = [None] * len(lines)
    prompts, params, where = [], [], []
    for n, line in enumerate(lines):
        try:
            prompt, p = parse_line(line, defaults, llm)
        except ValueError as e:
            results[n] = {"error": f"line {n + 1}: {e}"}
            continue
        prompts.append(prompt)
        params.append(p)
        where.append(n)
    outs = llm.generate(prompts, params, use_tqdm=_leader()) if prompts else []
    for n, out in zip(where, outs, strict=True):
        results[n] = _result(out)
        if "error" in results[n]:
            results[n]["error"] = f"line {n + 1}: {results[n]['error']}"
    _write_lines(args.output, results)
    return sum(len(r.get("token_ids", ())) for r in results)


def _write_lines(path: str | None, rows: list[dict]) -> None:
    if not _leader():  # a follower ran the same steps; process 0 writes the results
        return
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    if path is None:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        with open(path, "w") as f:
            f.write(text)


def _prompt_or_lines(args):
    """The prompt (text or ids), or for --input the non-blank lines of the file."""
    if args.input is not None:
        if args.chat:
            raise ValueError('--chat applies to --prompt; in --input lines use "messages"')
        if args.output_format != "json":
            raise ValueError("--output-format text applies to --prompt; --input writes JSONL")
        text = sys.stdin.read() if args.input == "-" else open(args.input).read()
        return [line for line in text.splitlines() if line.strip()]
    if args.prompt_ids is None:
        return args.prompt
    if args.chat:
        raise ValueError("--chat needs --prompt text, not --prompt-ids")
    return _ids(args.prompt_ids, "--prompt-ids")


def cmd_generate(args) -> int:
    # Everything that can fail on the flags alone fails before the model loads.
    params = sampling_from_args(args)
    prompt = _prompt_or_lines(args)
    llm = llm_from_args(args)
    t0 = time.perf_counter()
    if args.input is not None:
        tokens = _batch(args, llm, params, prompt)
    else:
        tokens = _single(args, llm, params, prompt)
    dt = time.perf_counter() - t0
    if _leader():
        print(f"[{tokens} tokens in {dt:.2f}s incl. compile]", file=sys.stderr)
    return 0


# ---- serve and info ----------------------------------------------------------------------------


def cmd_serve(args) -> int:
    from serving.server import model_name_for, serve

    if args.max_queue < 0 or not args.request_timeout > 0:
        raise ValueError("--max-queue must be >= 0 and --request-timeout > 0")
    llm = llm_from_args(args)
    if not _leader():  # requests reach process 0; the others replay its engine loop
        return _follow(llm)
    name = model_name_for(args.model, args.served_model_name)
    serve(
        llm,
        host=args.host,
        port=args.port,
        model_name=name,
        max_queue=args.max_queue,
        request_timeout=args.request_timeout,
        enable_docs=args.enable_docs,
    )
    return 0


def _follow(llm) -> int:
    """`serve` on a process other than 0: no server, no output; exit 0 when process 0 stops."""
    from serving.lockstep import follow

    try:
        follow(llm)
    except Exception as e:  # noqa: BLE001 - out of step with process 0: end, loudly
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        # Not a normal exit: jax.distributed's shutdown at exit is a barrier that process 0,
        # waiting for this process in a collective, would never reach. Leaving at once lets
        # the coordination service's heartbeat end it too.
        os._exit(1)
    return 0


def cmd_info(args) -> int:
    import jax
    from flax import nnx

    from kimi_linear_jax.config import preset
    from kimi_linear_jax.model import KimiLinearForCausalLM

    cfg = preset(args.preset)
    abstract = nnx.eval_shape(lambda: KimiLinearForCausalLM(cfg, dtype=jax.numpy.bfloat16))
    leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
    count = sum(x.size for x in leaves)
    nbytes = sum(x.size * x.dtype.itemsize for x in leaves)
    print(json.dumps({"preset": args.preset, "parameters": count, "bytes_bf16": nbytes}))
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse already printed the usage error (status 2)
        return int(e.code or 0)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
