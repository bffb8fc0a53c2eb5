"""The GPU build proven without a GPU: every MLA kernel launch the engine can make and every
jitted engine step, compiled deviceless for an H200 (`kernels/gpu_target.py`).

Part 1, kernels: the launches of `kernels/mla_decode.py` for the release's MLA dims and the
built-in models', bf16 and f32 caches (and the bf16 model's f32 queries over a bf16 cache),
pages of 16 and 64, decode (T = 1) and verify windows up to k + 1 = 17, the heads a device
holds under TP (and DCP's gathered heads). Launches that compile to the same kernel (same
dtypes, dims and tiles) are compiled once. Per kernel: registers, spills, shared memory,
blocks per SM, the matrix instructions, and a bandwidth model from those resources.

Part 2, engine steps: an engine serves greedy, sampled, prompt-logprob and prefix-hit requests
on the CPU while each distinct call of its jitted steps is compiled for the target
(`serving/step_compile.py`): plain with fused decode, n-gram and draft-model speculation, on
one device and on a TP 4 x DCP 2 mesh of eight (topology 1x2x4). Per step: memory_analysis().

Exits 1 on any failed compile or any spill in the project's kernel (XLA's own kernels' spills
are reported beside it). Run by `make gpu-compile` (which installs the
CUDA plugin in its own venv); `--quick` compiles a few kernels and the one-device steps only.

    python benchmarks/gpu_compile.py [--quick] [--out DIR]
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin registers; no driver needed
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse  # noqa: E402
import functools  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from benchmarks.harness import print_table, write_json  # noqa: E402
from kernels.gpu_target import Target, compile_deviceless, topology  # noqa: E402
from kernels.mla_decode import launch_tiles, mla_paged_attention  # noqa: E402

TARGET = "h200"
# The bandwidth model's shape: a decode batch of 32 sequences of 4,096 tokens each.
MODEL_B, MODEL_CTX = 32, 4096
# Loaded DRAM latency the in-flight bound assumes (Hopper: ~0.5 us idle, more under load).
DRAM_LATENCY_S = 1e-6


def kernel_launches(quick: bool):
    """(label, q dtype, cache dtype, L, R, H, T, page_size) of every launch to cover."""
    from kimi_linear_jax.presets import preset

    dims = [("release", 512, 64, (32, 16, 8, 4))]
    for name in ("pycode", "pycode-draft"):
        c = preset(name)
        h = c.num_attention_heads
        dims.append((name, c.kv_lora_rank, c.qk_rope_head_dim, (h, max(1, h // 2))))
    dtypes = [("bf16", jnp.bfloat16, jnp.bfloat16), ("f32", jnp.float32, jnp.float32)]
    dtypes.append(("f32q-bf16", jnp.float32, jnp.bfloat16))  # the bf16 model's launch
    windows = (1, 2, 4, 9, 17)
    if quick:
        dims, windows = dims[:1], (1, 4)
    for label, L, R, heads in dims:
        for dname, qdt, cdt in dtypes:
            for page in (16, 64):
                for H in heads:
                    for T in windows:
                        yield (f"{label}-{dname}", qdt, cdt, L, R, H, T, page)


def _signature(qdt, cdt, L, R, H, T, page):
    dtype = jnp.promote_types(qdt, cdt)
    tiles, warps = launch_tiles(4, T, H, L, page, 4096 // page, dtype, cdt)
    key = (jnp.dtype(qdt).name, jnp.dtype(cdt).name, L, R, page, tiles.block_h, tiles.block_n)
    return key + (tiles.block_l, tiles.block_k, warps), tiles, warps


def _abstract(shape, dtype, sharding):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def compile_kernel(qdt, cdt, L, R, H, T, page):
    """The kernel at B = 4, a 4,096-token table: its CompileReport's MLA kernels."""
    sh = NamedSharding(Mesh(topology(TARGET).devices, ("x",)), PartitionSpec())
    B, P = 4, 4096 // page
    args = (
        _abstract((B, T, H, L), qdt, sh),
        _abstract((B, T, H, R), qdt, sh),
        _abstract((B * P, page, L + R), cdt, sh),
        _abstract((B, P), jnp.int32, sh),
        _abstract((B, T), jnp.int32, sh),
    )
    step = jax.jit(functools.partial(mla_paged_attention, sm_scale=(L + R) ** -0.5))
    return compile_deviceless(step, *args).kernel("mla_paged_attention")


def bandwidth_model(k, knobs: dict, L: int, R: int, cdt, target: Target) -> dict:
    """Decode of MODEL_B x MODEL_CTX tokens as the compiled resources allow: each page read
    from HBM once (the other row blocks' and latent tiles' reads hit L2), the programs in
    waves of the resident slots, and the loads in flight bounded by the pipeline stages."""
    tiles, _ = launch_tiles(MODEL_B, 1, 32, L, 64, MODEL_CTX // 64, jnp.float32, cdt, **knobs)
    cache_bytes = jnp.dtype(cdt).itemsize
    hbm = MODEL_B * MODEL_CTX * (L + R) * cache_bytes
    lt = L // tiles.block_l
    programs = lt * tiles.row_blocks * tiles.num_splits * MODEL_B
    slots = target.sms * max(1, k.blocks_per_sm(target))
    waves = math.ceil(programs / slots)
    tile = tiles.block_n * (L + R + (0 if lt == 1 else tiles.block_l)) * cache_bytes
    in_flight = min(programs, slots) * 2 * tile / DRAM_LATENCY_S  # num_stages = 2
    bw = min(target.bandwidth, in_flight) * programs / (waves * slots)
    return {"model_GBps": bw / 1e9, "model_us": hbm / bw * 1e6, "l2_reads": tiles.row_blocks * lt}


def run_kernels(quick: bool, target: Target):
    groups: dict = {}
    for label, qdt, cdt, L, R, H, T, page in kernel_launches(quick):
        key, _, _ = _signature(qdt, cdt, L, R, H, T, page)
        groups.setdefault(key, []).append((label, qdt, cdt, L, R, H, T, page))
    rows, failed = [], []
    for launches in groups.values():
        label, qdt, cdt, L, R, H, T, page = launches[0]
        _, tiles, warps = _signature(qdt, cdt, L, R, H, T, page)
        row = {
            "kernel": f"{label} p{page} h{tiles.block_h} n{tiles.block_n} l{tiles.block_l}",
            "block_k": tiles.block_k,
            "warps": warps,
            "launches": len(launches),
            "covers": sorted({f"H{x[5]}xT{x[6]}" for x in launches}),
        }
        try:
            (k,) = compile_kernel(qdt, cdt, L, R, H, T, page)
        except Exception as e:  # noqa: BLE001 - reported, and the run fails
            failed.append(row["kernel"])
            rows.append({**row, "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        model_tiles = {"block_h": tiles.block_h, "block_n": tiles.block_n}
        model_tiles.update(block_l=tiles.block_l, block_k=tiles.block_k)
        row.update(
            regs=k.registers,
            spills=k.spills,
            smem_KiB=k.smem / 1024,
            blocks_per_sm=k.blocks_per_sm(target),
            occupancy=k.occupancy(target),
            mma=k.mma,
            tma=k.tma,
            **bandwidth_model(k, model_tiles, L, R, cdt, target),
        )
        if k.spills:
            failed.append(row["kernel"])
        rows.append(row)
    return rows, failed


NGRAM = {"method": "ngram", "num_draft_tokens": 3}
SCENARIOS = [
    # (name, topology, engine options)
    ("plain-fused-decode", "1x1x1", dict(num_scheduler_steps=4)),
    ("ngram", "1x1x1", dict(speculative=NGRAM)),
    ("draft-bf16", "1x1x1", dict(dtype="bfloat16", speculative={**NGRAM, "method": "draft_model"})),
    ("ngram-tp4-dcp2", "1x2x4", dict(speculative=NGRAM, tensor_parallel_size=4, dcp_size=2)),
    ("draft-tree", "1x1x1", dict(speculative={**NGRAM, "method": "draft_model", "topk": 2})),
]


def run_engine(name: str, shape: str, options: dict):
    from serving.engine import LLM
    from serving.step_compile import StepCapture, exercise

    with StepCapture(devices=topology(TARGET, shape).devices) as capture:
        exercise(LLM(max_num_seqs=2, batch_buckets=(2,), **options), prompt_logprobs=2)
    rows, failed = [], []
    for call in capture.calls:
        row = {"scenario": name, "step": call.name}
        if call.error:
            failed.append(f"{name}/{call.name}")
            rows.append({**row, "error": call.error[:300]})
            continue
        mla = call.report.kernel("mla_paged_attention")
        if any(k.spills for k in mla):
            failed.append(f"{name}/{call.name}: the MLA kernel spills")
        # XLA's own kernels are reported, not failed: their code is XLA's (its sort emitter
        # spills 16 B at 1,024 threads for a 32k vocabulary, none at the release's 164k).
        xla_spills = {k.name: k.spills for k in call.report.kernels if k.spills and k not in mla}
        m = call.report.memory
        rows.append(
            {
                **row,
                "temp_MiB": m["temp"] / 2**20,
                "args_MiB": m["argument"] / 2**20,
                "out_MiB": m["output"] / 2**20,
                "kernels": len(call.report.kernels),
                "mla": ",".join(sorted({f"{k.registers}r/{k.spills}s" for k in mla})) or "-",
                "max_regs": max((k.registers for k in call.report.kernels), default=0),
                "xla_spills": ",".join(f"{n}:{b}B" for n, b in xla_spills.items()) or "-",
            }
        )
    return rows, failed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few kernels, one-device steps")
    ap.add_argument("--out", default=None, help="directory of the JSON report")
    args = ap.parse_args(argv)
    target = Target.load(TARGET)
    t0 = time.perf_counter()
    kernel_rows, failed = run_kernels(args.quick, target)
    columns = ["kernel", "block_k", "warps", "launches", "regs", "spills", "smem_KiB"]
    columns += ["blocks_per_sm", "mma", "model_GBps", "error"]
    print_table(kernel_rows, columns)
    step_rows = []
    for name, shape, options in SCENARIOS[:2] if args.quick else SCENARIOS:
        rows, bad = run_engine(name, shape, options)
        step_rows += rows
        failed += bad
    print()
    columns = ["scenario", "step", "temp_MiB", "args_MiB", "out_MiB", "kernels", "mla"]
    print_table(step_rows, columns + ["xla_spills", "error"])
    meta = {"target": TARGET, "jax": jax.__version__, "failed": failed}
    meta["seconds"] = time.perf_counter() - t0
    path = write_json("gpu_compile", kernel_rows + step_rows, meta, out_dir=args.out)
    print(f"\n{len(kernel_rows)} kernels, {len(step_rows)} steps compiled for {TARGET} -> {path}")
    if failed:
        print("FAILED:", *failed, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
