"""KimiLinearForCausalLM: embeddings, decoder blocks, final norm, lm head.

Entries:
- `model(input_ids)`: int32 [B, T] -> f32 logits [B, T, vocab]; no cache; differentiable.
- `model.prefill(ids, cache, batch)`: a chunk of new tokens per row (chunked KDA, naive MLA),
  caches in and out.
Built for a mesh (`par=`, `parallel.rules.shard_model`), each entry is one shard_map over it.
- `model.decode(ids, cache, batch)`: T >= 1 new tokens per row (KDA window, absorbed MLA over
  the paged cache); `model.verify` is the same pass with the KDA commit left to the caller.
- `model.verify_tree(ids, parents, cache, batch)`: a draft-tree window (speculative decoding
  with a tree), nothing written; `model.write_latents` stores the accepted path's MLA rows.
For jitted serving steps use `prefill_step` / `decode_step` on `nnx.split(model)`.
"""

from __future__ import annotations

import functools
import weakref

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from kimi_linear_jax.cache import Batch, KDAInputs, KDAState, ModelCache
from kimi_linear_jax.config import KimiLinearConfig
from kimi_linear_jax.layers.block import DecoderBlock, scatter_rows, state_rows
from kimi_linear_jax.layers.kda import advance
from kimi_linear_jax.layers.linear import Embed, Linear
from kimi_linear_jax.layers.mla import Absorbed
from kimi_linear_jax.layers.norm import RMSNorm
from kimi_linear_jax.parallel import rules as sharding_rules
from kimi_linear_jax.parallel.mesh import SINGLE, Parallel, shard_map


class Backbone(nnx.Module):
    """The `model.*` part of the checkpoint."""

    def __init__(self, config: KimiLinearConfig, *, dtype, rngs: nnx.Rngs, par: Parallel):
        self.embed_tokens = Embed(
            config.vocab_size, config.hidden_size, dtype=dtype, rngs=rngs, par=par
        )
        self.layers = nnx.List(
            [
                DecoderBlock(config, i, dtype=dtype, rngs=rngs, par=par)
                for i in range(config.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)


class KimiLinearForCausalLM(nnx.Module):
    """`par` (static): the parallel plan the model is built for (`parallel.mesh.make_parallel`;
    default one device). Built for a mesh, every entry runs as one shard_map over it: parameters
    and caches enter as the rank's shards, logits leave vocab-sharded."""

    def __init__(
        self,
        config: KimiLinearConfig,
        *,
        dtype=jnp.float32,
        rngs: nnx.Rngs | None = None,
        par: Parallel = SINGLE,
    ):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = config
        self.par = par
        self.model = Backbone(config, dtype=dtype, rngs=rngs, par=par)
        lm_axes = ("vocab", None)
        self.lm_head = Linear(
            config.hidden_size, config.vocab_size, dtype=dtype, rngs=rngs, axes=lm_axes
        )

    @property
    def dtype(self):
        return self.model.embed_tokens.weight.dtype

    @property
    def has_recurrent_state(self) -> bool:
        """Declared capability: the model has recurrent (KDA) layers, so a speculative verify
        must commit their state at the accepted length. Serving decides this once."""
        return any(block.kind == "kda" for block in self.model.layers)

    def _logits(self, x: jax.Array) -> jax.Array:
        logits = self.lm_head(self.model.norm(x))
        return logits.astype(jnp.promote_types(logits.dtype, jnp.float32))  # f64 stays f64

    # ---- the one layer loop ------------------------------------------------------------------
    def _layers(self, x, cache: ModelCache, run):
        """x through every block; `run(block, x, layer_cache) -> (x, layer_cache, steps)`."""
        caches = {"kda": iter(cache.kda), "mla": iter(cache.mla)}
        out = {"kda": [], "mla": []}
        per_step = []
        for block in self.model.layers:
            x, layer_cache, steps = run(block, x, next(caches[block.kind]))
            out[block.kind].append(layer_cache)
            if steps is not None:
                per_step.append(steps)
        return x, ModelCache(tuple(out["kda"]), tuple(out["mla"])), tuple(per_step)

    # ---- rank-local entries (the whole model on one device) ----------------------------------
    def _forward(self, input_ids):
        x = self.model.embed_tokens(input_ids)
        for block in self.model.layers:
            x = block(x)
        return self._logits(x)

    def _prefill(self, input_ids, cache, batch, has_prefix, last_only):
        def run(block, x, c):
            return (*block.prefill(x, c, batch, has_prefix=has_prefix), None)

        x, cache, _ = self._layers(self.model.embed_tokens(input_ids), cache, run)
        if last_only:
            idx = jnp.maximum(batch.lengths - 1, 0)
            x = jnp.take_along_axis(x, idx[:, None, None], axis=1)[:, 0]
        return self._logits(x), cache

    def _verify(self, input_ids, cache, batch, keep):
        def run(block, x, c):
            return block.verify(x, c, batch, keep)

        x, cache, per_step = self._layers(self.model.embed_tokens(input_ids), cache, run)
        return self._logits(x), cache, per_step

    def _verify_tree(self, input_ids, parents, cache, batch):
        def run(block, x, c):
            x, kept = block.verify_tree(x, c, batch, parents)
            return x, c, kept

        x, cache, kept = self._layers(self.model.embed_tokens(input_ids), cache, run)
        kinds = [block.kind for block in self.model.layers]
        per_step = tuple(k for k, kind in zip(kept, kinds) if kind == "kda")
        rows = tuple(k for k, kind in zip(kept, kinds) if kind == "mla")
        return self._logits(x), cache, per_step, rows

    def _write_latents(self, cache, rows, batch):
        mla = [block.self_attn for block in self.model.layers if block.kind == "mla"]
        latents = tuple(m.write(c, r, batch) for m, c, r in zip(mla, cache.mla, rows))
        return ModelCache(cache.kda, latents)

    # ---- entries ------------------------------------------------------------------------------
    def _sharded(self, fn, args, arg_specs, out_specs):
        """fn(model, *args) on one device, or as one shard_map over the plan's mesh."""
        if not self.par.sharded:
            return fn(self, *args)
        graphdef, state = nnx.split(self)

        def local(state, *args):
            return fn(nnx.merge(graphdef, state), *args)

        in_specs = (sharding_rules.param_specs(state, self._rules), *arg_specs)
        return shard_map(local, self.par.mesh, in_specs, out_specs)(state, *args)

    @property
    def _rules(self):
        return sharding_rules.ShardingRules.for_parallel(self.par)

    def _logits_spec(self, ndim: int) -> P:
        """Logits leave the shard_map vocab-sharded, as lm_head computes them."""
        return self._rules.spec((None,) * (ndim - 1) + ("vocab",), ndim)

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        """int32 [B, T] -> f32 logits [B, T, vocab]; no cache; differentiable."""
        fn = KimiLinearForCausalLM._forward
        return self._sharded(fn, (input_ids,), (P(),), self._logits_spec(3))

    def prefill(
        self,
        input_ids: jax.Array,
        cache: ModelCache,
        batch: Batch,
        *,
        has_prefix: bool = False,
        last_only: bool = False,
    ) -> tuple[jax.Array, ModelCache]:
        """Run a right-padded chunk [B, T] (row b has batch.lengths[b] tokens after
        batch.start[b] cached ones). `has_prefix` (static) attends to cached tokens too; leave
        it False when every row starts at 0. `last_only` returns logits of each row's last
        valid token only: [B, vocab]."""
        fn = functools.partial(
            KimiLinearForCausalLM._prefill, has_prefix=has_prefix, last_only=last_only
        )
        cs = sharding_rules.cache_specs(cache, self._rules)
        logits = self._logits_spec(2 if last_only else 3)
        return self._sharded(fn, (input_ids, cache, batch), (P(), cs, P()), (logits, cs))

    def verify(
        self, input_ids: jax.Array, cache: ModelCache, batch: Batch, *, keep: str = "states"
    ) -> tuple[jax.Array, ModelCache, tuple[KDAState | KDAInputs, ...]]:
        """Window pass over [B, T] new tokens. MLA rows are written; KDA states are NOT
        committed: returns, per KDA layer, what `commit_kda` needs once the accepted length is
        known: the per-step states (keep="states", `KDAState` arrays with a step axis; the
        gather commit) or the per-step inputs (keep="inputs", `KDAInputs`; the replay
        commit, T times less memory)."""
        fn = functools.partial(KimiLinearForCausalLM._verify, keep=keep)
        cs = sharding_rules.cache_specs(cache, self._rules)
        steps = sharding_rules.per_step_specs(len(cache.kda), self._rules, keep)
        out = (self._logits_spec(3), cs, steps)
        return self._sharded(fn, (input_ids, cache, batch), (P(), cs, P()), out)

    def verify_tree(
        self, input_ids: jax.Array, parents: jax.Array, cache: ModelCache, batch: Batch
    ) -> tuple[jax.Array, ModelCache, tuple[KDAState, ...], tuple[jax.Array, ...]]:
        """A draft-tree window (`ops.tree`): ids [B, T] with ids[:, 0] the root (the row's
        last committed token), parents [B, T] (parents[:, 0] = -1, parents[b, i] < i);
        node i's sequence is the cache then its root-to-node path, at position
        start + depth. batch.lengths counts each row's valid nodes. Nothing is written:
        returns (logits [B, T, vocab], cache as it came, per KDA layer the per-node states
        laid out as verify's keep="states" output, so `commit_kda(cache, per_step, slots,
        node + 1)` commits a node, per MLA layer the window's latent rows [B, T, L + R]: the
        accepted path's rows go in by `write_latents`)."""
        cs = sharding_rules.cache_specs(cache, self._rules)
        steps = sharding_rules.per_step_specs(len(cache.kda), self._rules)
        rows = sharding_rules.window_rows_specs(len(cache.mla))
        out = (self._logits_spec(3), cs, steps, rows)
        args = (input_ids, parents, cache, batch)
        return self._sharded(KimiLinearForCausalLM._verify_tree, args, (P(), P(), cs, P()), out)

    def write_latents(
        self, cache: ModelCache, rows: tuple[jax.Array, ...], batch: Batch
    ) -> ModelCache:
        """Store each MLA layer's rows[b, :batch.lengths[b]] ([B, T, L + R]) at positions
        batch.start[b] + t of the row's pages (under DCP each rank its own tokens): the MLA
        commit of an accepted tree path."""
        cs = sharding_rules.cache_specs(cache, self._rules)
        rs = sharding_rules.window_rows_specs(len(cache.mla))
        fn = KimiLinearForCausalLM._write_latents
        return self._sharded(fn, (cache, rows, batch), (cs, rs, P()), cs)

    def decode(
        self, input_ids: jax.Array, cache: ModelCache, batch: Batch
    ) -> tuple[jax.Array, ModelCache]:
        """verify + commit of every row's `batch.lengths` tokens. logits [B, T, vocab]. (The
        gather commit: a decode step keeps only T = 1 state, so a replay would save nothing.)"""
        logits, cache, per_step = self.verify(input_ids, cache, batch)
        return logits, commit_kda(cache, per_step, batch.slots, batch.lengths, after=logits)


def commit_kda(
    cache: ModelCache,
    per_step: tuple[KDAState | KDAInputs, ...],
    slots: jax.Array,
    n: jax.Array,
    after: jax.Array | None = None,
) -> ModelCache:
    """Store in each row's slot the KDA state and conv windows after step n[b] - 1 of the
    window, for every KDA layer (n = 0 leaves the slot unchanged), by a gather from the
    per-step states or a replay of the per-step inputs (`layers.kda.advance`). Works on
    sharded states as they are: it indexes the slot axis only. `after`: what the writes must
    follow (the logits; see `scatter_rows`)."""
    kda = []
    for state, steps in zip(cache.kda, per_step):
        rows = state_rows(state, slots)
        kda.append(scatter_rows(state, slots, advance(rows, steps, n), after))
    return ModelCache(tuple(kda), cache.mla)


def set_kda_impl(model: KimiLinearForCausalLM, impl: str) -> KimiLinearForCausalLM:
    """Choose the KDA prefill recurrence of every KDA layer: 'auto' (chunked on accelerators,
    recurrent on CPU), 'chunked' or 'recurrent'. Split the model after calling this."""
    from kimi_linear_jax.ops.kda import KDA_IMPLS

    if impl not in KDA_IMPLS:
        raise ValueError(f"kda impl must be one of {KDA_IMPLS}, got {impl!r}")
    for block in model.model.layers:
        if block.kind == "kda":
            block.self_attn.prefill_impl = impl
    return model


def for_serving(model: KimiLinearForCausalLM) -> KimiLinearForCausalLM:
    """A copy of `model` for the jitted serving steps: the same parameter arrays (no copy),
    plus W_UK and W_UV split out of each MLA layer's kv_b_proj (`MLA.split_kv_b`), placed on
    the model's mesh by kv_b_proj's rules. `model` is left as it is: the extra arrays are
    not parameters, so `nnx.split(model, nnx.Param)` (training, Orbax restore) would refuse
    the copy; checkpoints save from either."""
    graphdef, state = nnx.split(model)
    # A new tree of Variables over the same arrays: the original keeps its own.
    serving = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
    for block in serving.model.layers:
        if block.kind == "mla":
            block.self_attn.split_kv_b()
    if serving.par.sharded:
        split = nnx.state(serving, Absorbed)
        specs = sharding_rules.param_specs(split, serving._rules)
        nnx.update(
            serving, jax.device_put(split, sharding_rules.shardings(specs, serving.par.mesh))
        )
    return serving


def init_model(
    config: KimiLinearConfig, *, seed: int = 0, dtype=jnp.float32, par: Parallel = SINGLE
):
    """A randomly initialised model (seeded, reproducible), placed on `par`'s mesh."""
    model = KimiLinearForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(seed))
    return model if par == model.par else sharding_rules.shard_model(model, par)


# ---- jitted steps over nnx.split(model) ------------------------------------------------------


class HashedGraph:
    """A graphdef whose hash is computed once. jit hashes its static arguments on every call,
    and hashing a model's graphdef costs milliseconds (1.5 ms for `small` on a CPU), which a
    serving loop pays per step. The steps below accept it or a bare graphdef.

    Equal graphdefs share one HashedGraph (interned on construction). jit finds its cache
    entry by hash, then compares keys by identity and else with ==, and == on graphdefs walks
    the whole graph: two engines over one model (a baseline and a speculative engine in one
    benchmark) paid 1.6 ms per step for it, on a 17 ms step.

    `treedef` (optional): the structure of the model's state, so that the steps can take the
    state as a flat list of arrays (`split_flat`)."""

    _interned: dict[int, list[weakref.ref]] = {}

    def __new__(cls, graphdef, treedef=None):
        key = hash(graphdef)
        alive = [ref for ref in cls._interned.get(key, []) if ref() is not None]
        for ref in alive:
            if _same_tree(ref().treedef, treedef) and ref().graphdef == graphdef:
                return ref()
        self = super().__new__(cls)
        self.graphdef, self.treedef, self._hash = graphdef, treedef, key
        cls._interned[key] = [*alive, weakref.ref(self)]
        return self

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, HashedGraph) and (
            self is other
            or (
                self._hash == other._hash
                and _same_tree(self.treedef, other.treedef)
                and self.graphdef == other.graphdef
            )
        )


def _same_tree(a, b) -> bool:
    """Equal treedefs, or both None (a PyTreeDef does not compare with None)."""
    return a is b or (a is not None and b is not None and a == b)


def split_flat(model) -> tuple[HashedGraph, list[jax.Array]]:
    """(graph, state as a flat list of arrays): what the serving steps take. jit flattens a
    list of arrays in C++, but an nnx State one Variable at a time in Python: 180 us per call
    for the built-in model's 88 arrays against 30 us for the list, paid on every step."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    return HashedGraph(graphdef, treedef), leaves


def merge(graphdef, params):
    """nnx.merge that also takes a HashedGraph, and with it `split_flat`'s list of arrays."""
    if isinstance(params, list):
        params = jax.tree.unflatten(graphdef.treedef, params)
    return nnx.merge(getattr(graphdef, "graphdef", graphdef), params)


@functools.partial(
    jax.jit, static_argnames=("graphdef", "has_prefix", "last_only"), donate_argnames=("cache",)
)
def prefill_step(graphdef, params, input_ids, cache, batch, has_prefix=False, last_only=True):
    model = merge(graphdef, params)
    return model.prefill(input_ids, cache, batch, has_prefix=has_prefix, last_only=last_only)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def decode_step(graphdef, params, input_ids, cache, batch):
    return merge(graphdef, params).decode(input_ids, cache, batch)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def forward(graphdef, params, input_ids):
    return merge(graphdef, params)(input_ids)
