"""Kimi Delta Attention layer: projections, short convs, gates, the delta-rule recurrence,
gated per-head norm and output projection. The recurrence itself lives in `ops/kda.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_linear_jax.cache import KDAInputs, KDAState
from kimi_linear_jax.config import KimiLinearConfig
from kimi_linear_jax.layers.linear import Linear, acc_dtype, init_uniform, param
from kimi_linear_jax.layers.norm import GatedRMSNorm
from kimi_linear_jax.layers.short_conv import (
    ShortConv,
    next_window,
    window_after_each_node,
    window_after_each_step,
)
from kimi_linear_jax.ops import kda as kda_ops
from kimi_linear_jax.ops import tree as tree_ops


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) per head, eps inside the sqrt (as the reference kernels)."""
    return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


class KDA(nnx.Module):
    def __init__(self, config: KimiLinearConfig, *, dtype, rngs: nnx.Rngs):
        D, P, H, d = (
            config.hidden_size,
            config.kda_dim,
            config.linear_num_heads,
            config.linear_head_dim,
        )
        W = config.short_conv_kernel_size
        self.num_heads, self.head_dim = H, d
        self.prefill_impl = "auto"  # see ops.kda.kda_prefill; `set_kda_impl` changes it
        # Under TP every per-head tensor is sharded by heads ("heads"; P = H * d is head-major),
        # the low-rank f_a / g_a stay whole, and o_proj is row-parallel (the block all-reduces).
        col = dict(dtype=dtype, rngs=rngs, axes=("heads", None))
        self.q_proj = Linear(D, P, **col)
        self.k_proj = Linear(D, P, **col)
        self.v_proj = Linear(D, P, **col)
        self.q_conv1d = ShortConv(P, W, dtype=dtype, rngs=rngs)
        self.k_conv1d = ShortConv(P, W, dtype=dtype, rngs=rngs)
        self.v_conv1d = ShortConv(P, W, dtype=dtype, rngs=rngs)
        # Decay parameters stay fp32 whatever the model dtype: the state is sensitive to them.
        a_log = jnp.log(init_uniform(rngs, (1, 1, H, 1), 1.0, 16.0))
        self.A_log = param(a_log, (None, None, "heads", None))
        dt = jnp.exp(init_uniform(rngs, (P,), -6.9, -2.3))  # dt in [1e-3, 1e-1]
        self.dt_bias = param(dt + jnp.log(-jnp.expm1(-dt)), ("heads",))  # inverse softplus
        self.f_a_proj = Linear(D, d, dtype=dtype, rngs=rngs)
        self.f_b_proj = Linear(d, P, **col)
        self.b_proj = Linear(D, H, **col)
        self.g_a_proj = Linear(D, d, dtype=dtype, rngs=rngs)
        self.g_b_proj = Linear(d, P, **col)
        self.o_norm = GatedRMSNorm(d, config.rms_norm_eps, dtype=dtype)
        self.o_proj = Linear(P, D, dtype=dtype, rngs=rngs, axes=(None, "heads"))

    # ---- pieces ----------------------------------------------------------------------------
    def _heads(self, x: jax.Array) -> jax.Array:
        # -1: the heads this rank holds (all of them on one device).
        return x.reshape(*x.shape[:-1], -1, self.head_dim)

    def _decay(self, x: jax.Array) -> jax.Array:
        """g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias), [B, T, H, d] fp32, g <= 0."""
        f = self.f_b_proj(self.f_a_proj(x))
        f = f.astype(acc_dtype(f)) + self.dt_bias[...]
        f = self._heads(f)
        softplus = jnp.where(f > 20.0, f, jnp.log1p(jnp.exp(jnp.minimum(f, 20.0))))
        return -jnp.exp(self.A_log[...]) * softplus

    def _pre(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Pre-conv q, k, v projections: what the conv windows remember."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def _convs(self):
        return self.q_conv1d, self.k_conv1d, self.v_conv1d

    def _qkvgb(self, x, pre, windows, lengths=None):
        """Conv'd, normalised q, k, v plus g and beta, all fp32; padded tokens neutralised."""
        qkv = [conv(p, w) for conv, p, w in zip(self._convs(), pre, windows)]
        return self._gates(x, *qkv, lengths)

    def _gates(self, x, q, k, v, lengths=None):
        """From conv outputs: heads, l2-normalised q, k, fp32, plus g and beta."""
        acc = acc_dtype(q)
        q, k, v = (self._heads(t).astype(acc) for t in (q, k, v))
        q, k = l2_normalize(q), l2_normalize(k)
        g = self._decay(x)
        beta = jax.nn.sigmoid(self.b_proj(x)).astype(acc)
        if lengths is not None:
            # beta = 0, g = 0, k = 0 make a padded step the identity on the state.
            valid = jnp.arange(x.shape[1])[None, :] < lengths[:, None]
            k = jnp.where(valid[..., None, None], k, 0.0)
            g = jnp.where(valid[..., None, None], g, 0.0)
            beta = jnp.where(valid[..., None], beta, 0.0)
        return q, k, v, g, beta

    def _out(self, x: jax.Array, o: jax.Array) -> jax.Array:
        gate = self._heads(self.g_b_proj(self.g_a_proj(x)))
        o = self.o_norm(o.astype(x.dtype), gate)
        return self.o_proj(o.reshape(*o.shape[:-2], -1))

    def _windows(self, x, state: KDAState | None):
        if state is not None:
            return state.conv_q, state.conv_k, state.conv_v
        W = self.q_conv1d.weight.shape[-1]
        z = jnp.zeros((x.shape[0], W - 1, self.q_proj.weight.shape[0]), x.dtype)
        return z, z, z

    # ---- entries ---------------------------------------------------------------------------
    def __call__(self, x: jax.Array) -> jax.Array:
        """No-cache forward [B, T, D] -> [B, T, D] (prefill recurrence, differentiable)."""
        q, k, v, g, beta = self._qkvgb(x, self._pre(x), self._windows(x, None))
        o, _ = kda_ops.kda_prefill(q, k, v, g, beta, impl=self.prefill_impl)
        return self._out(x, o)

    def prefill(self, x: jax.Array, state: KDAState, lengths: jax.Array):
        """Chunked pass from the rows' states; returns (y, state after token lengths-1)."""
        windows, pre = self._windows(x, state), self._pre(x)
        q, k, v, g, beta = self._qkvgb(x, pre, windows, lengths)
        o, S = kda_ops.kda_prefill(q, k, v, g, beta, state.S, impl=self.prefill_impl)
        new = KDAState(*(next_window(w, p, lengths) for w, p in zip(windows, pre)), S)
        return self._out(x, o), new

    def decode(self, x: jax.Array, state: KDAState, lengths: jax.Array, keep: str = "states"):
        """Window pass (T small: decode or verify).

        Returns (y, per_step). With keep="states", per_step is a KDAState whose arrays carry a
        step axis: conv windows [B, T, W-1, P] and S [B, T, H, K, V], the state after each step
        t, for `commit` to pick from. With keep="inputs", it is the window's `KDAInputs`, for
        `replay` to re-run the accepted steps from (T times less memory than the states).
        """
        if keep not in KEEPS:
            raise ValueError(f"keep must be one of {KEEPS}, got {keep!r}")
        windows, pre = self._windows(x, state), self._pre(x)
        q, k, v, g, beta = self._qkvgb(x, pre, windows)
        o, states = kda_ops.kda_window(q, k, v, g, beta, state.S, keep_states=keep == "states")
        if keep == "inputs":
            return self._out(x, o), KDAInputs(*pre, k, v, g, beta)
        steps = tuple(window_after_each_step(w, p) for w, p in zip(windows, pre))
        return self._out(x, o), KDAState(*steps, states)

    def decode_tree(self, x: jax.Array, state: KDAState, parents: jax.Array):
        """A draft-tree window (`ops.tree`): node i continues the state of its parent (the
        root: `state`, the rows' states). Returns (y, per-node KDAState: conv windows
        [B, T, W-1, P] and S [B, T, H, K, V] after each node), laid out as `decode`'s
        keep="states" output, so `commit` of n picks node n - 1."""
        windows, pre = self._windows(x, state), self._pre(x)
        idx = tree_ops.conv_index(parents, self.q_conv1d.weight.shape[-1])
        qkv = [conv.tree(p, w, idx) for conv, p, w in zip(self._convs(), pre, windows)]
        q, k, v, g, beta = self._gates(x, *qkv)
        o, states = tree_ops.kda_tree_window(q, k, v, g, beta, state.S, parents)
        steps = tuple(window_after_each_node(w, p, idx) for w, p in zip(windows, pre))
        return self._out(x, o), KDAState(*steps, states)


# What a window pass keeps for its commit: every step's state (gather) or the inputs (replay).
KEEPS = ("states", "inputs")


def commit(state: KDAState, per_step: KDAState, n: jax.Array) -> KDAState:
    """The state and conv windows after step n[b] - 1 of a window (n = 0 keeps `state`): a
    functional gather on device, no host round trip. The reference for `replay`."""
    return KDAState(*(kda_ops.kda_commit(s, p, n) for s, p in zip(state, per_step)))


def replay(state: KDAState, inputs: KDAInputs, n: jax.Array, snapshot_n: jax.Array | None = None):
    """The state and conv windows after the first n[b] steps of a window, re-run from `state`
    (the row's state before the window) with the window's inputs. With `snapshot_n`, also the
    state after snapshot_n[b] steps (a track point; valid where snapshot_n <= n), same pass."""
    windows = [next_window(w, p, n) for w, p in zip(state[:3], inputs[:3])]
    S = kda_ops.kda_replay(state.S, inputs.k, inputs.v, inputs.g, inputs.beta, n, snapshot_n)
    if snapshot_n is None:
        return KDAState(*windows, S)
    snap_windows = [next_window(w, p, snapshot_n) for w, p in zip(state[:3], inputs[:3])]
    return KDAState(*windows, S[0]), KDAState(*snap_windows, S[1])


def advance(state: KDAState, per_step: KDAState | KDAInputs, n: jax.Array) -> KDAState:
    """`commit` or `replay`, whichever the window pass kept."""
    if isinstance(per_step, KDAInputs):
        return replay(state, per_step, n)
    return commit(state, per_step, n)
