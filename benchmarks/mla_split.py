"""The compiled decode step with W_UK / W_UV sliced from kv_b_proj in the step (the model as
built) and split once (`model.for_serving`, what the engine runs), issue 13: ms per step at
batch 1 and 8, float32, the ``small`` shapes with a 320-id vocabulary (two MLA layers; the
model of ``decode_profile.py``), and XLA's bytes accessed per step. The two take turns call by
call (each with its own cache, fed back), so the ratio holds on a noisy machine.

Run: ``python benchmarks/mla_split.py [--repeats 30]`` (prints a table, writes
``results/mla_split.json``).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import print_table, timeit_interleaved, write_json  # noqa: E402
from flax import nnx  # noqa: E402

from kimi_linear_jax.cache import contiguous_batch, init_cache  # noqa: E402
from kimi_linear_jax.model import HashedGraph, decode_step, for_serving  # noqa: E402
from kimi_linear_jax.presets import preset  # noqa: E402
from kimi_linear_jax.testing import random_model  # noqa: E402

CONFIG = preset("small", vocab_size=320)
PAGES, PAGE = 64, 16


def stepper(model, B: int):
    """A decode call over its own cache (fed back), and the compiled step's bytes accessed."""
    graphdef, params = nnx.split(model)
    graphdef = HashedGraph(graphdef)
    state = {
        "cache": init_cache(
            CONFIG, num_slots=B + 1, num_pages=PAGES, page_size=PAGE, dtype=jnp.float32
        )
    }
    batch = contiguous_batch(B, 128, PAGE, start=np.full(B, 40), lengths=np.ones(B))
    ids = jnp.ones((B, 1), jnp.int32)

    def call():
        logits, state["cache"] = decode_step(graphdef, params, ids, state["cache"], batch)
        return logits

    compiled = decode_step.lower(graphdef, params, ids, state["cache"], batch).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return call, cost["bytes accessed"]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=30)
    a = p.parse_args(argv)
    model = random_model(CONFIG, dtype=jnp.float32)
    variants = {"sliced in the step": model, "split once (for_serving)": for_serving(model)}
    rows = []
    for B in (1, 8):
        steps = {name: stepper(m, B) for name, m in variants.items()}
        times = timeit_interleaved(
            {name: call for name, (call, _) in steps.items()}, warmup=3, repeats=a.repeats
        )
        base = times["sliced in the step"]
        for name, (_, nbytes) in steps.items():
            t = times[name]
            rows.append(
                dict(
                    B=B,
                    weights=name,
                    median_ms=t["median_s"] * 1e3,
                    min_ms=t["min_s"] * 1e3,
                    vs_sliced_median=t["median_s"] / base["median_s"],
                    vs_sliced_min=t["min_s"] / base["min_s"],
                    xla_bytes_MB=nbytes / 1e6,
                )
            )
    columns = ["B", "weights", "median_ms", "min_ms", "vs_sliced_median", "vs_sliced_min"]
    print_table(rows, columns + ["xla_bytes_MB"])
    path = write_json("mla_split", rows, {"repeats": a.repeats, "pages": PAGES})
    print(f"\nwrote {path}")
    return rows


if __name__ == "__main__":
    main()
