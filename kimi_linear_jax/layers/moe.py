"""Mixture of experts: sigmoid router with a selection-only correction bias, grouped top-k,
renormalised and scaled weights, routed experts plus shared experts.

Experts are stacked `[E, out, in]` and every path contracts them in that stored layout (no
per-step transpose). The routed product has three forms, picked statically at trace time
(`dispatch="auto"`, see `pick_dispatch`):

- "ragged": one grouped matmul (`jax.lax.ragged_dot_general`) over tokens sorted by expert, the
  fast path on GPU / TPU, which lower it to a grouped-GEMM kernel;
- "tiled": a loop over fixed-size tiles of the expert-sorted rows, one expert per tile, that
  skips the tiles no row fills, so that only the experts a step actually routes to are read
  (the CPU path, where `ragged_dot` is a dense masked product over every expert);
- "dense": the reference that runs every expert on every token.

Under TP the experts are distributed over the TP group (expert parallelism, "experts" axis):
the router runs on every rank over the replicated tokens, each rank computes its E / tp local
experts for the (token, expert) pairs routed to them, and the decoder block's one all-reduce
sums the ranks. A pair routed elsewhere gets the out-of-range id E / tp, which every path
drops, so a rank reads only its experts that are in use.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_linear_jax.config import KimiLinearConfig
from kimi_linear_jax.layers.linear import acc_dtype, init_normal, param
from kimi_linear_jax.layers.mlp import MLP
from kimi_linear_jax.parallel.mesh import SINGLE, Parallel


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


# Rows per tile of the "tiled" path beyond decode sizes, at most. A tile reads one expert's
# three matrices; at prefill sizes the padding of each expert's group to whole tiles stays
# small next to the N * E rows of the dense form (measured on CPU, `small` shapes: 64..256 all
# alike, 512 worse).
TILE_ROWS = 128

# Tiles of one (token, expert) pair while the experts get at most this many pairs each on
# average (decode steps, small verify windows). XLA:CPU runs a one-row product as a fused
# matrix-vector loop near the memory bandwidth, but a product of 8 to 32 rows at 3-6 GB/s; the
# pairs are sorted by expert, so an expert's later pairs find its weights in cache. On `small`
# (E = 8, k = 2) one-pair tiles took the routed product at 8 and 32 tokens to about half the
# time, and lost from 160 tokens on (python -m benchmarks kernel --only moe).
PAIR_TILES_UP_TO = 8


def tile_rows(n_tokens: int, k: int, n_experts: int) -> int:
    """Rows per tile of the "tiled" path for N tokens routed to k of E experts each."""
    if n_tokens * k <= PAIR_TILES_UP_TO * n_experts:
        return 1
    return min(n_tokens, TILE_ROWS)


DISPATCHES = ("auto", "ragged", "tiled", "dense")


def max_tiles(n_pairs: int, rows: int, n_experts: int) -> int:
    """The most tiles of `rows` rows that n_pairs pairs over n_experts experts can fill, each
    expert's group padded to whole tiles: sum_e ceil(s_e / rows) <= (n_pairs + m (rows - 1)) /
    rows for m <= min(E, n_pairs) experts in use, reached when each holds 1 mod rows pairs.

    It bounds the tiled loop. Every iteration past the tiles in use still costs a skipped
    `cond` (a few us on a CPU); with one-pair tiles the old bound ceil(n_pairs / rows) + E ran
    16 such iterations per layer in a one-token decode step of `pycode`."""
    used = min(n_experts, n_pairs)
    return (n_pairs + used * (rows - 1)) // rows


def pick_dispatch(backend: str | None = None) -> str:
    """The routed-expert path for `dispatch="auto"`: static, from the backend alone.

    On GPU / TPU `ragged_dot` lowers to a grouped-GEMM kernel that reads each used expert once.
    Elsewhere (CPU) JAX lowers it to its generic form, which masks the rows into [E, N * k, D]
    and multiplies every expert (8-9 ms per matrix for the `small` preset even for one token,
    slower than the dense einsum). There the tiled loop, which reads only the routed experts,
    won at every N measured (1 to 2048 tokens), so N only sets its tile size (`TILE_ROWS`).
    """
    return "tiled" if (backend or jax.default_backend()) == "cpu" else "ragged"


def _sort_by_expert(idx: jax.Array, E: int):
    """Rows of the flattened (token, slot) pairs grouped by expert (stable).

    Returns (order [N*k] pair index per sorted row, sizes [E] int32 rows per expert)."""
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    return order, sizes


# ragged_dot_general in the stored [E, out, in] layout: lhs [M, in] ragged along M, rhs grouped
# along 0, contracting lhs 1 with rhs 2 (no swapaxes of the expert stack per step).
_RAGGED_DNUMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)


def _expert_ffn(x: jax.Array, e: jax.Array, weights: tuple[jax.Array, ...]) -> jax.Array:
    """Expert e's SwiGLU on rows x [T, D]; weights (w1, w3, w2) stacked [E, out, in].

    Written as products with transposed weights, not einsums: with one row, XLA:CPU fuses each
    matrix-vector product and the expert's dynamic slice into one loop that reads the stacked
    weights in place. The einsum form copied the expert's three matrices out first and ran the
    one-row MoE 1.6-2x slower (python -m benchmarks kernel --only moe)."""
    w1, w3, w2 = (jax.lax.dynamic_index_in_dim(m, e, keepdims=False) for m in weights)
    h = (jax.nn.silu(x @ w1.T) * (x @ w3.T)).astype(x.dtype)
    return h @ w2.T


class Experts(nnx.Module):
    """Stacked expert weights: w1 (gate) [E, I, D], w3 (up) [E, I, D], w2 (down) [E, D, I]."""

    def __init__(self, config: KimiLinearConfig, *, dtype, rngs: nnx.Rngs):
        E, D, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
        axes = ("experts", None, None)
        self.w1 = param(init_normal(rngs, (E, I, D), dtype), axes)
        self.w3 = param(init_normal(rngs, (E, I, D), dtype), axes)
        self.w2 = param(init_normal(rngs, (E, D, I), dtype), axes)

    def __call__(self, x: jax.Array, w: jax.Array, idx: jax.Array, dispatch: str = "auto"):
        """sum_j w[n, j] * expert_{idx[n, j]}(x[n]): x [N, D], w [N, k], idx [N, k] -> [N, D].
        Pairs with idx outside [0, E) (E: the experts held here) contribute nothing."""
        if dispatch not in DISPATCHES:
            raise ValueError(f"unknown MoE dispatch {dispatch!r}; choose one of {DISPATCHES}")
        if dispatch == "auto":
            dispatch = pick_dispatch()
        return getattr(self, dispatch)(x, w, idx)

    def ragged(self, x: jax.Array, w: jax.Array, idx: jax.Array) -> jax.Array:
        """One ragged matmul per weight over the rows sorted by expert."""
        N, k = idx.shape
        order, sizes = _sort_by_expert(idx, self.w1.shape[0])
        xs = x[order // k]  # [N*k, D], rows grouped by expert

        def mm(lhs, rhs):
            return jax.lax.ragged_dot_general(lhs, rhs, sizes, _RAGGED_DNUMS)

        gate = mm(xs, self.w1[...])
        up = mm(xs, self.w3[...])
        h = (jax.nn.silu(gate) * up).astype(x.dtype)
        y = mm(h, self.w2[...])  # [N*k, D]; rows past sum(sizes) (other ranks' pairs) unset
        placed = (jnp.arange(N * k) < jnp.sum(sizes))[:, None]
        y = jnp.where(placed, y.astype(w.dtype) * w.reshape(-1)[order][:, None], 0)
        return jnp.zeros((N, x.shape[-1]), w.dtype).at[order // k].add(y)

    def tiled(self, x: jax.Array, w: jax.Array, idx: jax.Array) -> jax.Array:
        """Tiles of T expert-sorted rows, one expert per tile (`tile_rows`: one pair at decode
        sizes, else min(N, TILE_ROWS)).

        Each expert's group of rows is padded to whole tiles; tile t belongs to the expert whose
        cumulative tile count first exceeds t. The loop has the static bound `max_tiles`
        (scan, so reverse-differentiable) and skips (`cond`) the tiles past the last one in
        use, so an expert no row is routed to is never read. Padding rows get weight 0.
        """
        N, k = idx.shape
        E, D = self.w1.shape[0], x.shape[-1]
        T = tile_rows(N, k, E)
        order, sizes = _sort_by_expert(idx, E)
        ends = jnp.cumsum(sizes)
        starts = ends - sizes
        tiles = (sizes + T - 1) // T
        tile_ends = jnp.cumsum(tiles)
        # T rows of padding at the end: a tile's slice may run past the last row.
        rows = jnp.concatenate([order // k, jnp.zeros((T,), order.dtype)])
        xs = jnp.concatenate([x[order // k], jnp.zeros((T, D), x.dtype)])
        ws = jnp.concatenate([w.reshape(-1)[order], jnp.zeros((T,), w.dtype)])
        w1, w3, w2 = self.w1[...], self.w3[...], self.w2[...]

        def tile(t, y):
            e = jnp.searchsorted(tile_ends, t, side="right")
            row0 = starts[e] + (t - (tile_ends[e] - tiles[e])) * T
            xt = jax.lax.dynamic_slice_in_dim(xs, row0, T)
            out = _expert_ffn(xt, e, (w1, w3, w2)).astype(w.dtype)
            valid = row0 + jnp.arange(T) < ends[e]
            scale = jnp.where(valid, jax.lax.dynamic_slice_in_dim(ws, row0, T), 0)
            return y.at[jax.lax.dynamic_slice_in_dim(rows, row0, T)].add(out * scale[:, None])

        def step(t, y):
            return jax.lax.cond(t < tile_ends[-1], tile, lambda t, y: y, t, y)

        bound = max_tiles(N * k, T, E)
        return jax.lax.fori_loop(0, bound, step, jnp.zeros((N, D), w.dtype))

    def dense(self, x: jax.Array, w: jax.Array, idx: jax.Array) -> jax.Array:
        """Reference: every expert on every token, weighted by a dense [N, E] matrix."""
        E = self.w1.shape[0]
        dense_w = (
            jnp.zeros((x.shape[0], E), w.dtype)
            .at[jnp.arange(x.shape[0])[:, None], idx]
            .add(w, mode="drop")
        )
        gate = jnp.einsum("nd,eid->nei", x, self.w1[...])
        up = jnp.einsum("nd,eid->nei", x, self.w3[...])
        h = (jax.nn.silu(gate) * up).astype(x.dtype)
        y = jnp.einsum("nei,edi->ned", h, self.w2[...]).astype(w.dtype)
        return jnp.einsum("ned,ne->nd", y, dense_w)


class MoE(nnx.Module):
    def __init__(
        self,
        config: KimiLinearConfig,
        *,
        dtype,
        rngs: nnx.Rngs,
        dispatch: str = "auto",
        par: Parallel = SINGLE,
    ):
        self.dispatch = dispatch
        self.par = par
        self.gate = Router(config, dtype=dtype, rngs=rngs)
        self.experts = Experts(config, dtype=dtype, rngs=rngs)
        if config.num_shared_experts > 0:
            inter = config.moe_intermediate_size * config.num_shared_experts
            self.shared_experts = MLP(config.hidden_size, inter, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        w, idx = self.gate(flat)
        w, idx = self._local(w, idx)
        y = self.experts(flat, w, idx, self.dispatch).astype(x.dtype).reshape(shape)
        if hasattr(self, "shared_experts"):
            y = y + self.shared_experts(x)
        return y

    def _local(self, w: jax.Array, idx: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Expert ids -> ids among this rank's experts; pairs routed to other ranks get the
        out-of-range id E_local and weight 0."""
        if self.par.tp == 1:
            return w, idx
        n = self.experts.w1.shape[0]
        local = idx - self.par.tp_rank() * n
        mine = (local >= 0) & (local < n)
        return jnp.where(mine, w, 0), jnp.where(mine, local, n)
