"""`kimi-linear-jax train`: the training loop (`kimi_linear_jax/train.py`) from the command
line. Writes to --out: the Hugging Face export (config.json, model.safetensors, tokenizer.json),
train_log.jsonl, data.json (the held-out split) and checkpoints/ (the Orbax train state that
--resume continues from).
"""

from __future__ import annotations

import dataclasses
import json


def add_train_parser(sub) -> None:
    t = sub.add_parser("train", help="train a model (AdamW, resumable) and export it")
    t.add_argument("--data", required=True, help="'stdlib', a directory or a text file")
    src = t.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="model shapes by name (e.g. pycode, tiny)")
    src.add_argument("--config", help="a config.json (its vocab follows the tokenizer)")
    t.add_argument("--out", required=True, help="output directory")
    t.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary (new runs)")
    t.add_argument("--seq-len", type=int, default=256)
    t.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch")
    t.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    t.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    t.add_argument("--warmup-steps", type=int, default=50)
    t.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor / peak")
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--grad-clip", type=float, default=1.0, help="global norm")
    t.add_argument("--max-steps", type=int, default=1000, help="the schedule's length")
    t.add_argument("--run-steps", type=int, default=None, help="stop after N steps this run")
    t.add_argument("--time-budget", type=float, default=None, help="seconds, then stop+save")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--eval-every", type=int, default=100)
    t.add_argument("--eval-batches", type=int, default=8)
    t.add_argument("--save-every", type=int, default=100)
    t.add_argument("--export-dtype", choices=["float32", "bfloat16"], default="float32")
    t.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="shard the model over N devices by its TP rules (N devices, no data parallelism); "
        "1: split the batch over every local device",
    )
    t.add_argument(
        "--distill-from",
        metavar="PATH",
        help="a checkpoint of the same vocabulary: train on the KL divergence to its "
        "next-token distributions (a draft model for it) instead of the data's next token",
    )
    t.add_argument(
        "--init-from",
        metavar="PATH",
        help="start a new run from this checkpoint's weights (its shapes must be the config's)",
    )
    t.add_argument("--resume", action="store_true", help="continue from --out/checkpoints")
    t.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    t.set_defaults(func=cmd_train)


def train_config(args):
    """The TrainConfig the flags ask for."""
    from kimi_linear_jax.train import TrainConfig

    return TrainConfig(
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        learning_rate=args.lr,
        warmup_steps=args.warmup_steps,
        min_lr_ratio=args.min_lr_ratio,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        max_steps=args.max_steps,
        seed=args.seed,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        save_every=args.save_every,
        time_budget=args.time_budget,
        tensor_parallel_size=args.tensor_parallel_size,
    )


def cmd_train(args) -> int:
    import jax.numpy as jnp

    from kimi_linear_jax import load_pretrained
    from kimi_linear_jax.config import KimiLinearConfig
    from kimi_linear_jax.presets import preset
    from kimi_linear_jax.train import train

    def model_at(path):  # a teacher or a starting point, in float32
        return load_pretrained(path, dtype="float32") if path else None

    config = preset(args.preset) if args.preset else KimiLinearConfig.from_json_file(args.config)
    tc = train_config(args)
    record = train(
        config,
        tc,
        args.data,
        args.out,
        vocab_size=args.vocab_size,
        resume=args.resume,
        run_steps=args.run_steps,
        export_dtype=jnp.dtype(args.export_dtype),
        progress=not args.no_progress,
        teacher=model_at(args.distill_from),
        init=model_at(args.init_from),
    )
    sources = {"distill_from": args.distill_from, "init_from": args.init_from}
    print(
        json.dumps({"out": args.out, **record, "train_config": dataclasses.asdict(tc), **sources})
    )
    return 0
