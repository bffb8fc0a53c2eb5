"""`kimi-linear-jax plan`: the memory planner (`kimi_linear_jax/parallel/plan.py`) on a
preset or a checkpoint's config.json and a hypothetical device set. Abstract shapes only:
nothing is allocated and no device is needed. Prints a table, or one JSON object with
--json; exits with status 1 when the plan does not fit (the reason says why).
"""

from __future__ import annotations

import json
import os


def add_plan_parser(sub) -> None:
    pl = sub.add_parser(
        "plan",
        help="pages, state slots and sequences per device for a preset or config.json on a "
        "hypothetical device set (abstract: nothing allocated, no device needed)",
    )
    src = pl.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None, help="default: kimi-linear-48b-a3b")
    src.add_argument("--config", default=None, help="a checkpoint's config.json or directory")
    pl.add_argument(
        "--device-memory",
        default=None,
        help="per device: 80GiB, 141GB, bytes (default: --target's)",
    )
    pl.add_argument(
        "--target",
        default=None,
        help="a GPU target (h200): the largest steps compiled deviceless for it give the "
        "activation, where the planner otherwise estimates it (needs the gpu-compile extra)",
    )
    pl.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    pl.add_argument("--tensor-parallel-size", "-tp", type=int, default=None)
    pl.add_argument("--dcp-size", type=int, default=None)
    pl.add_argument("--replicate-q-proj", action="store_true")
    pl.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    pl.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float32"],
        default="auto",
        help="auto: --config's torch_dtype; bfloat16 for presets (the release's)",
    )
    pl.add_argument("--page-size", type=int, default=16)
    pl.add_argument("--max-num-seqs", type=int, default=None, help="cap (default 256)")
    pl.add_argument("--max-num-batched-tokens", type=int, default=256)
    pl.add_argument("--num-checkpoint-slots", type=int, default=None)
    pl.add_argument("--no-prefix-caching", action="store_true")
    pl.add_argument("--num-draft-tokens", type=int, default=0, help="speculating: k")
    draft = pl.add_mutually_exclusive_group()
    draft.add_argument("--draft-preset", default=None, help="a draft model's preset")
    draft.add_argument("--draft-config", default=None, help="a draft model's config.json")
    pl.add_argument(
        "--state-memory-ratio",
        type=float,
        default=0.9,
        help="state : pages split r (state gets r / (1 + r); sglang's mamba_full_memory_ratio)",
    )
    pl.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    pl.set_defaults(func=cmd_plan)


def _plan_config(preset_name, config_path):
    """(config, the dtype "auto" means for it) of a preset or a config.json."""
    from kimi_linear_jax.checkpoint import auto_dtype
    from kimi_linear_jax.config import KimiLinearConfig
    from kimi_linear_jax.presets import preset

    if config_path is None:
        return preset(preset_name or "kimi-linear-48b-a3b"), "bfloat16"
    path = os.path.join(config_path, "config.json") if os.path.isdir(config_path) else config_path
    return KimiLinearConfig.from_json_file(path), auto_dtype(path)


def cmd_plan(args) -> int:
    """Print the plan (a table, or JSON with --json); status 1 when it does not fit."""
    from kimi_linear_jax.parallel.mesh import resolve_sizes
    from kimi_linear_jax.parallel.plan import plan_memory

    memory = args.device_memory
    if args.target is not None:
        from kernels.gpu_target import Target

        memory = memory or Target.load(args.target).device_memory  # unknown: ValueError
    if memory is None:
        raise ValueError("--device-memory is needed without --target")
    config, auto = _plan_config(args.preset, args.config)
    draft = None
    if args.draft_preset or args.draft_config:
        draft, _ = _plan_config(args.draft_preset, args.draft_config)
    tp, dcp = resolve_sizes(args.tensor_parallel_size, args.dcp_size)
    kw = dict(
        device_memory=memory,
        tensor_parallel_size=tp,
        dcp_size=dcp,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        dtype=auto if args.dtype == "auto" else args.dtype,
        page_size=args.page_size,
        max_num_seqs=args.max_num_seqs,
        num_checkpoint_slots=args.num_checkpoint_slots,
        enable_prefix_caching=not args.no_prefix_caching,
        num_draft_tokens=args.num_draft_tokens,
        draft_config=draft,
        state_memory_ratio=args.state_memory_ratio,
        max_num_batched_tokens=args.max_num_batched_tokens,
        replicate_q_proj=args.replicate_q_proj,
    )
    if args.target is None:
        plan = plan_memory(config, **kw)
    else:
        from kimi_linear_jax.parallel.target_plan import target_plan

        plan = target_plan(config, kw, target=args.target)
    print(json.dumps(plan.to_dict()) if args.json else plan.table())
    return 0 if plan.fits else 1
