"""Full-forward throughput of the ``small`` preset: ours (JAX) vs transformers (torch), float32.

No cache, logits for every position, B = 1. A random model is saved with ``save_pretrained``
and the same checkpoint is loaded by transformers, so both sides run identical weights on
identical ids; the logits are compared to show the work is the same. Ours is
``forward(graphdef, params, ids)`` (jitted, compile excluded); transformers runs in eval mode
under ``torch.no_grad()`` with ``torch.set_num_threads(os.cpu_count())``. Calls alternate
between the two so machine noise hits both alike.

Run from the repo root: ``python benchmarks/bench_forward.py [--T 128 512] [--repeats 2]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import print_table, timeit_interleaved, write_json  # noqa: E402
from flax import nnx  # noqa: E402

from kimi_linear_jax.checkpoint import save_pretrained  # noqa: E402
from kimi_linear_jax.model import forward, set_kda_impl  # noqa: E402
from kimi_linear_jax.presets import preset  # noqa: E402
from kimi_linear_jax.testing import random_model  # noqa: E402

COLUMNS = [
    "B",
    "T",
    "ours_tok_s",
    "ours_chunked_tok_s",
    "transformers_tok_s",
    "ours/transformers",
    "chunked/transformers",
    "ratio_of_min",
    "max_rel_err",
]


def load_transformers(path: str):
    import torch
    import transformers

    model = transformers.KimiLinearForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, nargs="+", default=[128, 512], help="sequence lengths (B = 1)")
    p.add_argument("--repeats", type=int, default=2, help="timed calls per side and T")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    import torch
    import transformers

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)

    config = preset("small")
    model = random_model(config, seed=a.seed, dtype=jnp.float32)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp)
        tmodel = load_transformers(tmp)
    graphdef, params = nnx.split(model)  # default KDA prefill: 'auto' (recurrent on a CPU)
    graphdef_chunked = nnx.graphdef(set_kda_impl(model, "chunked"))
    print(f"small preset: {n_params / 1e6:.1f}M parameters; torch threads = {threads}", flush=True)

    rng = np.random.default_rng(a.seed)
    rows = []
    for t in a.T:
        ids = rng.integers(0, config.vocab_size, (1, t), dtype=np.int32)
        ids_j = jnp.asarray(ids)
        ids_t = torch.as_tensor(ids, dtype=torch.long)

        t0 = time.perf_counter()
        compiled = forward.lower(graphdef, params, ids_j).compile()
        compile_s = time.perf_counter() - t0
        compiled_chunked = forward.lower(graphdef_chunked, params, ids_j).compile()

        def ours(compiled=compiled, ids_j=ids_j):
            return compiled(params, ids_j)

        def ours_chunked(compiled=compiled_chunked, ids_j=ids_j):
            return compiled(params, ids_j)

        def theirs(ids_t=ids_t):
            with torch.no_grad():
                return tmodel(ids_t).logits

        # The first call of each side is the untimed warm-up (and gives the logits to compare).
        got = np.asarray(ours(), np.float64)
        got_chunked = np.asarray(ours_chunked(), np.float64)
        t0 = time.perf_counter()
        expected = theirs().numpy().astype(np.float64)
        first_torch_s = time.perf_counter() - t0
        err = np.abs(got - expected)
        scale = np.abs(expected).max()
        res = timeit_interleaved(
            {"ours": ours, "ours_chunked": ours_chunked, "transformers": theirs},
            warmup=0,
            repeats=a.repeats,
        )
        row = {
            "B": 1,
            "T": t,
            "repeats": a.repeats,
            "ours_compile_s": compile_s,
            "transformers_first_call_s": first_torch_s,
        }
        for side, r in res.items():
            row[f"{side}_median_s"] = r["median_s"]
            row[f"{side}_min_s"] = r["min_s"]
            row[f"{side}_all_s"] = r["all"]
            row[f"{side}_tok_s"] = t / r["median_s"]
        row["ours/transformers"] = row["ours_tok_s"] / row["transformers_tok_s"]
        row["chunked/transformers"] = row["ours_chunked_tok_s"] / row["transformers_tok_s"]
        row["chunked_max_rel_err"] = float(np.abs(got_chunked - expected).max() / scale)
        # The same ratio from each side's fastest call: less sensitive to a slow spell.
        row["ratio_of_min"] = row["transformers_min_s"] / row["ours_min_s"]
        # max |ours - theirs| over max |theirs|, and the rms relative error.
        row["max_rel_err"] = float(err.max() / scale)
        row["rms_rel_err"] = float(np.linalg.norm(got - expected) / np.linalg.norm(expected))
        row["max_abs_err"] = float(err.max())
        rows.append(row)
        print(f"done: T={t}", flush=True)

    print()
    print_table(rows, COLUMNS)
    path = write_json(
        "bench_forward",
        rows,
        {
            "preset": "small",
            "n_params": n_params,
            "dtype": "float32",
            "torch_version": torch.__version__,
            "transformers_version": transformers.__version__,
            "torch_num_threads": threads,
            "note": (
                "tokens/s = B*T / median wall time of a full no-cache forward (logits for all "
                "positions); our compile excluded, transformers' first call excluded; "
                "max_rel_err = max|ours - theirs| / max|theirs|; "
                "ratio_of_min uses each side's fastest call"
            ),
        },
    )
    print(f"\nwrote {os.path.relpath(path)}")
    return rows


if __name__ == "__main__":
    main()
