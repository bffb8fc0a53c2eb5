"""KimiLinearForCausalLM: embeddings, decoder blocks, final norm, lm head.

Entries:
- `model(input_ids)`: int32 [B, T] -> f32 logits [B, T, vocab]; no cache; differentiable.
- `model.prefill(ids, cache, batch)`: a chunk of new tokens per row (chunked KDA, naive MLA),
  caches in and out.
- `model.decode(ids, cache, batch)`: T >= 1 new tokens per row (KDA window, absorbed MLA over
  the paged cache); `model.verify` is the same pass with the KDA commit left to the caller.
For jitted serving steps use `prefill_step` / `decode_step` on `nnx.split(model)`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_linear_jax.cache import Batch, KDAState, ModelCache
from kimi_linear_jax.config import KimiLinearConfig
from kimi_linear_jax.layers.block import DecoderBlock
from kimi_linear_jax.layers.kda import commit
from kimi_linear_jax.layers.linear import Embed, Linear
from kimi_linear_jax.layers.norm import RMSNorm
from kimi_linear_jax.ops.mla import mla_paged_attention_reference


def auto_backend(q_lat, q_pe, cache, block_table, kv_lens, *, sm_scale):
    """Paged MLA attention: the Pallas kernel on a GPU when it takes the dims, else the XLA
    reference (a CPU engine must be fast; the kernel's interpret mode is for tests only)."""
    if jax.default_backend() == "gpu":
        from kernels.mla_decode import kernel_supports, mla_paged_attention

        if kernel_supports(q_lat.shape[-1], q_pe.shape[-1], cache.shape[1]):
            return mla_paged_attention(q_lat, q_pe, cache, block_table, kv_lens, sm_scale=sm_scale)
    return mla_paged_attention_reference(
        q_lat, q_pe, cache, block_table, kv_lens, sm_scale=sm_scale
    )


DEFAULT_BACKEND = auto_backend


class Backbone(nnx.Module):
    """The `model.*` part of the checkpoint."""

    def __init__(self, config: KimiLinearConfig, *, dtype, rngs: nnx.Rngs):
        self.embed_tokens = Embed(config.vocab_size, config.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List(
            [
                DecoderBlock(config, i, dtype=dtype, rngs=rngs)
                for i in range(config.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)


def _rows(state: KDAState, slots: jax.Array) -> KDAState:
    return KDAState(*(a[slots] for a in state))


def _scatter(state: KDAState, slots: jax.Array, rows: KDAState) -> KDAState:
    return KDAState(*(a.at[slots].set(r.astype(a.dtype)) for a, r in zip(state, rows)))


class KimiLinearForCausalLM(nnx.Module):
    def __init__(
        self, config: KimiLinearConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None
    ):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = config
        self.model = Backbone(config, dtype=dtype, rngs=rngs)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype=dtype, rngs=rngs)

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

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        x = self.model.embed_tokens(input_ids)
        for block in self.model.layers:
            x = block(x)
        return self._logits(x)

    def prefill(
        self,
        input_ids: jax.Array,
        cache: ModelCache,
        batch: Batch,
        *,
        has_prefix: bool = False,
        backend=DEFAULT_BACKEND,
        last_only: bool = False,
        mesh=None,
    ) -> tuple[jax.Array, ModelCache]:
        """Run a right-padded chunk [B, T] (row b has batch.lengths[b] tokens after
        batch.start[b] cached ones). `has_prefix` (static) attends to cached tokens too; leave
        it False when every row starts at 0. `last_only` returns logits of each row's last
        valid token only: [B, vocab]. `mesh` (static): a mesh with a 'dcp' axis whose MLA
        caches are sharded over it (decode context parallelism); None for one device."""
        x = self.model.embed_tokens(input_ids)
        kda, mla = list(cache.kda), list(cache.mla)
        ik = im = 0
        for block in self.model.layers:
            h = block.input_layernorm(x)
            if block.kind == "kda":
                y, new = block.self_attn.prefill(h, _rows(kda[ik], batch.slots), batch.lengths)
                kda[ik] = _scatter(kda[ik], batch.slots, new)
                ik += 1
            else:
                y, mla[im] = block.self_attn.prefill(
                    h, mla[im], batch, has_prefix=has_prefix, backend=backend, mesh=mesh
                )
                im += 1
            x = block.ffn(x + y)
        if last_only:
            idx = jnp.maximum(batch.lengths - 1, 0)
            x = jnp.take_along_axis(x, idx[:, None, None], axis=1)[:, 0]
        return self._logits(x), ModelCache(tuple(kda), tuple(mla))

    def verify(
        self,
        input_ids: jax.Array,
        cache: ModelCache,
        batch: Batch,
        *,
        backend=DEFAULT_BACKEND,
        mesh=None,
    ) -> tuple[jax.Array, ModelCache, tuple[KDAState, ...]]:
        """Window pass over [B, T] new tokens. MLA rows are written; KDA states are NOT
        committed: returns the per-step states of every KDA layer (`KDAState` arrays with a
        step axis) for `commit_kda` to pick from once the accepted length is known."""
        x = self.model.embed_tokens(input_ids)
        mla = list(cache.mla)
        per_step = []
        ik = im = 0
        for block in self.model.layers:
            h = block.input_layernorm(x)
            if block.kind == "kda":
                y, steps = block.self_attn.decode(
                    h, _rows(cache.kda[ik], batch.slots), batch.lengths
                )
                per_step.append(steps)
                ik += 1
            else:
                y, mla[im] = block.self_attn.decode(h, mla[im], batch, backend=backend, mesh=mesh)
                im += 1
            x = block.ffn(x + y)
        return self._logits(x), ModelCache(cache.kda, tuple(mla)), tuple(per_step)

    def decode(
        self,
        input_ids: jax.Array,
        cache: ModelCache,
        batch: Batch,
        *,
        backend=DEFAULT_BACKEND,
        mesh=None,
    ) -> tuple[jax.Array, ModelCache]:
        """verify + commit of every row's `batch.lengths` tokens. logits [B, T, vocab]."""
        logits, cache, per_step = self.verify(input_ids, cache, batch, backend=backend, mesh=mesh)
        return logits, commit_kda(cache, per_step, batch.slots, batch.lengths)


def commit_kda(
    cache: ModelCache, per_step: tuple[KDAState, ...], slots: jax.Array, n: jax.Array
) -> ModelCache:
    """Store in each row's slot the KDA state and conv windows after step n[b] - 1 of the
    window, for every KDA layer (n = 0 leaves the slot unchanged)."""
    kda = []
    for state, steps in zip(cache.kda, per_step):
        rows = _rows(state, slots)
        kda.append(_scatter(state, slots, commit(rows, steps, n)))
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


def init_model(config: KimiLinearConfig, *, seed: int = 0, dtype=jnp.float32):
    """A randomly initialised model (seeded, reproducible)."""
    return KimiLinearForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(seed))


# ---- jitted steps over nnx.split(model) ------------------------------------------------------


class HashedGraph:
    """A graphdef whose hash is computed once. jit hashes its static arguments on every call,
    and hashing a model's graphdef costs milliseconds (1.5 ms for `small` on a CPU), which a
    serving loop pays per step. The steps below accept it or a bare graphdef."""

    def __init__(self, graphdef) -> None:
        self.graphdef = graphdef
        self._hash = hash(graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, HashedGraph) and (
            self is other or (self._hash == other._hash and self.graphdef == other.graphdef)
        )


def merge(graphdef, params):
    """nnx.merge that also takes a HashedGraph."""
    return nnx.merge(getattr(graphdef, "graphdef", graphdef), params)


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "has_prefix", "last_only", "mesh"),
    donate_argnames=("cache",),
)
def prefill_step(
    graphdef, params, input_ids, cache, batch, has_prefix=False, last_only=True, mesh=None
):
    model = merge(graphdef, params)
    return model.prefill(
        input_ids, cache, batch, has_prefix=has_prefix, last_only=last_only, mesh=mesh
    )


@functools.partial(jax.jit, static_argnames=("graphdef", "mesh"), donate_argnames=("cache",))
def decode_step(graphdef, params, input_ids, cache, batch, mesh=None):
    model = merge(graphdef, params)
    return model.decode(input_ids, cache, batch, mesh=mesh)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def forward(graphdef, params, input_ids):
    return merge(graphdef, params)(input_ids)
