"""`kimi-linear-jax` command line: `generate` (one prompt, or a JSONL batch), `serve` (the
OpenAI-compatible server), `plan` (memory per device of a hypothetical device set) and `info`
(a preset's parameter count).

Bad command-line input (a path that is not a checkpoint, a TP size past the device count, a
sampling value out of range) exits with status 2 and one line on stderr naming the problem. In
batch mode a bad line fails alone: its output line has an "error" field.

The engine flags and the `LLM` they build are in `engine_args.py`; `generate`, `plan` and
`train` each have their module (`generate_command.py`, `plan_command.py`, `train_command.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from kimi_linear_jax.parallel.plan_command import add_plan_parser
from kimi_linear_jax.train_command import add_train_parser
from serving.engine_args import (
    ENGINE_FLAGS,  # noqa: F401  (re-exported)
    _add_model_flags,
    _leader,
    llm_from_args,
)
from serving.generate_command import (  # noqa: F401  (re-exported: cli's names before the split)
    LINE_FIELDS,
    add_generate_parser,
    cmd_generate,
    parse_line,
    sampling_from_args,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kimi-linear-jax")
    sub = p.add_subparsers(dest="command", required=True)

    add_generate_parser(sub)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_model_flags(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--max-queue", type=int, default=256, help="waiting requests before 503")
    s.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    s.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=5.0,
        help="seconds an idle HTTP connection stays open; behind a load balancer, set it above "
        "the balancer's idle timeout",
    )
    s.add_argument("--enable-docs", action="store_true", help="serve /docs and /openapi.json")
    s.add_argument(
        "--max-request-bytes",
        type=int,
        default=32 << 20,
        help="largest request body in bytes (default 32 MiB); a larger one is a 413",
    )
    s.set_defaults(func=cmd_serve)

    add_plan_parser(sub)
    add_train_parser(sub)

    i = sub.add_parser("info", help="parameter count of a preset (abstract, nothing allocated)")
    i.add_argument("--preset", default="kimi-linear-48b-a3b")
    i.set_defaults(func=cmd_info)
    return p


# ---- serve and info ----------------------------------------------------------------------------


def cmd_serve(args) -> int:
    from serving.launcher import model_name_for, serve

    if args.max_queue < 0 or not args.request_timeout > 0:
        raise ValueError("--max-queue must be >= 0 and --request-timeout > 0")
    if not args.timeout_keep_alive > 0:
        raise ValueError(f"--timeout-keep-alive must be > 0, got {args.timeout_keep_alive:g}")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    llm = llm_from_args(args)
    if not _leader():  # requests reach process 0; the others replay its engine loop
        return _follow(llm)
    name = model_name_for(args.model, args.served_model_name)
    serve(
        llm,
        host=args.host,
        port=args.port,
        timeout_keep_alive=args.timeout_keep_alive,
        model_name=name,
        max_queue=args.max_queue,
        request_timeout=args.request_timeout,
        enable_docs=args.enable_docs,
        max_request_bytes=args.max_request_bytes,
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

    from kimi_linear_jax.model import KimiLinearForCausalLM
    from kimi_linear_jax.presets import preset

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


def entry() -> None:
    """The `kimi-linear-jax` script: `main` in a process of its own. `generate` and `serve` on a
    CPU first keep freed host memory (kimi_linear_jax/heap.py), before JAX computes anything;
    `main` called in-process (tests, notebooks) leaves the host's malloc alone."""
    argv = sys.argv[1:]
    if argv and argv[0] in ("generate", "serve"):
        from kimi_linear_jax import heap

        try:
            heap.for_serving()
        except ValueError as e:  # a bad KIMI_LINEAR_JAX_MALLOC
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
    sys.exit(main(argv))


if __name__ == "__main__":
    entry()
