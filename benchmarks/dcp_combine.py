"""DCP partial combine: all-gather of (o, lse) + merge vs all-to-all over heads + merge vs
all-gather of lse + all-reduce of the rescaled o.

Times only the combine (the per-rank partials are inputs, sharded over 'dcp') on emulated CPU
devices, so the numbers measure copies and per-collective overhead, not NVLink; they rank the
strategies by work, not by what a GPU interconnect would give. Strategies:

- ``ag``: all-gather o [B,T,H,L] and lse [B,T,H] over 'dcp', merge locally
  (``kimi_linear_jax.parallel.dcp.combine_all_gather``).
- ``a2a+ag``: all-to-all over heads (rank r gets every rank's partial for heads group r), merge
  H/c heads locally, all-gather the merged heads to get a replicated output.
- ``a2a``: the same without the final all-gather, output head-sharded: what the model's TP x
  DCP path does (``kimi_linear_jax.parallel.dcp.combine_a2a``).
- ``ag_rs``: all-gather the lse, rescale, reduce-scatter o over heads, output head-sharded
  (``kimi_linear_jax.parallel.dcp.combine_ag_rs``, the model's default).
- ``ag_lse+psum``: all-gather lse only, scale o_r by exp(lse_r - lse), all-reduce
  (``kimi_linear_jax.parallel.dcp.combine_lse_psum``, the default of the tests'
  ``dcp_attention``).

Run from the repo root: ``python benchmarks/dcp_combine.py [--repeats 10] [--quick]`` (``--quick``:
6 of the 15 configs, 5 repeats; what ``run_all.py`` runs).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import print_table, timeit_interleaved, write_json  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from kimi_linear_jax.parallel import dcp  # noqa: E402
from kimi_linear_jax.parallel.mesh import shard_map  # noqa: E402

AX = dcp.DCP_AXIS
COLUMNS = ["c", "B", "T", "H", "L", "o_MiB", "ag_ms", "a2a+ag_ms", "a2a_ms", "ag_rs_ms"]
COLUMNS += ["ag_lse+psum_ms", "ag_rs/a2a", "max_abs_diff"]


def _a2a_ag(o, lse, c):
    o_m, lse_m = dcp.combine_a2a(o, lse, c)
    return (
        jax.lax.all_gather(o_m, AX, axis=2, tiled=True),
        jax.lax.all_gather(lse_m, AX, axis=2, tiled=True),
    )


def build(mesh: Mesh, c: int):
    """name -> jitted fn(o [c,B,T,H,L], lse [c,B,T,H]) (sharded over 'dcp' on axis 0)."""
    head_sharded = (P(None, None, AX, None), P(None, None, AX))

    def wrap(f, out_specs):
        def body(o, lse):
            return f(o[0], lse[0])

        return jax.jit(shard_map(body, mesh, (P(AX), P(AX)), out_specs))

    return {
        "ag": wrap(dcp.combine_all_gather, (P(), P())),
        "a2a+ag": wrap(lambda o, l: _a2a_ag(o, l, c), (P(), P())),
        "a2a": wrap(lambda o, l: dcp.combine_a2a(o, l, c), head_sharded),
        "ag_rs": wrap(lambda o, l: dcp.combine_ag_rs(o, l, c), head_sharded),
        "ag_lse+psum": wrap(dcp.combine_lse_psum, (P(), P())),
    }


def bench(c: int, B: int, T: int, H: int, L: int, repeats: int) -> dict:
    mesh = Mesh(np.array(jax.devices()[:c]), (AX,))
    rng = np.random.default_rng(0)
    o = rng.standard_normal((c, B, T, H, L)).astype(np.float32)
    lse = (rng.standard_normal((c, B, T, H)) * 3).astype(np.float32)
    lse[1:, 0] = -np.inf  # a short sequence: only rank 0 has keys
    o[1:, 0] = 0.0
    o = jax.device_put(o, NamedSharding(mesh, P(AX)))
    lse = jax.device_put(lse, NamedSharding(mesh, P(AX)))
    fns = build(mesh, c)
    outs = {k: jax.block_until_ready(f(o, lse)) for k, f in fns.items()}
    res = timeit_interleaved({k: (lambda f=f: f(o, lse)) for k, f in fns.items()}, repeats=repeats)
    row = {"c": c, "B": B, "T": T, "H": H, "L": L, "o_MiB": B * T * H * L * 4 / 2**20}
    for k, r in res.items():
        row[f"{k}_ms"] = r["median_s"] * 1e3
        row[f"{k}_min_ms"] = r["min_s"] * 1e3
    row["ag_rs/a2a"] = row["ag_rs_ms"] / row["a2a_ms"]
    row["max_abs_diff"] = max(
        float(jnp.max(jnp.abs(outs[k][0] - outs["ag"][0]))) for k in fns if k != "ag"
    )
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, help="timed calls per strategy (10; --quick: 5)")
    p.add_argument("--H", type=int, default=32, help="MLA heads (Kimi Linear 48B: 32)")
    p.add_argument("--L", type=int, default=512, help="kv_lora_rank")
    p.add_argument(
        "--quick",
        action="store_true",
        help="c in (2, 8) and (B, T) in ((1, 1), (32, 1), (8, 4)) only (run_all's setting)",
    )
    a = p.parse_args(argv)
    repeats = a.repeats or (5 if a.quick else 10)
    cs = (2, 8) if a.quick else (2, 4, 8)
    shapes = ((1, 1), (32, 1), (8, 4)) if a.quick else ((1, 1), (8, 1), (32, 1), (8, 4), (64, 1))
    rows = []
    for c in cs:
        for B, T in shapes:
            rows.append(bench(c, B, T, a.H, a.L, repeats))
            print(f"done: c={c} B={B} T={T}", flush=True)
    print()
    print_table(rows, COLUMNS)
    path = write_json(
        "dcp_combine",
        rows,
        {
            "dtype": "float32",
            "quick": a.quick,
            "repeats": repeats,
            "note": "median ms of the combine alone on emulated CPU devices; compile excluded",
        },
    )
    print(f"\nwrote {os.path.relpath(path)}")
    return rows


if __name__ == "__main__":
    main()
