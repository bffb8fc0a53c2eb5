"""The Mosaic GPU MLA kernel (`kernels/mla_decode_mgpu.py`) compiled deviceless for an H200.

Mosaic GPU lowers the kernel to PTX itself and runs ptxas when XLA compiles; with
MOSAIC_GPU_DUMP_PTXAS / MOSAIC_GPU_DUMP_TO it writes ptxas' report and the kernel's resources,
which this reads back: registers, spills, shared memory, wgmma and TMA instructions. Needs jax
>= 0.12 with the CUDA plugin at that version (the gpu-compile extra), on any machine:

    JAX_PLATFORMS=cpu python benchmarks/mosaic_compile.py [--out DIR]

Prints a table and writes mosaic_compile.json; exits 1 on a failed compile or a spill.
"""

from __future__ import annotations

import os
import tempfile

DUMP = tempfile.mkdtemp(prefix="mosaic_dump_")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.update(MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_TO=DUMP)

import argparse  # noqa: E402
import functools  # noqa: E402
import glob  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from benchmarks.harness import print_table, write_json  # noqa: E402
from kernels.gpu_target import Target, parse_ptxas, topology  # noqa: E402
from kernels.mla_decode_mgpu import mla_paged_attention_mgpu  # noqa: E402

TARGET = "h200"
L, R, B, TOKENS = 512, 64, 4, 4096  # the release's latent and rope widths


def compile_one(page: int, T: int, H: int) -> dict:
    """One launch at release dims, compiled; its ptxas report and resources read back."""
    for f in glob.glob(f"{DUMP}/*"):
        os.remove(f)
    sh = NamedSharding(Mesh(topology(TARGET).devices, ("x",)), PartitionSpec())
    P = TOKENS // page

    def arg(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

    bf16 = jnp.bfloat16
    args = (
        arg((B, T, H, L), bf16),
        arg((B, T, H, R), bf16),
        arg((B * P, page, L + R), bf16),
        arg((B, P), jnp.int32),
        arg((B, T), jnp.int32),
    )
    step = jax.jit(functools.partial(mla_paged_attention_mgpu, sm_scale=(L + R) ** -0.5))
    with jax.default_device(topology(TARGET).devices[0]):
        step.trace(*args).lower().compile()
    report = "".join(Path(p).read_text() for p in glob.glob(f"{DUMP}/*.ptxas"))
    ptx = "".join(Path(p).read_text() for p in glob.glob(f"{DUMP}/*.ptx"))
    resources = "".join(Path(p).read_text() for p in glob.glob(f"{DUMP}/*.resources.txt"))
    ((regs, stores, loads, _stack),) = parse_ptxas(report).values()
    smem = int(re.search(r"smem_scratch_bytes=(\d+)", resources).group(1))
    return dict(
        regs=regs,
        spills=stores + loads,
        smem_KiB=smem / 1024,
        blocks_per_sm=_blocks_per_sm(Target.load(TARGET), smem, regs),
        wgmma=ptx.count("wgmma.mma_async"),
        tma_copies=ptx.count("cp.async.bulk.tensor"),
        ptxas_warnings=report.count("warning") + report.count("Potential out of bound"),
    )


def _blocks_per_sm(target: Target, smem: int, regs: int) -> int:
    """Resident one-warpgroup blocks: by shared memory, and by registers (per warp, in 256s)."""
    per_warp = -(-regs * 32 // 256) * 256
    return min(target.smem_per_sm // smem, target.regs_per_sm // (4 * per_warp))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for mosaic_compile.json")
    args = ap.parse_args(argv)
    rows, failed = [], False
    for page in (16, 32, 64):
        # Decode at 32 heads (one 64-row block), verify windows of 9 and 17 at tp 4 (2 and 3
        # blocks). Launches with the same rows and page compile once (Mosaic caches them).
        for T, H in ((1, 32), (9, 8), (17, 8)):
            row = dict(kernel=f"release-bf16 p{page} T{T} H{H}")
            try:
                row |= compile_one(page, T, H)
            except Exception as e:  # noqa: BLE001  the table says which launch failed, and why
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            failed |= "error" in row or row.get("spills", 0) > 0
            rows.append(row)
    columns = ["kernel", "regs", "spills", "smem_KiB", "blocks_per_sm", "wgmma", "tma_copies"]
    print_table(rows, columns + ["ptxas_warnings", "error"])
    meta = dict(target=TARGET, jax=jax.__version__, L=L, R=R, B=B, tokens=TOKENS)
    print(write_json("mosaic_compile", rows, meta, out_dir=args.out))
    shutil.rmtree(DUMP, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
