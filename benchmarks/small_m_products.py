"""How fast this CPU multiplies a few rows by a stored weight, in XLA and in torch (issue 13):
the rate that bounds a decode step at batch 2 to 32, where every projection has B rows.

A chain of 24 projections 768 -> 2048 -> 768 (float32, 151 MB of distinct weights, more than
the cache holds) over M rows, timed as one call: in JAX as `Linear` computes it (one einsum
per projection, jitted), and in torch with `F.linear` (what transformers runs) on 1 and 2
threads. The figure is the weight bytes read per second: at M = 1 it is close to the memory
bandwidth, and above it the products fall below it (both libraries). The sides take turns call
by call; best and median of `--repeats`. Both sides' outputs are compared.

Run: ``python benchmarks/small_m_products.py [--rows 1,2,5,8,16,32] [--repeats 15]`` (prints
a table, writes ``results/small_m_products.json``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import print_table, serving_heap, write_json  # noqa: E402

serving_heap()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from throughput import memory_bandwidth  # noqa: E402

LAYERS, D, F = 12, 768, 2048


def weights(seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Stored [out, in], as checkpoints and `Linear` keep them."""
    rng = np.random.default_rng(seed)
    up = [(0.03 * rng.standard_normal((F, D))).astype(np.float32) for _ in range(LAYERS)]
    down = [(0.03 * rng.standard_normal((D, F))).astype(np.float32) for _ in range(LAYERS)]
    return up, down


def jax_chain(up, down):
    up, down = [jnp.asarray(w) for w in up], [jnp.asarray(w) for w in down]

    @jax.jit
    def chain(x, up, down):
        for a, b in zip(up, down, strict=True):
            h = jnp.tanh(jnp.einsum("mi,oi->mo", x, a))
            x = x + jnp.einsum("mi,oi->mo", h, b)
        return x

    return lambda x: jax.block_until_ready(chain(jnp.asarray(x), up, down))


def torch_chain(up, down, threads: int):
    up, down = [torch.from_numpy(w) for w in up], [torch.from_numpy(w) for w in down]

    def chain(x):
        torch.set_num_threads(threads)
        with torch.no_grad():
            x = torch.from_numpy(x)
            for a, b in zip(up, down, strict=True):
                x = x + torch.nn.functional.linear(torch.tanh(torch.nn.functional.linear(x, a)), b)
        return x

    return chain


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,5,8,16,32")
    p.add_argument("--repeats", type=int, default=15)
    a = p.parse_args(argv)
    up, down = weights()
    nbytes = sum(w.nbytes for w in up + down)
    sides = {"xla": jax_chain(up, down)}
    sides.update({f"torch_{t}t": torch_chain(up, down, t) for t in (1, 2)})
    bandwidth = memory_bandwidth()["bandwidth_GBps"]
    rows = []
    for m in (int(r) for r in a.rows.split(",")):
        x = np.random.default_rng(m).standard_normal((m, D)).astype(np.float32)
        outs = {name: np.asarray(fn(x)) for name, fn in sides.items()}  # also the warm-up
        for name, out in outs.items():
            np.testing.assert_allclose(out, outs["xla"], rtol=1e-3, atol=1e-3, err_msg=name)
        times: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(a.repeats):
            for name, fn in sides.items():
                t0 = time.perf_counter()
                fn(x)
                times[name].append(time.perf_counter() - t0)
        row: dict = {"M": m}
        for name, ts in times.items():
            row[f"{name}_ms"] = statistics.median(ts) * 1e3
            row[f"{name}_GBps"] = nbytes / min(ts) / 1e9
        rows.append(row)
    columns = ["M"] + [f"{n}_{u}" for n in sides for u in ("ms", "GBps")]
    print(f"weights {nbytes / 1e6:.0f} MB; numpy-copy bandwidth {bandwidth:.1f} GB/s")
    print("GB/s: weight bytes / fastest call; ms: median call\n")
    print_table(rows, columns)
    path = write_json(
        "small_m_products",
        rows,
        {"repeats": a.repeats, "weight_MB": nbytes / 1e6, "bandwidth_GBps": bandwidth},
    )
    print(f"\nwrote {path}")
    return rows


if __name__ == "__main__":
    main()
