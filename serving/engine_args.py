"""The engine's command-line flags, shared by `generate` and `serve`, and the `LLM` they build
(`llm_from_args`): model, pools, devices, speculative decoding, several processes, prefix
caching. Also whether this process writes results (`_leader`)."""

from __future__ import annotations

import argparse
import logging
import sys

from kimi_linear_jax.parallel.mesh import COMBINES

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
    spec.add_argument("--prompt-lookup-min", type=int, default=2)
    spec.add_argument(
        "--prompt-lookup-num-tokens",
        type=int,
        default=0,
        help="draft_model: draft up to N tokens by prompt lookup where the context recurs",
    )
    spec.add_argument(
        "--speculative-corpus",
        default=None,
        help="ngram: a corpus (stdlib, a file or a directory) whose n-grams draft where the "
        "request's own tokens do not recur",
    )
    spec.add_argument("--corpus-num-tokens", type=int, default=2, help="ngram: corpus drafts")
    spec.add_argument(
        "--speculative-width-policy",
        choices=["fixed", "cost"],
        default="fixed",
        help="cost: each step's window as wide as pays on a measured cost curve (0: plain)",
    )
    spec.add_argument(
        "--speculative-topk",
        type=int,
        default=1,
        help="> 1: draft trees of --num-draft-tokens nodes, up to K children a node",
    )
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
            "prompt_lookup_num_tokens": args.prompt_lookup_num_tokens,
            "corpus": args.speculative_corpus,
            "corpus_num_tokens": args.corpus_num_tokens,
            "width_policy": args.speculative_width_policy,
            "topk": args.speculative_topk,
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
