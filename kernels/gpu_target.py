"""Deviceless GPU compiles: what a step costs on an H200, read off XLA's own compile, no GPU.

XLA compiles for a GPU it does not have when it is given the GPU's target config and no client
(`jax.experimental.topologies.get_topology_desc(..., target_config=...)`): the Triton pipeline,
the per-block shared-memory limit and ptxas all run for real. What comes back here:

- each kernel's launch from the thunk sequence XLA dumps (grid, threads, shared memory),
- each kernel's registers, spills and stack from `ptxas -v` over the dumped PTX,
- which matrix instructions the PTX uses (`wgmma` on Hopper, Ampere's `mma.sync`) and TMA,
- the executable's `memory_analysis()` (argument, output and temp bytes).

Needs `pip install -e '.[gpu-compile]'` (the CUDA plugin and ptxas) and `JAX_PLATFORMS=cpu`
(so that the CUDA plugin registers without looking for a driver); `make gpu-compile` does both.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os
import re
import subprocess
import tempfile
from pathlib import Path

import jax

TARGETS_DIR = Path(__file__).parent / "targets"


@dataclasses.dataclass(frozen=True)
class Target:
    """The fields of a target config that the occupancy and bandwidth models read."""

    name: str
    text: str
    sms: int
    smem_per_sm: int
    smem_per_block: int
    regs_per_sm: int
    threads_per_sm: int
    bandwidth: float  # bytes per second
    device_memory: int  # bytes

    @classmethod
    def load(cls, name: str) -> Target:
        path = TARGETS_DIR / f"{name}.txtpb"
        if not path.exists():
            raise ValueError(f"unknown GPU target {name!r}; known: {known_targets()}")
        text = path.read_text()

        def field(key: str) -> float:
            return float(re.search(rf"^\s*{key}: ([0-9.e+]+)", text, re.M).group(1))

        return cls(
            name=name,
            text=text,
            sms=int(field("core_count")),
            smem_per_sm=int(field("shared_memory_per_core")),
            smem_per_block=int(field("shared_memory_per_block_optin")),
            regs_per_sm=int(field("registers_per_core_limit")),
            threads_per_sm=int(field("threads_per_core_limit")),
            bandwidth=field("memory_bandwidth"),
            device_memory=int(field("device_memory_size")),
        )


def known_targets() -> list[str]:
    return sorted(p.stem for p in TARGETS_DIR.glob("*.txtpb"))


class NoGpuCompiler(OSError):
    """This machine cannot compile for a GPU: the CUDA plugin (and its ptxas) is missing.
    An OSError so the command line reports it as a plain `error:`."""


@functools.cache
def topology(target: str = "h200", shape: str = "1x1x1"):
    """Compile-only devices of `target` ("1x1x1": one; "1x1x8" or "1x2x4": eight)."""
    from jax.experimental import topologies

    try:
        return topologies.get_topology_desc(
            target, platform="cuda", target_config=Target.load(target).text, topology=shape
        )
    except NotImplementedError as e:
        raise NoGpuCompiler(
            "deviceless GPU compiles need the CUDA plugin: pip install -e '.[gpu-compile]' "
            "and run with JAX_PLATFORMS=cpu"
        ) from e


@dataclasses.dataclass
class KernelStats:
    """One GPU kernel of a compiled executable."""

    name: str
    grid: tuple[int, ...]
    threads: int
    smem: int  # bytes of shared memory a block
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack: int = 0
    mma: str = "none"  # "wgmma", "mma.sync" or "none"
    tma: bool = False

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads

    def blocks_per_sm(self, target: Target) -> int:
        """Resident blocks an SM holds (registers are allocated per warp in units of 256)."""
        warps = -(-self.threads // 32)
        regs_per_warp = -(-max(self.registers, 1) * 32 // 256) * 256
        limits = [
            32,
            target.threads_per_sm // max(self.threads, 1),
            target.regs_per_sm // (regs_per_warp * warps),
        ]
        if self.smem:
            # Hopper reserves 1 KiB of shared memory a block for the system.
            limits.append(target.smem_per_sm // (self.smem + 1024))
        return max(0, min(limits))

    def occupancy(self, target: Target) -> float:
        """Resident warps over the SM's most (64 warps on Hopper)."""
        warps = -(-self.threads // 32)
        return self.blocks_per_sm(target) * warps / (target.threads_per_sm // 32)


@dataclasses.dataclass
class CompileReport:
    memory: dict[str, int]
    kernels: list[KernelStats]

    def kernel(self, prefix: str) -> list[KernelStats]:
        return [k for k in self.kernels if k.name.startswith(prefix)]


_THUNK = re.compile(
    r"\] (\S+) grid: \[([0-9, ]+)\] threads: \[([0-9, ]+)\]\s+shared_memory: (\d+) bytes"
)
_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def parse_thunks(text: str) -> list[KernelStats]:
    """The kernel launches of XLA's dumped thunk sequence."""
    out = []
    for name, grid, threads, smem in _THUNK.findall(text):
        dims = [int(x) for x in threads.split(",")]
        out.append(
            KernelStats(
                name=name,
                grid=tuple(int(x) for x in grid.split(",")),
                threads=dims[0] * dims[1] * dims[2] if len(dims) == 3 else dims[0],
                smem=int(smem),
            )
        )
    return out


def parse_ptxas(text: str) -> dict[str, tuple[int, int, int, int]]:
    """`ptxas -v` output -> {entry: (registers, spill stores, spill loads, stack bytes)}."""
    out, entry, frame = {}, None, (0, 0, 0)
    for line in text.splitlines():
        if m := _PTXAS_ENTRY.search(line):
            entry, frame = m.group(1), (0, 0, 0)
        elif (m := _PTXAS_STACK.search(line)) and entry:
            frame = tuple(int(x) for x in m.groups())
        elif (m := _PTXAS_REGS.search(line)) and entry:
            out[entry] = (int(m.group(1)), frame[1], frame[2], frame[0])
    return out


def _ptxas() -> str:
    import nvidia.cuda_nvcc

    return str(Path(nvidia.cuda_nvcc.__path__[0]) / "bin" / "ptxas")


def _ptx_entries(ptx: str) -> dict[str, str]:
    """{entry name: its body} of a PTX module (to tell each kernel's instructions apart)."""
    parts = re.split(r"\.visible \.entry (\w+)\(", ptx)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def _read_dump(dump: str, arch: str) -> list[KernelStats]:
    thunks = "".join(Path(p).read_text() for p in glob.glob(f"{dump}/*thunk_sequence.txt"))
    kernels = {k.name: k for k in parse_thunks(thunks)}
    for ptx_path in glob.glob(f"{dump}/*.ptx"):
        ptx = Path(ptx_path).read_text()
        if ".entry" not in ptx:  # XLA also dumps empty modules
            continue
        result = subprocess.run(
            [_ptxas(), f"-arch={arch}", "-v", ptx_path, "-o", os.devnull],
            capture_output=True,
            text=True,
            check=True,
        )
        for entry, (regs, st, ld, stack) in parse_ptxas(result.stdout + result.stderr).items():
            if entry not in kernels:
                continue
            body = _ptx_entries(ptx).get(entry, "")
            k = kernels[entry]
            k.registers, k.spill_stores, k.spill_loads, k.stack = regs, st, ld, stack
            k.mma = "wgmma" if "wgmma." in body else "mma.sync" if "mma.sync" in body else "none"
            k.tma = "cp.async.bulk.tensor" in body
    return list(kernels.values())


def compile_deviceless(step, *args, device=None, arch: str = "sm_90a", **kwargs) -> CompileReport:
    """Compile `step(*args, **kwargs)` (a jitted function; arguments as ShapeDtypeStruct with
    shardings on a `topology`'s devices) and read back its kernels and memory."""
    device = device or topology().devices[0]
    with tempfile.TemporaryDirectory() as dump, jax.default_device(device):
        compiled = step.trace(*args, **kwargs).lower().compile({"xla_dump_to": dump})
        kernels = _read_dump(dump, arch)
    mem = compiled.memory_analysis()
    memory = {
        k: int(getattr(mem, f"{k}_size_in_bytes"))
        for k in ("argument", "output", "alias", "temp", "generated_code")
    }
    return CompileReport(memory=memory, kernels=kernels)
