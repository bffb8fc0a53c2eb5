"""Serving the release on several devices: memory per device, collective bytes, step time.

Three sections (``--only`` picks some):

- ``memory``: the memory planner (``kimi_linear_jax.parallel.plan``, as ``kimi-linear-jax
  plan``) on the release's shapes (``kimi-linear-48b-a3b``, bf16, fp32 KDA state), abstract
  (nothing is allocated): weights, activation estimate, latent per token and state per slot
  per device, and the pages, tokens and sequences that fit on 80 GB and 141 GB devices.
- ``collectives``: bytes each device sends per decode step for one MLA layer (query all-gather,
  DCP combine, o_proj all-reduce) and one MoE layer (one all-reduce), for both combines, at
  tp 8 / dcp 8 on the release's shapes, from ring-algorithm formulas. The same formulas are
  checked against the collectives XLA compiles into a whole decode step on 8 emulated devices
  (a small config): the table shows both totals.
- ``step``: decode step time on emulated CPU devices (tp 1 vs 4, both combines at tp 4 / dcp 4
  and tp 8 / dcp 8), interleaved, as ratios to tp 1. Eight emulated devices share 2 cores
  here: this is a record of overheads, not of GPU speed.

Run: ``python benchmarks/parallel.py`` (prints tables, writes ``results/parallel.json``).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import RESULTS_DIR, print_table, timeit_interleaved, write_json  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kimi_linear_jax.cache import contiguous_batch  # noqa: E402
from kimi_linear_jax.model import decode_step  # noqa: E402
from kimi_linear_jax.parallel.mesh import make_parallel  # noqa: E402
from kimi_linear_jax.parallel.plan import plan_memory  # noqa: E402
from kimi_linear_jax.parallel.rules import init_cache, shard_model  # noqa: E402
from kimi_linear_jax.presets import preset  # noqa: E402
from kimi_linear_jax.testing import random_model  # noqa: E402

GB, GiB, MiB = 1e9, 2**30, 2**20
RELEASE = "kimi-linear-48b-a3b"
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


# ---- memory ------------------------------------------------------------------------------------


def memory_rows() -> list[dict]:
    """The library's planner (`kimi_linear_jax.parallel.plan`) on each setup."""
    cfg = preset(RELEASE)
    rows = []
    for name, gb, tp, dcp, k in SETUPS:
        p = plan_memory(
            cfg,
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
    return rows


# ---- collectives -------------------------------------------------------------------------------


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


SMALL = preset("tiny-tp8")


def _decode_setup(config, tp, dcp, combine, B, page=16, ctx=256):
    par = make_parallel(config, tp, dcp, combine=combine)
    model = shard_model(random_model(config, seed=0), par)
    tokens = page * dcp
    n = -(-ctx // tokens) + 1
    cache = init_cache(
        config, par, num_slots=B + 1, num_pages=B * n, page_size=tokens, dtype=jnp.float32
    )
    lengths = np.ones(B, np.int32)
    batch = contiguous_batch(B, ctx, tokens, start=np.full(B, ctx - 8), lengths=lengths)
    graphdef, params = nnx.split(model)
    ids = jnp.ones((B, 1), jnp.int32)
    return graphdef, params, ids, cache, batch


def collective_rows(B: int = 8) -> list[dict]:
    cfg = preset(RELEASE)
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
    rows.append(
        dict(
            what=f"release MoE layer, B={B}, tp 8",
            all_reduce_KiB=moe_layer_collectives(cfg, 8, B) / 1024,
            total_KiB=moe_layer_collectives(cfg, 8, B) / 1024,
        )
    )
    # The formulas against what XLA compiles (f32 small model: activations are 4 bytes).
    for tp, dcp, combine in ((8, 8, "ag_rs"), (8, 8, "a2a"), (4, 2, "ag_rs")):
        args = _decode_setup(SMALL, tp, dcp, combine, B)
        text = decode_step.lower(*args).compile().as_text()
        hlo, counts = hlo_collective_bytes(text)
        formula = step_collectives(SMALL, tp, dcp, combine, B, act=4)
        rows.append(
            dict(
                what=f"small model step, tp {tp} dcp {dcp}, {combine}: formula vs HLO",
                total_KiB=formula / 1024,
                hlo_KiB=hlo / 1024,
                hlo_ops=" ".join(f"{k}:{v}" for k, v in sorted(counts.items())),
            )
        )
    return rows


# ---- step time ---------------------------------------------------------------------------------


def step_rows(B: int, repeats: int) -> list[dict]:
    plans = [
        (1, 1, "ag_rs"),
        (4, 1, "ag_rs"),
        (4, 4, "ag_rs"),
        (4, 4, "a2a"),
        (8, 8, "ag_rs"),
        (8, 8, "a2a"),
    ]
    fns, donated = {}, {}
    for tp, dcp, combine in plans:
        name = f"tp{tp}-dcp{dcp}-{combine}"
        graphdef, params, ids, cache, batch = _decode_setup(SMALL, tp, dcp, combine, B)
        donated[name] = cache

        def run(name=name, graphdef=graphdef, params=params, ids=ids, batch=batch):
            # The step donates its cache: keep the returned one for the next call.
            logits, donated[name] = decode_step(graphdef, params, ids, donated[name], batch)
            return logits

        fns[name] = run
    times = timeit_interleaved(fns, warmup=2, repeats=repeats)
    base = times["tp1-dcp1-ag_rs"]["median_s"]
    return [
        dict(plan=k, B=B, step_ms=v["median_s"] * 1e3, vs_tp1=v["median_s"] / base)
        for k, v in times.items()
    ]


def _kept_rows(rerun: set[str]) -> list[dict]:
    path = os.path.join(RESULTS_DIR, "parallel.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [r for r in json.load(f)["rows"] if r.get("section") not in rerun]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=["memory", "collectives", "step"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args(argv)
    sections = a.only or ["memory", "collectives", "step"]
    out = {}
    if "memory" in sections:
        out["memory"] = memory_rows()
        print(
            f"Release shapes, bf16 (KDA state fp32), the planner's pools: budget = "
            f"{UTILIZATION} x memory; max_model_len {CONTEXT}"
        )
        print_table(out["memory"], list(out["memory"][0]))
        print()
    if "collectives" in sections:
        out["collectives"] = collective_rows(a.batch)
        cols = [
            "what",
            "q_gather_KiB",
            "combine_KiB",
            "all_reduce_KiB",
            "total_KiB",
            "hlo_KiB",
            "hlo_ops",
        ]
        print_table(out["collectives"], cols)
        print()
    if "step" in sections:
        out["step"] = step_rows(a.batch, a.repeats)
        print_table(out["step"], list(out["step"][0]))
    rows = [dict(section=k, **r) for k, v in out.items() for r in v]
    rows += _kept_rows(set(sections))  # --only keeps the other sections' last results
    path = write_json("parallel", rows, {"batch": a.batch, "repeats": a.repeats})
    print(f"\nwrote {path}")
    return out


if __name__ == "__main__":
    main()
