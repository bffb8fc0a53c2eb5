"""Prefill throughput of the KDA ops: ``kda_chunked`` vs ``kda_recurrent``.

Both are jitted and compiled ahead of the timed calls (compile time is reported, not counted).
Shapes: B = 1, T tokens, K = V = 128, with H = 6 (the ``small`` preset) and H = 32 (the
release). Run from the repo root: ``python benchmarks/bench_kda.py [--T 2048] [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import print_table, timeit_interleaved, write_json  # noqa: E402

from kimi_linear_jax.ops.kda import kda_chunked, kda_recurrent  # noqa: E402
from kimi_linear_jax.presets import preset  # noqa: E402

COLUMNS = [
    "shape",
    "B",
    "T",
    "H",
    "K",
    "V",
    "chunked_tok_s",
    "recurrent_tok_s",
    "chunked/recurrent",
    "ratio_of_min",
    "max_abs_diff",
]


def make_inputs(b: int, t: int, h: int, dk: int, dv: int, seed: int = 0):
    """Inputs in the ranges the model produces: unit-norm q/k, g <= 0, beta in (0, 1)."""
    rng = np.random.default_rng(seed)

    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q = unit(rng.standard_normal((b, t, h, dk), np.float32))
    k = unit(rng.standard_normal((b, t, h, dk), np.float32))
    v = rng.standard_normal((b, t, h, dv), np.float32)
    # log-sigmoid of a shifted normal: mostly mild decay, occasionally strong.
    g = -np.logaddexp(0.0, -(rng.standard_normal((b, t, h, dk), np.float32) + 3.0))
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((b, t, h), np.float32)))
    return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta))


def bench_shape(
    name: str, b: int, t: int, h: int, dk: int, dv: int, repeats: int, chunk_size: int
) -> dict:
    args = make_inputs(b, t, h, dk, dv)
    row = {"shape": name, "B": b, "T": t, "H": h, "K": dk, "V": dv, "repeats": repeats}
    impls = {
        "chunked": functools.partial(kda_chunked, chunk_size=chunk_size),
        "recurrent": kda_recurrent,
    }
    compiled, outs = {}, {}
    for impl, fn in impls.items():
        t0 = time.perf_counter()
        compiled[impl] = jax.jit(fn).lower(*args).compile()
        row[f"{impl}_compile_s"] = time.perf_counter() - t0
        outs[impl] = compiled[impl](*args)
    # Calls alternate between the two, so machine noise hits both alike.
    res = timeit_interleaved(
        {impl: (lambda c=c: c(*args)) for impl, c in compiled.items()},
        warmup=1,
        repeats=repeats,
    )
    for impl, r in res.items():
        row[f"{impl}_median_s"] = r["median_s"]
        row[f"{impl}_min_s"] = r["min_s"]
        row[f"{impl}_all_s"] = r["all"]
        row[f"{impl}_tok_s"] = b * t / r["median_s"]
    row["chunked/recurrent"] = row["chunked_tok_s"] / row["recurrent_tok_s"]
    # The same ratio from each side's fastest call: less sensitive to a slow spell.
    row["ratio_of_min"] = row["recurrent_min_s"] / row["chunked_min_s"]
    # Same work on both sides: o and the final state agree.
    row["max_abs_diff"] = max(
        float(jnp.max(jnp.abs(outs["chunked"][i] - outs["recurrent"][i]))) for i in range(2)
    )
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=2048, help="tokens per sequence (B = 1)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per op (H = 6)")
    p.add_argument(
        "--repeats-large",
        type=int,
        default=3,
        help="timed calls per op for the release shape (H = 32); it is slow on CPU",
    )
    p.add_argument("--chunk-size", type=int, default=64, help="kda_chunked's chunk_size")
    p.add_argument("--skip-large", action="store_true", help="only the small preset's shape")
    a = p.parse_args(argv)

    small = preset("small")
    release = preset("kimi-linear-48b-a3b")
    shapes = [("small", small.linear_num_heads, small.linear_head_dim, a.repeats)]
    if not a.skip_large:
        shapes.append(
            ("release", release.linear_num_heads, release.linear_head_dim, a.repeats_large)
        )
    rows = []
    for name, h, d, repeats in shapes:
        rows.append(bench_shape(name, 1, a.T, h, d, d, repeats, a.chunk_size))
        print(f"done: {name} (H={h})", flush=True)
    print()
    print_table(rows, COLUMNS)
    path = write_json(
        "bench_kda",
        rows,
        {
            "T": a.T,
            "dtype": "float32",
            "chunk_size": a.chunk_size,
            "note": "tokens/s = B*T / median wall time of a jitted call; compile excluded",
        },
    )
    print(f"\nwrote {os.path.relpath(path)}")
    return rows


if __name__ == "__main__":
    main()
