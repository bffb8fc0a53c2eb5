"""The parameters' bytes per device under a (TP, DCP) plan, from the sharding rules and the
abstract model (`nnx.eval_shape`): nothing is allocated, no device is needed. The planner's
weights term."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_linear_jax.model import KimiLinearForCausalLM
from kimi_linear_jax.parallel.mesh import DCP_AXIS, MODEL_AXIS, Parallel
from kimi_linear_jax.parallel.rules import Axes, ShardingRules, shard_elements


def param_bytes_per_device(
    config, tp: int, dcp: int = 1, *, dtype=jnp.bfloat16, replicate_q_proj: bool = False
) -> tuple[int, int]:
    """(bytes of parameters on each device, bytes in all) of `config` under (tp, dcp), from
    the sharding rules and the abstract model: nothing is allocated, no device is needed."""
    par = Parallel(tp, dcp, replicate_q_proj)
    rules = ShardingRules.for_parallel(par)
    sizes = {MODEL_AXIS: tp // dcp, DCP_AXIS: dcp}
    per_device = total = 0
    for shape, item, logical in _abstract_params(config, jnp.dtype(dtype)):
        total += math.prod(shape) * item
        per_device += shard_elements(shape, rules.spec(logical, len(shape)), sizes) * item
    return per_device, total


class OneKey:
    """Stands in for `nnx.Rngs` in an abstract build: no value is ever drawn, so one key serves
    every parameter. `nnx.Rngs` counts its draws in a Variable, and each traced update makes
    flax ask the tracer for its sharding, whose error message walks the whole trace so far:
    quadratic, 16 s for the release on a loaded CPU against 3 s with this."""

    def params(self):
        return jax.random.key(0)


@functools.lru_cache(maxsize=8)
def _abstract_params(config, dtype) -> tuple[tuple[tuple[int, ...], int, Axes], ...]:
    """(shape, itemsize, logical axes) of every parameter of `config`'s model, one
    `eval_shape` per config and dtype (a planner asks for several device sets)."""
    abstract = nnx.eval_shape(lambda: KimiLinearForCausalLM(config, dtype=dtype, rngs=OneKey()))
    return tuple(
        (tuple(var.shape), jnp.dtype(var.dtype).itemsize, var.get_metadata().get("logical"))
        for _, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param))
    )
