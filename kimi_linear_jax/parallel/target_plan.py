"""`kimi-linear-jax plan --target h200`: the memory plan with the activation compiled for a GPU
that is not there.

The model, its parameters and the caches are abstract (`nnx.eval_shape`; shapes with their
shardings on the target topology's compile-only devices), and the engine's two largest steps
(`memory.compiled_peak`: the prefill chunk over a cached prefix, the decode or verify window at
the planned rows) compile deviceless for the target (`kernels/gpu_target.py`): the peak is XLA's
own for that GPU, with the Pallas kernel and the GPU's fusions, where the planner otherwise
estimates it. Needs the gpu-compile extra (`make gpu-compile` installs it in .venv-cuda).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kimi_linear_jax.parallel import rules
from kimi_linear_jax.parallel.mesh import make_parallel
from kimi_linear_jax.parallel.plan import BATCH_BUCKETS, MemoryPlan
from kimi_linear_jax.parallel.pools import PoolOptions, compiled_peak, measured_plan

# The engine's defaults for what shapes its largest steps (`LLM`'s arguments).
ENGINE_CHUNK_SIZE = 64
ENGINE_TOKEN_BUCKETS = (16, 64, 256)


@contextlib.contextmanager
def gpu_backend():
    """`jax.default_backend()` says "gpu": the trace-time choices of the model's ops follow."""
    real = jax.default_backend
    jax.default_backend = lambda: "gpu"
    try:
        yield
    finally:
        jax.default_backend = real


def target_plan(config, kw: dict, *, target: str) -> MemoryPlan:
    """`plan_memory(config, **kw)` with the activation compiled deviceless for `target`."""
    from kernels.gpu_target import topology

    kw = {**kw, "attention": "kernel"}
    tp, dcp = kw["tensor_parallel_size"], kw["dcp_size"]
    devices = topology(target, f"1x1x{tp}").devices
    par = make_parallel(
        config,
        tp,
        dcp,
        replicate_q_proj=kw.get("replicate_q_proj", False),
        attention="kernel",
        devices=devices,
    )
    model = _abstract_model(config, jnp.dtype(kw["dtype"]), par)
    opts = _pool_options(kw)
    mesh = par.mesh if par.sharded else Mesh(np.array(devices[:1]), ("one",))
    replicated = NamedSharding(mesh, PartitionSpec())

    def place(args):
        def one(x):
            if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)
            return x

        return jax.tree.map(one, args)

    def measure(plan):
        with jax.default_device(devices[0]), gpu_backend():
            return compiled_peak(model, plan, opts, place=place)

    plan = measured_plan(model, opts, kw, measure)
    method = f"compiled deviceless for {target}"
    return dataclasses.replace(plan, activation_method=method)


def _abstract_model(config, dtype, par):
    """The model as shapes, its parameters carrying their shardings on `par`'s mesh."""
    from kimi_linear_jax.model import KimiLinearForCausalLM
    from kimi_linear_jax.parallel.weights import OneKey

    abstract = nnx.eval_shape(
        lambda: KimiLinearForCausalLM(config, dtype=dtype, rngs=OneKey(), par=par)
    )
    graphdef, state = nnx.split(abstract)
    if par.sharded:
        specs = rules.param_specs(state, rules.ShardingRules.for_parallel(par))
        state = jax.tree.map(
            lambda var, s: var.replace(jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=s)),
            state,
            rules.shardings(specs, par.mesh),
            is_leaf=lambda x: isinstance(x, nnx.Variable),
        )
    return nnx.merge(graphdef, state)


def _pool_options(kw: dict) -> PoolOptions:
    return PoolOptions(
        page_size=kw["page_size"],
        num_pages=None,
        max_num_seqs=kw["max_num_seqs"],
        num_checkpoint_slots=kw["num_checkpoint_slots"],
        enable_prefix_caching=kw["enable_prefix_caching"],
        num_draft_tokens=kw["num_draft_tokens"],
        max_model_len=kw["max_model_len"],
        max_num_batched_tokens=kw["max_num_batched_tokens"],
        chunk_size=ENGINE_CHUNK_SIZE,
        batch_buckets=kw.get("batch_buckets", BATCH_BUCKETS),
        token_buckets=ENGINE_TOKEN_BUCKETS,
        gpu_memory_utilization=kw["gpu_memory_utilization"],
        device_memory=kw["device_memory"],
        state_memory_ratio=kw["state_memory_ratio"],
    )
