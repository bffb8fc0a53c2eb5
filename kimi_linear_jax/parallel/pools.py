"""The engine's pools sized from the device's memory (`LLM(gpu_memory_utilization=...)`).

When `num_pages` is not given and the device memory is known (XLA's `bytes_limit` on a GPU,
which `XLA_PYTHON_CLIENT_MEM_FRACTION` sets; where the backend reports none, as XLA:CPU, the
caller's `device_memory=`), `parallel.plan.plan_memory` sizes the pools from:

- the weights actually placed: the parameter bytes on the fullest device, a draft's included;
- the activation peak of the largest compiled steps, measured without running them: the
  model's prefill at the largest prefill bucket and its decode (the verify window when
  speculating) at the planned rows, compiled ahead of time, `compiled.memory_analysis()`'s
  temporaries plus the outputs that are not donated buffers. The prefill is lowered with the
  runner's own arguments, so a step of that shape later reuses the compilation. Sampling's
  [rows, vocab] buffers are added from the estimate (`footprint.SAMPLING_BYTES_PER_VOCAB`):
  they belong to the runner's step, not the model's.

Two passes: the estimate decides the rows, the steps are compiled at those rows, and the pools
are sized again from the measured peak with the rows as the cap. Otherwise (nothing known)
the fixed defaults below.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_linear_jax.cache import Batch, CacheLayout
from kimi_linear_jax.model import HashedGraph, decode_step, prefill_step
from kimi_linear_jax.parallel import rules
from kimi_linear_jax.parallel.footprint import SAMPLING_BYTES_PER_VOCAB, padded_rows
from kimi_linear_jax.parallel.plan import MemoryPlan, plan_memory

DEFAULT_NUM_PAGES = 256  # pools when the device memory is unknown (XLA:CPU)
DEFAULT_MAX_NUM_SEQS = 8
# Compilations of the largest steps before the plan settles (each try halves the rows).
MEASURE_TRIES = 3


@dataclasses.dataclass(frozen=True)
class PoolOptions:
    """The engine options that shape the pools (None: the planner decides)."""

    page_size: int
    num_pages: int | None
    max_num_seqs: int | None
    num_checkpoint_slots: int | None
    enable_prefix_caching: bool
    num_draft_tokens: int
    max_model_len: int | None
    max_num_batched_tokens: int
    chunk_size: int
    batch_buckets: Sequence[int]
    token_buckets: Sequence[int]
    gpu_memory_utilization: float
    device_memory: int | str | None
    state_memory_ratio: float


def model_devices(model) -> list:
    """The devices of this process that a model's parameters sit on (its mesh, or the one
    device); across several processes the others' devices cannot be asked for their memory."""
    if model.par.sharded:
        return [d for d in model.par.mesh.devices.flat if d.process_index == jax.process_index()]
    leaf = jax.tree.leaves(nnx.state(model))[0]
    return list(leaf.devices())


def device_memory_limit(devices) -> int | None:
    """The smallest `bytes_limit` XLA reports over `devices`; None where a backend reports
    none (XLA:CPU)."""
    limits = []
    for d in devices:
        stats = d.memory_stats() or {}
        if "bytes_limit" not in stats:
            return None
        limits.append(int(stats["bytes_limit"]))
    return min(limits)


def placed_bytes(trees, devices) -> int:
    """Bytes of the arrays of `trees` on the fullest of `devices` (a replicated array counts
    whole on every device, a sharded one by its shard)."""
    per_device = dict.fromkeys(devices, 0)
    for leaf in jax.tree.leaves(trees):
        for shard in getattr(leaf, "addressable_shards", ()):
            if shard.device in per_device:
                per_device[shard.device] += shard.data.nbytes
    return max(per_device.values())


def plan_pools(model, draft, opts: PoolOptions) -> tuple[CacheLayout, MemoryPlan | None]:
    """The cache layout (and the plan behind it, None for fixed pools)."""
    devices = model_devices(model)
    memory = device_memory_limit(devices) if opts.device_memory is None else opts.device_memory
    if opts.num_pages is not None or memory is None:
        return _fixed(opts, model.par.dcp), None
    kw = _plan_kwargs(model, draft, opts, memory, devices)
    plan = measured_plan(model, opts, kw, lambda plan: compiled_peak(model, plan, opts))
    return plan.layout(), plan


def measured_plan(model, opts: PoolOptions, kw: dict, measure) -> MemoryPlan:
    """The estimate's plan, then planned again from `measure(plan)`: the largest steps'
    compiled peak at its rows (halving the rows while that leaves too little beside it).
    `measure` returning None (the backend reports no memory) keeps the estimate."""
    plan = _fitting(plan_memory(model.config, **kw))
    for _ in range(MEASURE_TRIES):
        peak = measure(plan)
        if peak is None:
            return plan
        rows = padded_rows(plan.max_num_seqs, opts.batch_buckets)
        sampling = rows * (opts.num_draft_tokens + 1) * model.config.vocab_size
        peak += sampling * SAMPLING_BYTES_PER_VOCAB
        measured = plan_memory(
            model.config, **{**kw, "activation_bytes": peak, "max_num_seqs": plan.max_num_seqs}
        )
        if measured.fits or plan.max_num_seqs == 1:
            return _fitting(measured)
        # The steps compiled for these rows leave too little beside them: fewer rows.
        plan = _fitting(plan_memory(model.config, **{**kw, "max_num_seqs": rows // 2 or 1}))
    return _fitting(measured)


def _fitting(plan: MemoryPlan) -> MemoryPlan:
    if not plan.fits:
        raise ValueError(f"the model does not fit the device memory: {plan.reason}")
    return plan


def _fixed(opts: PoolOptions, dcp: int) -> CacheLayout:
    seqs = DEFAULT_MAX_NUM_SEQS if opts.max_num_seqs is None else opts.max_num_seqs
    pages = DEFAULT_NUM_PAGES if opts.num_pages is None else opts.num_pages
    ckpt = 2 * seqs if opts.num_checkpoint_slots is None else opts.num_checkpoint_slots
    ckpt = ckpt if opts.enable_prefix_caching else 0
    return CacheLayout(pages, opts.page_size, dcp, seqs, ckpt)


def _plan_kwargs(model, draft, opts: PoolOptions, memory, devices) -> dict:
    trees = [nnx.state(model)] + ([nnx.state(draft)] if draft is not None else [])
    return dict(
        device_memory=memory,
        tensor_parallel_size=model.par.tp,
        dcp_size=model.par.dcp,
        gpu_memory_utilization=opts.gpu_memory_utilization,
        max_model_len=opts.max_model_len,
        dtype=str(jnp.dtype(model.dtype)),
        page_size=opts.page_size,
        max_num_seqs=opts.max_num_seqs,
        num_checkpoint_slots=opts.num_checkpoint_slots,
        enable_prefix_caching=opts.enable_prefix_caching,
        num_draft_tokens=opts.num_draft_tokens,
        draft_config=None if draft is None else draft.config,
        state_memory_ratio=opts.state_memory_ratio,
        max_num_batched_tokens=opts.max_num_batched_tokens,
        batch_buckets=opts.batch_buckets,
        attention=model.par.attention,
        weights_bytes=placed_bytes(trees, devices),
    )


def compiled_peak(
    model, plan: MemoryPlan, opts: PoolOptions, place=lambda args: args
) -> int | None:
    """The larger activation peak of the two largest steps at `plan`'s shapes: temporaries
    plus outputs that are not donated buffers, per device. None if the backend reports none.
    `place`: maps each step's abstract arguments onto the devices to compile for (a GPU
    target's, `kimi_linear_jax.parallel.target_plan`); by default they are the model's own."""
    layout = plan.layout()
    width = layout.pages_for(plan.max_model_len)
    graphdef, params = nnx.split(model)
    graphdef = HashedGraph(graphdef)
    cache = _abstract_cache(model, layout)
    budget = opts.max_num_batched_tokens
    rows = padded_rows(min(plan.max_num_seqs, budget), opts.batch_buckets)
    tokens = padded_rows(min(opts.chunk_size, budget), opts.token_buckets)
    batch = _batch(rows, width)
    args = place((params, _ids(rows, tokens), cache, batch))
    prefill = prefill_step.lower(graphdef, *args, has_prefix=True, last_only=True)
    rows = padded_rows(plan.max_num_seqs, opts.batch_buckets)
    window = opts.num_draft_tokens + 1
    decode = decode_step.lower(
        graphdef, *place((params, _ids(rows, window), cache, _batch(rows, width)))
    )
    peaks = [_peak(step.compile().memory_analysis()) for step in (prefill, decode)]
    return None if None in peaks else max(peaks)


def _peak(stats) -> int | None:
    if stats is None:
        return None
    return stats.temp_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes


def _ids(rows: int, tokens: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((rows, tokens), jnp.int32)


def _batch(rows: int, width: int) -> Batch:
    i32 = jnp.int32
    return Batch(
        slots=jax.ShapeDtypeStruct((rows,), i32),
        block_table=jax.ShapeDtypeStruct((rows, width), i32),
        start=jax.ShapeDtypeStruct((rows,), i32),
        lengths=jax.ShapeDtypeStruct((rows,), i32),
    )


def _abstract_cache(model, layout: CacheLayout):
    """The runner's cache as shapes (with its shardings): nothing is allocated."""
    import kimi_linear_jax.cache as cache_lib

    shapes = jax.eval_shape(
        lambda: cache_lib.init_cache(
            model.config,
            num_slots=layout.num_slots,
            num_pages=layout.num_pages,
            page_size=layout.tokens_per_page,
            dtype=model.dtype,
        )
    )
    if not model.par.sharded:
        return shapes
    specs = rules.cache_specs(shapes, rules.ShardingRules.for_parallel(model.par))
    return jax.tree.map(
        lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
        shapes,
        rules.shardings(specs, model.par.mesh),
    )


def pool_line(layout: CacheLayout, plan: MemoryPlan | None) -> str:
    """The engine's start-up log line: the plan, or the fixed pools and why."""
    if plan is not None:
        return plan.summary()
    return (
        f"pools fixed: {layout.num_pages} pages = {layout.pool_tokens} tokens, "
        f"{layout.num_slots} state slots, max_num_seqs {layout.max_num_seqs} (num_pages given, "
        "or no device memory known: pass --device-memory, or device_memory= in Python, to plan)"
    )
