"""The sharding-rules table: logical axes (named by the layers and caches) -> mesh axes.

Layers tag each parameter with its logical axes (`nnx.Param(..., logical=("heads", None))`) and
never name a mesh axis; this table alone decides where each logical axis goes. Untagged
parameters (norms, routers, the MLA down-projection) are replicated.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import kimi_linear_jax.cache as cache_lib
from kimi_linear_jax.cache import KDAInputs, KDAState, MLACache, ModelCache
from kimi_linear_jax.parallel.mesh import DCP_AXIS, MODEL_AXIS, TP_AXES, Parallel

Axes = tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    vocab: Axes = TP_AXES  # embedding rows, lm_head rows
    heads: Axes = TP_AXES  # KDA heads; MLA output heads (W_UV, o_proj input)
    q_heads: Axes = TP_AXES  # MLA query heads (q_proj, W_UK: kv_b_proj holds both W_UK and W_UV)
    experts: Axes = TP_AXES  # routed experts (expert parallelism over the TP group)
    mlp: Axes = TP_AXES  # dense MLP / shared expert intermediate (column then row parallel)
    state_heads: Axes = TP_AXES  # KDA state S and conv windows in the state pool
    latent_tokens: Axes = (DCP_AXIS,)  # a virtual page's tokens of the MLA latent cache

    @classmethod
    def for_parallel(cls, par: Parallel) -> ShardingRules:
        # replicate_q_proj: every rank of a DCP group keeps its group's query heads whole.
        q = (MODEL_AXIS,) if par.replicate_q_proj and par.dcp > 1 else TP_AXES
        return cls(q_heads=q)

    def spec(self, logical: tuple[str | None, ...] | None, ndim: int) -> P:
        if logical is None:
            return P()
        if len(logical) != ndim:
            raise ValueError(f"logical axes {logical} do not match a rank-{ndim} array")
        return P(*(None if a is None else _one(getattr(self, a)) for a in logical))


def _one(axes: Axes):
    if axes is None:
        return None
    return axes[0] if len(axes) == 1 else tuple(axes)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def param_specs(state: nnx.State, rules: ShardingRules) -> nnx.State:
    """A State of PartitionSpecs shaped like `state` (a prefix for shard_map's in_specs)."""
    return jax.tree.map(
        lambda v: rules.spec(v.get_metadata().get("logical"), v.ndim), state, is_leaf=_is_var
    )


def var_spec(var: nnx.Variable, rules: ShardingRules) -> P:
    return rules.spec(var.get_metadata().get("logical"), len(var.shape))


KDA_STATE_AXES = KDAState(
    conv_q=(None, None, "state_heads"),
    conv_k=(None, None, "state_heads"),
    conv_v=(None, None, "state_heads"),
    S=(None, "state_heads", None, None),
)
MLA_CACHE_AXES = MLACache(latent=(None, "latent_tokens", None))


def cache_specs(cache: ModelCache, rules: ShardingRules) -> ModelCache:
    kda = tuple(
        KDAState(*(rules.spec(a, 4 if i == 3 else 3) for i, a in enumerate(KDA_STATE_AXES)))
        for _ in cache.kda
    )
    mla = tuple(MLACache(rules.spec(MLA_CACHE_AXES.latent, 3)) for _ in cache.mla)
    return ModelCache(kda, mla)


def per_step_specs(n_kda: int, rules: ShardingRules, keep: str = "states") -> tuple:
    """Specs of what a verify keeps per KDA layer (a step axis after the row axis): the
    per-step states (`KDAState`) or the per-step inputs (`KDAInputs`), sharded by heads."""
    h = _one(rules.state_heads)
    if keep == "inputs":
        pre, heads = P(None, None, h), P(None, None, h, None)
        one = KDAInputs(pre, pre, pre, heads, heads, heads, P(None, None, h))
    else:
        window = P(None, None, None, h)
        one = KDAState(window, window, window, P(None, None, h, None, None))
    return (one,) * n_kda


def window_rows_specs(n_mla: int) -> tuple:
    """Specs of a tree verify's window latent rows [B, T, L + R] per MLA layer: replicated
    over the whole TP group, as the window's x and the latent projection are."""
    return (P(),) * n_mla


def shardings(specs, mesh):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def shard_model(model, par: Parallel):
    """A copy of a built model for `par`'s mesh (the original is left as it is): every module
    that reads the plan gets it, every parameter moves to its shards. For tests and small
    models; large checkpoints load straight onto their shards with
    `checkpoint.load_pretrained(..., parallel=par)`."""
    graphdef, state = nnx.split(model)
    if par.sharded:
        specs = param_specs(state, ShardingRules.for_parallel(par))
        state = jax.device_put(state, shardings(specs, par.mesh))
    else:
        state = jax.tree.map(lambda x: x, state)
    # A new tree of Variables: the original model keeps its own (and its placement).
    model = nnx.merge(graphdef, state)
    for _, module in nnx.iter_modules(model):
        if hasattr(module, "par"):
            module.par = par
    return model


def init_cache(config, par: Parallel, *, num_slots: int, num_pages: int, page_size: int, dtype):
    """`cache.init_cache` created straight onto `par`'s shards (never whole on one device).
    `page_size` is the tokens of an allocator page (page_size per rank * dcp)."""

    def make():
        return cache_lib.init_cache(
            config, num_slots=num_slots, num_pages=num_pages, page_size=page_size, dtype=dtype
        )

    if not par.sharded:
        return make()
    specs = cache_specs(jax.eval_shape(make), ShardingRules.for_parallel(par))
    return jax.jit(make, out_shardings=shardings(specs, par.mesh))()


def layout_cache(model, layout) -> ModelCache:
    """`init_cache` for `model` (its config, plan and dtype) at a serving `CacheLayout`'s sizes:
    the target's and the draft's caches of one engine share the layout's slots and pages."""
    return init_cache(
        model.config,
        model.par,
        num_slots=layout.num_slots,
        num_pages=layout.num_pages,
        page_size=layout.tokens_per_page,
        dtype=model.dtype,
    )


def shard_elements(shape: tuple[int, ...], spec: P, axis_sizes: dict[str, int]) -> int:
    """Elements of one device's shard of an array of `shape` laid out by `spec`."""
    n = 1
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = () if axes is None else (axes,) if isinstance(axes, str) else axes
        n *= dim // math.prod(axis_sizes[a] for a in names)
    return n
