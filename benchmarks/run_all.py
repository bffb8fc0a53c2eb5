"""Run every benchmark with its default settings (``make bench``).

Run from the repo root: ``python benchmarks/run_all.py``. Results land in
``benchmarks/results/*.json``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import async_scheduling  # noqa: E402
import bench_forward  # noqa: E402
import bench_kda  # noqa: E402
import corpus_table  # noqa: E402
import decode_profile  # noqa: E402
import draft_cost  # noqa: E402
import flat_params  # noqa: E402
import mla_decode  # noqa: E402
import mla_split  # noqa: E402
import moe_tiles  # noqa: E402
import ngram_policy  # noqa: E402
import pool_size  # noqa: E402
import prefix_cache  # noqa: E402
import server_robustness  # noqa: E402
import small_m_products  # noqa: E402
import speculative  # noqa: E402
import throughput  # noqa: E402
import verify_commit  # noqa: E402
import verify_window  # noqa: E402
from common import serving_heap  # noqa: E402


def dcp_combine(argv: list[str]) -> None:
    """In its own process: it emulates 8 CPU devices (XLA_FLAGS, read once per process), which
    must not change the devices the other benchmarks run on."""
    script = os.path.join(HERE, "dcp_combine.py")
    subprocess.run([sys.executable, script, "--quick", *argv], check=True)


def parallel(argv: list[str]) -> None:
    """TP x DCP memory, collective bytes and step time: its own process (8 emulated devices)."""
    subprocess.run([sys.executable, os.path.join(HERE, "parallel.py"), *argv], check=True)


BENCHMARKS = {
    "kda": bench_kda.main,
    "forward": bench_forward.main,
    # On a CPU: the XLA reference over its reduced default grid (B 1 16, ctx 4096, T 1 4).
    "mla_decode": mla_decode.main,
    "dcp_combine": dcp_combine,
    # The release's memory per device, collective bytes per layer, step time at tp 1 / 4 / 8.
    "parallel": parallel,
    # Offline generation vs transformers' generate at B 1 8 32, best of 3 interleaved (3-6 min
    # on 2 cores, more under load).
    "throughput": throughput.main,
    # Where a decode step's time goes, per part of the model (built-in default model, B 1 8).
    "decode_profile": decode_profile.main,
    # Oracle / n-gram / draft-model speculation vs plain decode, small preset, B 1 8.
    "speculative": speculative.main,
    # The verify's replay vs gather commit: memory at the release's shapes, time here.
    "verify_commit": verify_commit.main,
    # A verify window's price in plain steps by width, row products vs one product.
    "verify_window": verify_window.main,
    # A draft-model window's price in plain steps: the shipped draft vs other shapes.
    "draft_cost": draft_cost.main,
    # Serving steps taking the parameters as a flat list vs an nnx State (per-call flatten).
    "flat_params": flat_params.main,
    # n-gram policies (latest match vs vote) replayed over the built-in model's continuations.
    "ngram_policy": ngram_policy.main,
    # ms per token with 3 vs 97 state slots, 64 vs 4,096 latent pages (a pool must not cost
    # per step).
    "pool_size": pool_size.main,
    # The decode step with W_UK / W_UV sliced from kv_b_proj in the step vs split once.
    "mla_split": mla_split.main,
    # The CPU routed-expert loop: one-pair tiles, in-place expert reads vs before.
    "moe_tiles": moe_tiles.main,
    # Weight GB/s of 1 to 32-row products, XLA vs torch: the CPU limit at B >= 2.
    "small_m_products": small_m_products.main,
    # TTFT and prefill tokens saved, 2k-token shared prefix, cache on vs off.
    "prefix_cache": prefix_cache.main,
    # Async vs sync scheduling: ms per token, host time on the critical path, device idle.
    "async_scheduling": async_scheduling.main,
    # The corpus n-gram table built at an engine start vs loaded from the user's cache.
    "corpus_table": corpus_table.main,
    # What hostile client input costs the server: /health under a big body, refusal times,
    # idle connections closed, a logit_bias step.
    "server_robustness": server_robustness.main,
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--only", choices=sorted(BENCHMARKS), nargs="+", help="run only these benchmarks"
    )
    a = p.parse_args(argv)
    serving_heap()  # before any benchmark computes: the serving ones measure the CLI's heap
    for name in a.only or list(BENCHMARKS):
        print(f"==== {name} ====", flush=True)
        t0 = time.perf_counter()
        BENCHMARKS[name]([])
        print(f"({name}: {time.perf_counter() - t0:.0f} s)\n", flush=True)


if __name__ == "__main__":
    main()
