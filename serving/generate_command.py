"""`kimi-linear-jax generate`: one prompt (text, token ids, or a chat message), or a JSONL batch
(`--input`) of prompts or conversations with per-line sampling fields, all in one `generate`
call so they batch. Results are JSON lines (or plain text for one `--prompt`); in batch mode a
bad line fails alone: its output line has an "error" field."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time

from kimi_linear_jax.tokenizer import validate_messages
from serving.core.sampling import SamplingParams, logit_bias_from_json
from serving.engine_args import _add_model_flags, _leader, llm_from_args

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
    "logit_bias": dict,  # OpenAI's {"token id": bias}
}
assert set(LINE_FIELDS) == {f.name for f in dataclasses.fields(SamplingParams)}


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


def add_generate_parser(sub) -> None:
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
    return logit_bias_from_json(value) if name == "logit_bias" else value


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
