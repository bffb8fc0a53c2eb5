"""Serving the release on several devices: memory per device (the planner), collective bytes
per decode step, and decode step time on emulated devices, TP x DCP.

    python -m benchmarks parallel [--only memory collectives step] [--quick]

The collectives and step measures run in a process with 8 emulated CPU devices (the harness
starts one).
"""

from __future__ import annotations

import math
import re

import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.harness import Suite, Table, add_ratio, interleaved, repeats
from kimi_linear_jax.cache import contiguous_batch
from kimi_linear_jax.model import decode_step
from kimi_linear_jax.parallel.mesh import make_parallel
from kimi_linear_jax.parallel.plan import plan_memory
from kimi_linear_jax.parallel.rules import init_cache, shard_model
from kimi_linear_jax.presets import preset
from kimi_linear_jax.testing import random_model

SUITE = Suite("parallel", __doc__)
SUITE.option("--batch", type=int, default=8, help="collectives, step: decode rows")

GB, MiB = 1e9, 2**20
RELEASE = "kimi-linear-48b-a3b"
SMALL = preset("tiny-tp8")  # the emulated devices' model: every TP degree up to 8 shards it
# (name, GB per device, tp, dcp, draft tokens)
SETUPS = [
    ("1 x 80 GB", 80, 1, 1, 0),
    ("1 x 141 GB", 141, 1, 1, 0),
    ("4 x 80 GB", 80, 4, 4, 0),
    ("8 x 80 GB", 80, 8, 1, 0),
    ("8 x 80 GB", 80, 8, 8, 0),
    ("8 x 80 GB", 80, 8, 8, 4),
    ("8 x 141 GB", 141, 8, 1, 0),
    ("8 x 141 GB", 141, 8, 8, 0),
]
UTILIZATION = 0.9  # vLLM's gpu_memory_utilization default
CONTEXT = 131072


@SUITE.measure("memory")
def memory(args) -> Table:
    """The memory planner (``kimi_linear_jax.parallel.plan``, as ``kimi-linear-jax plan``) on the
    release's shapes (bf16, fp32 KDA state), abstract: weights, activation estimate, latent per
    token and state per slot per device, and the pages, tokens and sequences that fit on 80 GB
    and 141 GB devices at 0.9 of their memory and max_model_len 131,072.
    """
    rows = []
    for name, gb, tp, dcp, k in SETUPS:
        p = plan_memory(
            preset(RELEASE),
            device_memory=int(gb * GB),
            tensor_parallel_size=tp,
            dcp_size=dcp,
            gpu_memory_utilization=UTILIZATION,
            max_model_len=CONTEXT,
            num_draft_tokens=k,
        )
        rows.append(
            dict(
                setup=name,
                tp=tp,
                dcp=dcp,
                draft_tokens=k,
                weights_GB=p.weights_bytes_per_device / GB,
                activation_GB=p.activation_bytes / GB,
                latent_B_per_token=p.kv_bytes_per_token_per_device,
                state_MiB_per_slot=p.state_bytes_per_slot_per_device / MiB,
                pages=p.num_pages,
                tokens_M=p.max_tokens_in_cache / 1e6,
                seqs_at_128k=p.max_tokens_in_cache // CONTEXT,
                max_num_seqs=p.max_num_seqs,
                state_slots=p.num_state_slots,
                fits=p.fits,
                reason=p.reason or "",
            )
        )
    base = next(r for r in rows if r["setup"] == "8 x 80 GB" and r["dcp"] == 1)
    add_ratio(rows, "tokens_M", base, "tokens_vs_tp8")
    title = f"release shapes, budget {UTILIZATION} of memory, max_model_len {CONTEXT:,}"
    columns = [c for c in rows[0] if c != "reason"] + ["tokens_vs_tp8"]
    return Table(title, rows, columns)


# ---- collectives ------------------------------------------------------------------------------
def _ring(kind: str, nbytes: float, g: int) -> float:
    """Bytes one device sends for a collective over g devices (ring algorithms); nbytes is the
    per-device input for all-gather / all-to-all, the full array for the reductions."""
    if g == 1:
        return 0.0
    return {
        "all-gather": (g - 1) * nbytes,
        "all-to-all": (g - 1) / g * nbytes,
        "reduce-scatter": (g - 1) / g * nbytes,
        "all-reduce": 2 * (g - 1) / g * nbytes,
    }[kind]


def mla_layer_collectives(config, tp, dcp, combine, B, T=1, act=2, acc=4) -> dict[str, float]:
    """Bytes sent per device for one MLA layer's decode step (absorbed path, q not replicated).
    act: activation bytes (bf16); acc: the f32 latent-space math."""
    H, L, R = config.num_attention_heads, config.kv_lora_rank, config.qk_rope_head_dim
    D = config.hidden_size
    h = H // tp  # own heads
    hg = h * dcp  # the DCP group's heads
    out = {"q_gather": _ring("all-gather", B * T * h * (L + R) * acc, dcp)}
    if combine == "ag_rs":
        out["combine"] = _ring("all-gather", B * T * hg * acc, dcp) + _ring(
            "reduce-scatter", B * T * hg * L * acc, dcp
        )
    else:
        out["combine"] = _ring("all-to-all", B * T * hg * (L + 1) * acc, dcp)
    out["o_proj_all_reduce"] = _ring("all-reduce", B * T * D * act, tp)
    out["total"] = sum(out.values())
    return out


def moe_layer_collectives(config, tp, B, T=1, act=2) -> float:
    """One all-reduce of the layer output (routed partials + shared expert partial)."""
    return _ring("all-reduce", B * T * config.hidden_size * act, tp)


def step_collectives(config, tp, dcp, combine, B, act) -> float:
    """The formula's bytes for a whole decode step: embedding, every mixer, every FFN."""
    kda = _ring("all-reduce", B * config.hidden_size * act, tp)
    mla = mla_layer_collectives(config, tp, dcp, combine, B, act=act)["total"]
    ffn = moe_layer_collectives(config, tp, B, act=act)
    return (
        _ring("all-reduce", B * config.hidden_size * act, tp)  # embedding
        + len(config.kda_layer_ids) * kda
        + len(config.mla_layer_ids) * mla
        + config.num_hidden_layers * ffn
    )


_COLLECTIVE = re.compile(
    r"=\s*(\(?[a-z0-9\[\]{}, ]+\)?)\s+(all-gather|all-reduce|reduce-scatter|all-to-all)"
    r"(?:-start)?\(.*?replica_groups=(\S+)"
)
_SHAPE = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")
_BYTES = {"f32": 4, "bf16": 2, "s32": 4, "f64": 8, "pred": 1, "u32": 4}


def hlo_collective_bytes(text: str) -> tuple[float, dict[str, int]]:
    """Bytes one device sends, summed over the collectives of a compiled HLO module."""
    total, counts = 0.0, {}
    text = re.sub(r"/\*.*?\*/", "", text)  # tuple index comments
    for types, kind, groups in _COLLECTIVE.findall(text):
        out = sum(
            _BYTES[t] * math.prod(int(x) for x in dims.split(",") if x)
            for t, dims in _SHAPE.findall(types)
        )
        g = _group_size(groups)
        # The result shape: all-gather's is the gathered array, reduce-scatter's the shard.
        nbytes = {"all-gather": out / g, "reduce-scatter": out * g}.get(kind, out)
        total += _ring(kind, nbytes, g)
        counts[kind] = counts.get(kind, 0) + 1
    return total, counts


def _group_size(groups: str) -> int:
    iota = re.match(r"\[(\d+),(\d+)\]<=", groups)  # iota form: [num_groups, size]<=[...]
    if iota:
        return int(iota.group(2))
    first = re.match(r"\{\{([\d,]+)\}", groups)
    return len(first.group(1).split(",")) if first else 1


def _decode_setup(tp, dcp, combine, B, page=16, ctx=256):
    par = make_parallel(SMALL, tp, dcp, combine=combine)
    model = shard_model(random_model(SMALL, seed=0), par)
    tokens = page * dcp
    n = -(-ctx // tokens) + 1
    cache = init_cache(
        SMALL, par, num_slots=B + 1, num_pages=B * n, page_size=tokens, dtype=jnp.float32
    )
    lengths = np.ones(B, np.int32)
    batch = contiguous_batch(B, ctx, tokens, start=np.full(B, ctx - 8), lengths=lengths)
    graphdef, params = nnx.split(model)
    return graphdef, params, jnp.ones((B, 1), jnp.int32), cache, batch


@SUITE.measure("collectives", devices=8)
def collectives(args) -> Table:
    """Bytes each device sends per decode step: one MLA layer (query all-gather, DCP combine,
    o_proj all-reduce) and one MoE layer at tp 8 / dcp 8 on the release's shapes, both
    combines, from ring formulas; and the same formulas against the collectives XLA compiles
    into a whole decode step of a small model on 8 emulated devices (hlo / formula).
    """
    B, cfg = args.batch, preset(RELEASE)
    rows = []
    for combine in ("ag_rs", "a2a"):
        mla = mla_layer_collectives(cfg, 8, 8, combine, B)
        rows.append(
            dict(
                what=f"release MLA layer, B={B}, tp 8 dcp 8, {combine}",
                q_gather_KiB=mla["q_gather"] / 1024,
                combine_KiB=mla["combine"] / 1024,
                all_reduce_KiB=mla["o_proj_all_reduce"] / 1024,
                total_KiB=mla["total"] / 1024,
            )
        )
    moe = moe_layer_collectives(cfg, 8, B) / 1024
    rows.append(dict(what=f"release MoE layer, B={B}, tp 8", all_reduce_KiB=moe, total_KiB=moe))
    plans = ((8, 8, "ag_rs"),) if args.quick else ((8, 8, "ag_rs"), (8, 8, "a2a"), (4, 2, "ag_rs"))
    for tp, dcp, combine in plans:
        text = decode_step.lower(*_decode_setup(tp, dcp, combine, B)).compile().as_text()
        hlo, counts = hlo_collective_bytes(text)
        formula = step_collectives(SMALL, tp, dcp, combine, B, act=4)
        rows.append(
            dict(
                what=f"tiny-tp8 step, tp {tp} dcp {dcp}, {combine}",
                total_KiB=formula / 1024,
                hlo_KiB=hlo / 1024,
                hlo_vs_formula=hlo / formula,
                hlo_ops=" ".join(f"{k}:{v}" for k, v in sorted(counts.items())),
            )
        )
    columns = ["what", "q_gather_KiB", "combine_KiB", "all_reduce_KiB", "total_KiB", "hlo_KiB"]
    return Table(
        "bytes one device sends per decode step", rows, columns + ["hlo_vs_formula", "hlo_ops"]
    )


# ---- step time --------------------------------------------------------------------------------
@SUITE.measure("step", devices=8)
def step(args) -> Table:
    """Decode step time on emulated CPU devices (tiny-tp8, B = 8, context 256): tp 1 against
    tp 4 and both combines at tp 4 / dcp 4 and tp 8 / dcp 8, interleaved. Eight emulated
    devices share the cores: a record of overheads, not of GPU speed.
    """
    plans = [(1, 1, "ag_rs"), (4, 1, "ag_rs"), (4, 4, "ag_rs"), (4, 4, "a2a")]
    plans += [(8, 8, "ag_rs"), (8, 8, "a2a")]
    fns, caches = {}, {}
    for tp, dcp, combine in plans:
        name = f"tp {tp}, dcp {dcp}, {combine}"
        graphdef, params, ids, caches[name], batch = _decode_setup(tp, dcp, combine, args.batch)

        def run(name=name, graphdef=graphdef, params=params, ids=ids, batch=batch):
            logits, caches[name] = decode_step(graphdef, params, ids, caches[name], batch)
            return logits  # the step donates its cache: the next call takes the new one

        fns[name] = run
    runs = interleaved(fns, warmup=2, repeats=repeats(args, 20, 3), keep=False)
    rows = [dict(plan=k, B=args.batch, step_ms=r.median * 1e3) for k, r in runs.items()]
    add_ratio(rows, "step_ms", rows[0], "vs_tp1")
    return Table("decode step, median ms", rows, ["plan", "B", "step_ms", "vs_tp1"])
