"""The CPU path of the routed experts ("tiled", issue 13): its tile size and the form of a
tile's products, before and after. Float32, the ``small`` shapes (E = 8, k = 2, 768 -> 384).

- before: tiles of min(N, TILE_ROWS) rows, the expert's matrices taken with a dynamic index
  (XLA:CPU copies them before each product) and multiplied as einsums (the code until
  2026-12-01, restated here as the baseline);
- now: tiles of one (token, expert) pair at decode sizes (`moe.tile_rows`), and the products
  written with transposed weights, which XLA:CPU fuses with the expert's slice at one row;
- product only: today's product with the old tile sizes, to separate the two changes;
- loop bound before: today's code but the tiled loop's old bound, ceil(N k / T) + E tiles
  (`moe.max_tiles` since 2026-12-02: the most tiles a routing can fill, N k for one-pair tiles).

Two tables: the routed product alone over N tokens (router of a random MoE, checked against the
dense reference), and the whole compiled decode step of the served model at batch B. Each
variant is compiled by itself (`jax.clear_caches()` between, since the choice is made when the
step is traced), and the variants take turns call by call.

Run: ``python benchmarks/moe_tiles.py [--repeats 20] [--preset pycode]`` (prints a table, writes
``results/moe_tiles.json``, or ``moe_tiles_<preset>.json`` for another preset). ``pycode`` is the
built-in model's shape (E = 16, k = 2, 256 -> 256).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import serving_heap  # noqa: E402

serving_heap()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import print_table, timeit_interleaved, write_json  # noqa: E402
from flax import nnx  # noqa: E402

from kimi_linear_jax.cache import contiguous_batch, init_cache  # noqa: E402
from kimi_linear_jax.layers import moe  # noqa: E402
from kimi_linear_jax.model import HashedGraph, decode_step, for_serving  # noqa: E402
from kimi_linear_jax.presets import preset  # noqa: E402
from kimi_linear_jax.testing import random_model  # noqa: E402

CONFIG = preset("small")  # --preset replaces it
PAGES, PAGE = 64, 16


def _expert_ffn_before(x, e, weights):
    """The tile's expert product as it was: a dynamic index into the stacked weights, then
    einsums (XLA:CPU copies the expert's matrices out before each product)."""
    w1, w3, w2 = (jax.lax.dynamic_index_in_dim(m, e, keepdims=False) for m in weights)
    gate = jnp.einsum("td,id->ti", x, w1)
    up = jnp.einsum("td,id->ti", x, w3)
    return jnp.einsum("ti,di->td", (jax.nn.silu(gate) * up).astype(x.dtype), w2)


def _max_tiles_before(n_pairs: int, rows: int, n_experts: int) -> int:
    """The tiled loop's bound until 2026-12-02: room for a partial tile of every expert."""
    return -(-n_pairs // rows) + n_experts


# What each variant traces with: (PAIR_TILES_UP_TO, the tile's expert product, loop bound).
VARIANTS = {
    "before": (0, _expert_ffn_before, _max_tiles_before),
    "product only": (0, moe._expert_ffn, _max_tiles_before),
    "loop bound before": (moe.PAIR_TILES_UP_TO, moe._expert_ffn, _max_tiles_before),
    "now": (moe.PAIR_TILES_UP_TO, moe._expert_ffn, moe.max_tiles),
}


@contextlib.contextmanager
def traced_as(variant: str):
    """Trace and compile under the variant's tile rule, product and bound, from empty caches."""
    saved = moe.PAIR_TILES_UP_TO, moe._expert_ffn, moe.max_tiles
    moe.PAIR_TILES_UP_TO, moe._expert_ffn, moe.max_tiles = VARIANTS[variant]
    jax.clear_caches()
    try:
        yield
    finally:
        moe.PAIR_TILES_UP_TO, moe._expert_ffn, moe.max_tiles = saved


def routed_call(layer: moe.MoE, n: int):
    """The routed product over n tokens, compiled now; returns (call, output)."""
    x = jax.random.normal(jax.random.key(n), (n, CONFIG.hidden_size))
    w, idx = layer.gate(x)
    weights = (layer.experts.w1[...], layer.experts.w3[...], layer.experts.w2[...])

    def routed(w1, w3, w2, x, w, idx):
        return moe.Experts.tiled(types.SimpleNamespace(w1=w1, w3=w3, w2=w2), x, w, idx)

    compiled = jax.jit(routed).lower(*weights, x, w, idx).compile()
    return (lambda: compiled(*weights, x, w, idx)), compiled(*weights, x, w, idx)


def step_call(model, B: int):
    """The served model's decode step at batch B over its own cache (fed back), compiled now."""
    graphdef, params = nnx.split(model)
    graphdef = HashedGraph(graphdef)
    state = {
        "cache": init_cache(
            CONFIG, num_slots=B + 1, num_pages=PAGES * B, page_size=PAGE, dtype=jnp.float32
        )
    }
    batch = contiguous_batch(B, 128, PAGE, start=np.full(B, 40), lengths=np.ones(B))
    # Distinct tokens, so that the rows route as a real batch's would (equal ones would all go
    # to the same two experts).
    ids = jax.random.randint(jax.random.key(B), (B, 1), 0, CONFIG.vocab_size, jnp.int32)
    compiled = decode_step.lower(graphdef, params, ids, state["cache"], batch).compile()

    def call():
        logits, state["cache"] = compiled(params, ids, state["cache"], batch)
        return logits

    return call


def timed_rows(calls: dict, repeats: int, **key) -> list[dict]:
    times = timeit_interleaved(calls, warmup=2, repeats=repeats)
    base = times["before"]
    return [
        dict(
            **key,
            variant=name,
            median_ms=t["median_s"] * 1e3,
            min_ms=t["min_s"] * 1e3,
            vs_before_median=t["median_s"] / base["median_s"],
            vs_before_min=t["min_s"] / base["min_s"],
            vs_bound_before_median=t["median_s"] / times["loop bound before"]["median_s"],
        )
        for name, t in times.items()
    ]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--tokens", default="1,8,32,64,160,512")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--preset", default="small", help="model shape, e.g. small or pycode")
    a = p.parse_args(argv)
    global CONFIG
    CONFIG = preset(a.preset)
    layer = moe.MoE(CONFIG, dtype=jnp.float32, rngs=nnx.Rngs(0), dispatch="tiled")
    rows = []
    for n in (int(t) for t in a.tokens.split(",")):
        calls = {}
        for variant in VARIANTS:
            with traced_as(variant):
                calls[variant], y = routed_call(layer, n)
            x = jax.random.normal(jax.random.key(n), (n, CONFIG.hidden_size))
            ref = layer.experts.dense(x, *layer.gate(x))
            err = float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref)))
            if err > 1e-5:
                raise AssertionError(f"{variant}, N = {n}: relative error {err:.2e} vs dense")
        rows += timed_rows(calls, a.repeats, part="routed experts", N=n)
    model = for_serving(random_model(CONFIG, dtype=jnp.float32))
    for B in (int(b) for b in a.batches.split(",")):
        calls = {}
        for variant in VARIANTS:
            with traced_as(variant):
                calls[variant] = step_call(model, B)
        rows += timed_rows(calls, a.repeats, part="decode step", N=B)
    columns = ["part", "N", "variant", "median_ms", "min_ms", "vs_before_median", "vs_before_min"]
    columns.append("vs_bound_before_median")
    print_table(rows, columns)
    name = "moe_tiles" if a.preset == "small" else f"moe_tiles_{a.preset}"
    path = write_json(name, rows, {"repeats": a.repeats, "config": a.preset})
    print(f"\nwrote {path}")
    return rows


if __name__ == "__main__":
    main()
