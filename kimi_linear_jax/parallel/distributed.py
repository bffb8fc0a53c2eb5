"""Several processes (hosts) as one mesh: `jax.distributed.initialize`, then `jax.devices()`
lists every process's devices and the plan's mesh spans them all.

Every process runs the same engine on the same inputs (multi-controller JAX): process 0 (the
leader) owns the tokenizer's output, the HTTP server and the results; the others (followers)
run the same jitted steps in the same order and print nothing. The inputs of each step are
derived deterministically on every process from the same requests (same order, same ids,
same engine seed): a step's host inputs are small, but deciding them needs the scheduler's
whole state, so replaying the scheduler is simpler and cheaper than broadcasting each step's
batch. Requests that reach only the leader (the server) are broadcast by its engine loop,
each iteration's with whether it steps (`serving/lockstep.py`).

The axis that crosses processes is the mesh's first ("model"): devices are listed process by
process, so a DCP group (contiguous devices) stays inside one host when dcp divides the
local device count, and only the TP/EP collectives cross hosts.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import os

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kimi_linear_jax.parallel.mesh import shard_map

ENV = {
    "coordinator_address": "KIMI_COORDINATOR_ADDRESS",
    "num_processes": "KIMI_NUM_PROCESSES",
    "process_id": "KIMI_PROCESS_ID",
}
# A process that stops answering is declared dead after this long, and the others exit with
# an error instead of waiting in a collective forever (jax's default is 100 s).
HEARTBEAT_TIMEOUT_S = 30
# How long `open_groups` waits for the slowest process (loading its weights, say).
GROUPS_BARRIER_TIMEOUT_S = 600
_barrier_ids = itertools.count()


@dataclasses.dataclass(frozen=True)
class Distributed:
    coordinator_address: str  # HOST:PORT of process 0's coordination service
    num_processes: int
    process_id: int

    def validate(self) -> None:
        host, _, port = self.coordinator_address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(
                f"coordinator_address must be HOST:PORT, got {self.coordinator_address!r}"
            )
        if not isinstance(self.num_processes, int) or self.num_processes < 1:
            raise ValueError(f"num_processes must be an integer >= 1, got {self.num_processes!r}")
        if not isinstance(self.process_id, int) or not 0 <= self.process_id < self.num_processes:
            raise ValueError(
                f"process_id must be in [0, {self.num_processes}), got {self.process_id!r}"
            )

    @classmethod
    def parse(cls, value) -> Distributed | None:
        """From None (then the KIMI_* environment variables, if set), a Distributed, or a dict
        with the three fields."""
        if value is None:
            return cls.from_env()
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(ENV))
            if unknown:
                raise ValueError(f"distributed: unknown keys {unknown}; known: {sorted(ENV)}")
            missing = sorted(set(ENV) - set(value))
            if missing:
                raise ValueError(f"distributed: missing keys {missing}")
            value = cls(**value)
        if not isinstance(value, cls):
            raise ValueError(f"distributed must be a dict, got {type(value).__name__}")
        value.validate()
        return value

    @classmethod
    def from_env(cls) -> Distributed | None:
        found = {k: os.environ.get(v) for k, v in ENV.items()}
        if not any(found.values()):
            return None
        missing = [ENV[k] for k, v in found.items() if not v]
        if missing:
            raise ValueError(f"set all of {sorted(ENV.values())} or none; missing {missing}")
        for key in ("num_processes", "process_id"):
            if not found[key].isdigit():
                raise ValueError(f"{ENV[key]} must be an integer, got {found[key]!r}")
            found[key] = int(found[key])
        return cls.parse(found)


def initialize(dist: Distributed | None) -> None:
    """Join the group (once per process; before anything touches a device). None: one process."""
    if dist is None or dist.num_processes == 1:
        return
    if jax.distributed.is_initialized():
        if jax.process_count() != dist.num_processes or jax.process_index() != dist.process_id:
            raise ValueError(
                f"jax.distributed is already initialized as process {jax.process_index()} of "
                f"{jax.process_count()}, not {dist.process_id} of {dist.num_processes}"
            )
        return
    jax.distributed.initialize(
        dist.coordinator_address,
        dist.num_processes,
        dist.process_id,
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
    )
    atexit.register(jax.distributed.shutdown)


def is_leader() -> bool:
    return jax.process_index() == 0


def multi_process() -> bool:
    return jax.process_count() > 1


def open_groups(*meshes) -> None:
    """Open, with every process together, each device group that a collective of the engine
    may use: the process groups of `multihost_utils` (the lockstep broadcast, `assert_equal`)
    and, on each mesh given (None: one device), the group of every set of its axes.

    Why: on a CPU, JAX's collectives are gloo's, which connects a device group at the
    group's first collective and gives every process 30 s to arrive there (fixed; neither
    JAX nor XLA sets it), after which the early ones fail and the coordination service ends
    them all. A process that loads or compiles more slowly, or that starts an HTTP server
    first, can be that late. Once a group is open its collectives wait as long as XLA's
    collective timeout (minutes), so the processes first meet at a barrier of the
    coordination service, whose timeout is ours, and then open every group at once. On
    other backends, or with one process, this does nothing."""
    if not multi_process() or jax.default_backend() != "cpu":
        return
    from jax._src import distributed as jax_distributed  # the barrier: no public API

    barrier = f"kimi_linear_jax/open_groups/{next(_barrier_ids)}"
    jax_distributed.global_state.client.wait_at_barrier(barrier, GROUPS_BARRIER_TIMEOUT_S * 1000)
    multihost_utils.broadcast_one_to_all(np.zeros(1, np.uint8))
    multihost_utils.process_allgather(np.zeros(1, np.uint8))
    for mesh in meshes:
        if mesh is not None:
            for axes in _axis_sets(mesh.axis_names):
                _psum_over(mesh, axes)


def _axis_sets(names: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Every nonempty set of the axes: a collective over it reduces within one group."""
    return [c for r in range(1, len(names) + 1) for c in itertools.combinations(names, r)]


def _psum_over(mesh, axes: tuple[str, ...]) -> None:
    spec = P(mesh.axis_names)
    x = jax.make_array_from_callback(
        (mesh.size,), NamedSharding(mesh, spec), lambda index: np.ones(1, np.float32)
    )
    fn = shard_map(lambda v: jax.lax.psum(v, axes), mesh, in_specs=spec, out_specs=spec)
    jax.block_until_ready(jax.jit(fn)(x))
