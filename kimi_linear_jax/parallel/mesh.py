"""The one mesh: tensor parallelism (TP) with decode context parallelism (DCP) inside it.

vLLM's names: `tensor_parallel_size` is the TP degree (the devices used) and `dcp_size` divides
it. The DCP groups are contiguous runs of the innermost TP ranks (`dcp_rank = tp_rank % dcp`),
so the mesh is `[tp // dcp, dcp]` with axes ("model", "dcp") and the TP group is both axes
together. DCP adds no devices: inside a DCP group every rank serves the same MLA heads and holds
1/dcp of each sequence's latent tokens.

`Parallel` is the static plan a model is built for: sizes, the mesh, the MLA attention
implementation and the DCP combine. It is hashable (it sits in the model's graphdef), and the
layers read it instead of taking `mesh=` / `backend=` arguments on every call.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh

MODEL_AXIS = "model"
DCP_AXIS = "dcp"
TP_AXES = (MODEL_AXIS, DCP_AXIS)  # the whole TP group

# How DCP partials return to head shards (both exact; see parallel/dcp.py):
# "ag_rs": all-gather the lse, rescale, reduce-scatter o over heads (vLLM);
# "a2a": one all-to-all of (o, lse) over heads, then a local merge (sglang, tpu-inference).
COMBINES = ("ag_rs", "a2a")
# Paged MLA attention: the Pallas kernel (GPU), the XLA reference, the kernel in interpret mode
# (tests on a CPU), or "auto" (the kernel on a GPU, else the reference; `make_parallel` turns
# it into one of the others when it builds a plan).
ATTENTION_IMPLS = ("auto", "reference", "kernel", "interpret")


@dataclasses.dataclass(frozen=True)
class Parallel:
    """A model's parallel plan. `Parallel()` is one device: no mesh, no collectives."""

    tensor_parallel_size: int = 1
    dcp_size: int = 1
    replicate_q_proj: bool = False
    combine: str = "ag_rs"
    attention: str = "auto"
    mesh: Mesh | None = None

    @property
    def tp(self) -> int:
        return self.tensor_parallel_size

    @property
    def dcp(self) -> int:
        return self.dcp_size

    @property
    def sharded(self) -> bool:
        return self.mesh is not None

    @property
    def q_gather(self) -> bool:
        """Whether the absorbed query is all-gathered over the DCP group before attention."""
        return self.dcp > 1 and not self.replicate_q_proj

    def tp_rank(self):
        """This device's rank in the TP group (inside the model's shard_map only)."""
        return jax.lax.axis_index(TP_AXES)

    def dcp_rank(self):
        return jax.lax.axis_index(DCP_AXIS)

    def psum(self, x):
        """The one all-reduce of a row-parallel layer (identity on one device)."""
        return jax.lax.psum(x, TP_AXES) if self.tp > 1 else x


SINGLE = Parallel()


def resolve_sizes(tensor_parallel_size: int | None, dcp_size: int | None) -> tuple[int, int]:
    """(tp, dcp) from what the user gave: tp defaults to dcp, dcp to 1."""
    dcp = 1 if dcp_size is None else dcp_size
    tp = dcp if tensor_parallel_size is None else tensor_parallel_size
    return tp, dcp


def validate(
    config,
    tensor_parallel_size: int,
    dcp_size: int,
    num_devices: int | None = None,
    *,
    combine: str = "ag_rs",
    attention: str = "auto",
) -> None:
    """Raise ValueError (naming both numbers) for a plan the model or the machine cannot take.
    Runs before anything loads: it needs the config only."""
    tp, dcp = tensor_parallel_size, dcp_size
    for name, v in (("tensor_parallel_size", tp), ("dcp_size", dcp)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if tp % dcp:
        raise ValueError(
            f"dcp_size {dcp} must divide tensor_parallel_size {tp} (DCP is a subgroup of TP)"
        )
    n = jax.device_count() if num_devices is None else num_devices
    if tp > n:
        raise ValueError(
            f"tensor_parallel_size {tp} (dcp_size {dcp}) asks for more devices than present ({n})"
        )
    if combine not in COMBINES:
        raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")
    if attention not in ATTENTION_IMPLS:
        raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {attention!r}")
    checks = (
        ("MLA heads (num_attention_heads)", config.num_attention_heads),
        ("KDA heads (linear_num_heads)", config.linear_num_heads),
        ("experts (num_experts)", config.num_experts),
        ("vocab_size", config.vocab_size),
        ("intermediate_size", config.intermediate_size),
        ("shared expert width", config.moe_intermediate_size * config.num_shared_experts),
    )
    for what, value in checks:
        if value and value % tp:
            raise ValueError(f"tensor_parallel_size {tp} must divide the {what} ({value})")


def default_attention() -> str:
    """The Pallas kernel on a GPU, the XLA reference elsewhere (decided once, at build)."""
    return "kernel" if jax.default_backend() == "gpu" else "reference"


def make_parallel(
    config,
    tensor_parallel_size: int | None = None,
    dcp_size: int | None = None,
    *,
    replicate_q_proj: bool = False,
    combine: str = "ag_rs",
    attention: str | None = None,
    devices=None,
) -> Parallel:
    """Validate, then build the mesh over the first tp devices: `[tp // dcp, dcp]` so that
    consecutive TP ranks share a DCP group. tp = dcp = 1 gives `SINGLE` (no mesh)."""
    tp, dcp = resolve_sizes(tensor_parallel_size, dcp_size)
    attention = default_attention() if attention in (None, "auto") else attention
    devices = list(jax.devices() if devices is None else devices)
    validate(config, tp, dcp, len(devices), combine=combine, attention=attention)
    if tp == 1:
        return dataclasses.replace(SINGLE, attention=attention)
    mesh = Mesh(np.asarray(devices[:tp]).reshape(tp // dcp, dcp), TP_AXES)
    return Parallel(tp, dcp, replicate_q_proj, combine, attention, mesh)


try:  # jax >= 0.7 (0.10 to 0.12 included)
    from jax import shard_map as _shard_map

    _NO_CHECK = {"check_vma": False}
except ImportError:  # pragma: no cover - older jax
    from jax.experimental.shard_map import shard_map as _shard_map

    _NO_CHECK = {"check_rep": False}


def shard_map(fn, mesh: Mesh, in_specs, out_specs):
    """jax's shard_map without replication checks (the model's collectives are explicit)."""
    return _shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **_NO_CHECK)
