"""How long JAX's CPU collectives (gloo) wait for a late process, by collective and group.

Two processes x 4 CPU devices (mesh `a` x `b` = 4 x 2 over the 8) on a free localhost port.
Each case opens some device groups first (the `opened` collectives, both processes together),
compiles the `then` collective, and process 1 sleeps `--late` seconds before running it. The
row says whether process 0, which waited, got its result, and after how long.

What it shows (the reason for `parallel/distributed.py::open_groups`): the first collective
of a device group fails after 30 s when a process is later than that (gloo connects the
group then, with a fixed 30 s timeout); once the group is open, all-reduce, all-gather and
all-to-all wait for the late process, also in another program; reduce-scatter fails after 30 s
even then (jax-ml/jax#40831), except where its input needs an all-gather over the same group in
the same program (`ag_rs`, as in DCP's combine): the processes meet at the all-gather.

Run: ``python benchmarks/gloo_window.py [--late 40]`` (about 45 s a case, 7 cases).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

# (opened first, then run late). The mesh is [4, 2] over process 0's four devices, then
# process 1's: each `a` group spans both processes, each `b` group stays inside one.
CASES = [
    ("", "psum_all"),
    ("psum_all", "psum_all"),
    ("psum_all", "all_gather_all"),
    ("psum_all", "psum_a"),
    ("psum_all,psum_a,psum_b", "all_to_all_a"),
    ("psum_all", "psum_scatter_all"),
    ("psum_all", "ag_rs_all"),
]
ALL = ("a", "b")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _collective(kind: str):
    """The shard_map body of a collective named `<op>_<axes>` (axes: `all`, `a` or `b`)."""
    import jax

    op, axes = kind.rsplit("_", 1)
    axes = ALL if axes == "all" else axes

    def body(x):
        if op == "psum":
            return jax.lax.psum(x, axes)
        if op == "all_gather":
            return jax.lax.all_gather(x, axes, tiled=True)[: x.shape[0]]
        if op == "all_to_all":
            return jax.lax.all_to_all(x, axes, 0, 0, tiled=True)
        if op == "psum_scatter":
            return jax.lax.psum_scatter(x, axes, tiled=True).repeat(8, 0)
        if op == "ag_rs":  # DCP's `ag_rs`: what is reduce-scattered needs the all-gather
            scale = jax.lax.all_gather(x, axes, tiled=True).sum()
            return jax.lax.psum_scatter(x * scale, axes, tiled=True).repeat(8, 0)
        raise ValueError(f"unknown collective {kind!r}")

    return body


def worker(pid: int, port: int, opened: str, then: str, late: float) -> None:
    """One process of a case; prints `result ok|failed SECONDS` (process 0 is the one timed)."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.distributed.initialize(f"localhost:{port}", 2, pid, heartbeat_timeout_seconds=100)
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ALL)
    spec = P(ALL)
    x = jax.make_array_from_callback(
        (64, 4), NamedSharding(mesh, spec), lambda index: np.ones((8, 4), np.float32)
    )

    def program(kind):
        return jax.jit(jax.shard_map(_collective(kind), mesh=mesh, in_specs=spec, out_specs=spec))

    for kind in filter(None, opened.split(",")):
        jax.block_until_ready(program(kind)(x))
    late_one = program(then)
    late_one.lower(x).compile()
    if pid == 1:
        time.sleep(late)
    t0 = time.monotonic()
    try:
        jax.block_until_ready(late_one(x))
        print(f"result ok {time.monotonic() - t0:.1f}", flush=True)
    except Exception as e:  # noqa: BLE001 - the failure is the measurement
        print(f"result failed {time.monotonic() - t0:.1f} {str(e)[:120]!r}", flush=True)
    os._exit(0)  # no shutdown barrier: the other process may have failed


def run_case(opened: str, then: str, late: float) -> dict:
    port = _free_port()
    cmd = [sys.executable, os.path.abspath(__file__), "--worker"]
    procs = [
        subprocess.Popen(
            [*cmd, str(i), str(port), opened or "-", then, str(late)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for i in range(2)
    ]
    out0 = procs[0].communicate(timeout=late + 240)[0]
    procs[1].kill()
    line = next((x for x in out0.splitlines() if x.startswith("result ")), "result died -")
    _, status, seconds, *error = line.split(" ", 3)
    return {
        "opened first": opened or "(none)",
        "then, one process late": then,
        "late_s": late,
        "process 0": status,
        "after_s": float(seconds) if seconds != "-" else None,
        "error": error[0] if error else "",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--late", type=float, default=40.0)
    ap.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        pid, port, opened, then, late = args.worker
        return worker(int(pid), int(port), opened.strip("-"), then, float(late))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import print_table, write_json

    rows = [run_case(opened, then, args.late) for opened, then in CASES]
    columns = ["opened first", "then, one process late", "late_s", "process 0", "after_s"]
    print_table(rows, columns)
    print("json:", write_json("gloo_window", rows, {"late_s": args.late}))


if __name__ == "__main__":
    main()
