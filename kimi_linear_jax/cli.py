"""`kimi-linear-jax` command line: `generate` (greedy) and `info`."""

from __future__ import annotations

import argparse
import json
import sys
import time


def _load(args):
    from kimi_linear_jax.checkpoint import load_model_and_tokenizer

    return load_model_and_tokenizer(args.model, args.dtype)


def _prompt_ids(args, tokenizer) -> list[int]:
    if args.prompt_ids is not None:
        return [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    if tokenizer is None:
        raise ValueError("this checkpoint has no tokenizer files: pass --prompt-ids 1,2,3")
    if args.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        return tokenizer.encode(text)
    return tokenizer.encode(args.prompt)


def cmd_generate(args) -> int:
    from kimi_linear_jax.generation import greedy_generate

    model, tokenizer = _load(args)
    ids = _prompt_ids(args, tokenizer)
    t0 = time.perf_counter()
    eos = () if args.ignore_eos else model.config.eos_token_ids
    (out,) = greedy_generate(
        model, [ids], args.max_tokens, eos_token_ids=eos, dcp_size=args.dcp_size
    )
    dt = time.perf_counter() - t0
    text = tokenizer.decode(out) if tokenizer is not None else None
    print(
        json.dumps({"prompt_tokens": len(ids), "token_ids": out, "text": text}, ensure_ascii=False)
    )
    print(f"[{len(out)} tokens in {dt:.2f}s incl. compile]", file=sys.stderr)
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kimi-linear-jax")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="greedy continuation of one prompt")
    g.add_argument("--model", default=None, help="checkpoint dir (default: built-in model)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument(
        "--dcp-size", type=int, default=1, help="spread the MLA cache over N devices (DCP)"
    )
    g.set_defaults(func=cmd_generate)
    i = sub.add_parser("info", help="parameter count of a preset (abstract, nothing allocated)")
    i.add_argument("--preset", default="kimi-linear-48b-a3b")
    i.set_defaults(func=cmd_info)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
