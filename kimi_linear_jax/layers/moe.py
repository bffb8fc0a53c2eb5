"""Mixture of experts: sigmoid router with a selection-only correction bias, grouped top-k,
renormalised and scaled weights, routed experts plus shared experts.

Experts are stacked `[E, out, in]` so the routed product is one grouped matmul
(`jax.lax.ragged_dot` over tokens sorted by expert); `dispatch="dense"` is the reference that
runs every expert on every token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_linear_jax.config import KimiLinearConfig
from kimi_linear_jax.layers.linear import acc_dtype, init_normal
from kimi_linear_jax.layers.mlp import MLP


class Router(nnx.Module):
    """`gate.weight [E, D]` and `gate.e_score_correction_bias [E]` (fp32)."""

    def __init__(self, config: KimiLinearConfig, *, dtype, rngs: nnx.Rngs):
        self.config = config
        E = config.num_experts
        self.weight = nnx.Param(init_normal(rngs, (E, config.hidden_size), dtype))
        self.e_score_correction_bias = nnx.Param(jnp.zeros((E,), jnp.float32))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [N, D] -> (weights [N, k] f32, expert ids [N, k] int32)."""
        cfg = self.config
        acc = acc_dtype(x)
        logits = x.astype(acc) @ self.weight[...].astype(acc).T
        scores = jax.nn.sigmoid(logits)
        choice = scores + self.e_score_correction_bias[...].astype(acc)
        if cfg.use_grouped_topk and cfg.num_expert_group > 1:
            choice = _mask_groups(choice, cfg.num_expert_group, cfg.topk_group)
        _, idx = jax.lax.top_k(choice, cfg.num_experts_per_token)
        source = choice if cfg.moe_weights_include_bias else scores
        w = jnp.take_along_axis(source, idx, axis=-1)
        if cfg.moe_renormalize:
            w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
        return w * cfg.routed_scaling_factor, idx.astype(jnp.int32)


def _mask_groups(choice: jax.Array, n_group: int, topk_group: int) -> jax.Array:
    """Keep the `topk_group` groups with the largest sum of their top-2 scores; -inf the rest."""
    N, E = choice.shape
    grouped = choice.reshape(N, n_group, E // n_group)
    top2 = jax.lax.top_k(grouped, min(2, E // n_group))[0].sum(-1)  # [N, n_group]
    _, keep = jax.lax.top_k(top2, topk_group)
    group_mask = jnp.zeros((N, n_group), bool).at[jnp.arange(N)[:, None], keep].set(True)
    mask = jnp.repeat(group_mask, E // n_group, axis=1)
    return jnp.where(mask, choice, -jnp.inf)


class Experts(nnx.Module):
    """Stacked expert weights: w1 (gate) [E, I, D], w3 (up) [E, I, D], w2 (down) [E, D, I]."""

    def __init__(self, config: KimiLinearConfig, *, dtype, rngs: nnx.Rngs):
        E, D, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.w1 = nnx.Param(init_normal(rngs, (E, I, D), dtype))
        self.w3 = nnx.Param(init_normal(rngs, (E, I, D), dtype))
        self.w2 = nnx.Param(init_normal(rngs, (E, D, I), dtype))

    def grouped(self, x: jax.Array, w: jax.Array, idx: jax.Array) -> jax.Array:
        """sum_j w[n, j] * expert_{idx[n, j]}(x[n]) with one ragged matmul per weight."""
        N, k = idx.shape
        E = self.w1.shape[0]
        flat = idx.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        xs = x[order // k]  # [N*k, D], rows grouped by expert
        sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
        w1, w3, w2 = self.w1[...], self.w3[...], self.w2[...]
        gate = jax.lax.ragged_dot(xs, jnp.swapaxes(w1, 1, 2), sizes)
        up = jax.lax.ragged_dot(xs, jnp.swapaxes(w3, 1, 2), sizes)
        h = (jax.nn.silu(gate) * up).astype(x.dtype)
        y = jax.lax.ragged_dot(h, jnp.swapaxes(w2, 1, 2), sizes)  # [N*k, D]
        y = y.astype(w.dtype) * w.reshape(-1)[order][:, None]
        return jnp.zeros((N, x.shape[-1]), w.dtype).at[order // k].add(y)

    def dense(self, x: jax.Array, w: jax.Array, idx: jax.Array) -> jax.Array:
        """Reference: every expert on every token, weighted by a dense [N, E] matrix."""
        E = self.w1.shape[0]
        dense_w = (
            jnp.zeros((x.shape[0], E), w.dtype).at[jnp.arange(x.shape[0])[:, None], idx].add(w)
        )
        gate = jnp.einsum("nd,eid->nei", x, self.w1[...])
        up = jnp.einsum("nd,eid->nei", x, self.w3[...])
        h = (jax.nn.silu(gate) * up).astype(x.dtype)
        y = jnp.einsum("nei,edi->ned", h, self.w2[...]).astype(w.dtype)
        return jnp.einsum("ned,ne->nd", y, dense_w)


class MoE(nnx.Module):
    def __init__(
        self, config: KimiLinearConfig, *, dtype, rngs: nnx.Rngs, dispatch: str = "grouped"
    ):
        self.dispatch = dispatch
        self.gate = Router(config, dtype=dtype, rngs=rngs)
        self.experts = Experts(config, dtype=dtype, rngs=rngs)
        if config.num_shared_experts > 0:
            inter = config.moe_intermediate_size * config.num_shared_experts
            self.shared_experts = MLP(config.hidden_size, inter, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        w, idx = self.gate(flat)
        run = self.experts.dense if self.dispatch == "dense" else self.experts.grouped
        y = run(flat, w, idx).astype(x.dtype).reshape(shape)
        if hasattr(self, "shared_experts"):
            y = y + self.shared_experts(x)
        return y
