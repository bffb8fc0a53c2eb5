"""Equivalence tests for the KDA kernels in kimi_linear_jax.ops.kda.

The token-by-token ``kda_recurrent`` is the reference; every other path must match it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_linear_jax.ops.kda import (
    kda_chunked,
    kda_commit,
    kda_recurrent,
    kda_replay,
    kda_window,
)
from tests.helpers import assert_close

# Per-dtype tolerances (max-abs, relative RMS), 10-1000x above what is reached on CPU:
# float64 reaches ~1e-15 on both; float32 reaches ~1e-6 max-abs and ~3e-7 relative RMS (chunked
# vs recurrent reassociates sums and goes through a triangular solve), also for T=2048.
TOL = {
    jnp.float64: dict(atol=1e-12, rtol_rms=1e-12),
    jnp.float32: dict(atol=1e-5, rtol_rms=1e-5),
}

# XLA compilation dominates this file's run time (about 40 distinct programs). Skipping the LLVM
# optimisation passes roughly halves it; it changes speed only, not IEEE float semantics.
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _jit(fn, **kw):
    return jax.jit(fn, compiler_options=_FAST_COMPILE, **kw)


chunked = _jit(kda_chunked, static_argnames=("scale", "chunk_size"))
recurrent = _jit(kda_recurrent, static_argnames=("scale",))
window = _jit(kda_window, static_argnames=("scale",))
commit = _jit(kda_commit)
replay = _jit(kda_replay)


def x64_if(dtype):
    """Context enabling 64-bit types for float64 cases only.

    float32 cases stay outside it so their compiled functions are shared across tests (the
    x64 flag is part of the jit cache key).
    """
    return jax.enable_x64(dtype == jnp.float64)


def make_inputs(
    seed: int,
    *,
    b: int = 2,
    t: int = 64,
    h: int = 3,
    dk: int = 16,
    dv: int = 16,
    decay: str = "normal",
    dtype=jnp.float32,
):
    """Random KDA inputs (q, k, v, g, beta, initial_state).

    decay: "normal" (|g| mostly 0.01..1), "strong" (g in -20..-5 per step) or "mixed" (half of
    the key channels strong, half normal, which stresses the per-channel decay handling).
    """
    rng = np.random.default_rng(seed)

    def unit(shape):
        x = rng.normal(size=shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q = unit((b, t, h, dk))
    k = unit((b, t, h, dk))
    v = rng.normal(size=(b, t, h, dv))
    weak = -np.exp(rng.normal(-2.0, 1.0, size=(b, t, h, dk)))
    strong = -rng.uniform(5.0, 20.0, size=(b, t, h, dk))
    if decay == "normal":
        g = weak
    elif decay == "strong":
        g = strong
    elif decay == "mixed":
        g = np.where(np.arange(dk) % 2 == 0, strong, weak)
    else:
        raise ValueError(decay)
    beta = 1.0 / (1.0 + np.exp(-rng.normal(size=(b, t, h))))
    s0 = rng.normal(size=(b, h, dk, dv))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v, g, beta, s0))


def _check_chunked_vs_recurrent(args, dtype, name, **kw):
    o_c, s_c = chunked(*args, **kw)
    o_r, s_r = recurrent(*args)
    assert o_c.dtype == dtype and s_c.dtype == dtype
    assert_close(o_c, o_r, name=f"{name} o", **TOL[dtype])
    assert_close(s_c, s_r, name=f"{name} state", **TOL[dtype])


def _mask_after(x, n):
    """Zero tokens t >= n of a [B,T,...] input, turning them into no-op steps."""
    # numpy keeps this off the jit path: eager jnp ops would each compile per shape.
    x = np.array(x)
    x[:, n:] = 0
    return x


# Test shapes are reused across tests on purpose: compilation dominates the run time.
SHAPES = [(t, 16, 16) for t in (1, 63, 64, 65, 130, 257)] + [(130, 16, 24)]


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("t,dk,dv", SHAPES)
def test_chunked_matches_recurrent(t, dk, dv, dtype):
    with x64_if(dtype):
        args = make_inputs(t, t=t, dk=dk, dv=dv, dtype=dtype)
        _check_chunked_vs_recurrent(args, dtype, f"T={t} K={dk} V={dv}")


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("decay", ["strong", "mixed"])
def test_strong_decay(decay, dtype):
    with x64_if(dtype):
        args = make_inputs(3, t=130, decay=decay, dtype=dtype)
        _check_chunked_vs_recurrent(args, dtype, f"{decay} decay")


def test_chunked_small_chunk_and_default_state():
    q, k, v, g, beta, s0 = make_inputs(1, t=63)
    o_c, s_c = chunked(q, k, v, g, beta, chunk_size=16)
    o_r, s_r = recurrent(q, k, v, g, beta, jnp.zeros_like(s0))
    assert_close(o_c, o_r, name="C=16 o", **TOL[jnp.float32])
    assert_close(s_c, s_r, name="C=16 state", **TOL[jnp.float32])


def test_chunked_empty_sequence():
    q, k, v, g, beta, s0 = make_inputs(2, t=0)
    o, s = chunked(q, k, v, g, beta, s0)
    assert o.shape == (2, 0, 3, 16)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s0))


@pytest.mark.parametrize("fn", [chunked, recurrent], ids=["chunked", "recurrent"])
def test_split_sequence_carries_state(fn):
    q, k, v, g, beta, s0 = make_inputs(4, t=130)
    o_full, s_full = fn(q, k, v, g, beta, s0)
    # Split off the chunk grid so the second part starts mid-chunk of the one-pass run.
    o_a, s_a = fn(q[:, :65], k[:, :65], v[:, :65], g[:, :65], beta[:, :65], s0)
    o_b, s_b = fn(q[:, 65:], k[:, 65:], v[:, 65:], g[:, 65:], beta[:, 65:], s_a)
    o_split = jnp.concatenate([o_a, o_b], axis=1)
    assert_close(o_split, o_full, name="split o", **TOL[jnp.float32])
    assert_close(s_b, s_full, name="split state", **TOL[jnp.float32])


@pytest.mark.parametrize("fn", [chunked, recurrent], ids=["chunked", "recurrent"])
def test_padding_tokens_keep_state(fn):
    q, k, v, g, beta, s0 = make_inputs(5, t=130)
    _, s_ref = fn(q[:, :63], k[:, :63], v[:, :63], g[:, :63], beta[:, :63], s0)
    # q stays random: it only feeds outputs, never the state.
    padded = [_mask_after(x, 63) for x in (k, v, g, beta)]
    _, s_pad = fn(q, *padded, s0)
    assert_close(s_pad, s_ref, name="padded state", **TOL[jnp.float32])


@pytest.mark.parametrize("t", [1, 5])
def test_window_matches_recurrent(t):
    with x64_if(jnp.float64):
        q, k, v, g, beta, s0 = make_inputs(7, b=4, t=t, dtype=jnp.float64)
        o_w, states = window(q, k, v, g, beta, s0)
        o_r, s_r = recurrent(q, k, v, g, beta, s0)
        assert states.shape == (4, t, 3, 16, 16)
        assert_close(o_w, o_r, name="window o", **TOL[jnp.float64])
        assert_close(states[:, -1], s_r, name="window final", **TOL[jnp.float64])
        for i in range(t):
            # Prefix of i+1 tokens as no-op padding after it: one compiled shape for all i.
            prefix = [_mask_after(x, i + 1) for x in (k, v, g, beta)]
            _, s_i = recurrent(q, *prefix, s0)
            assert_close(states[:, i], s_i, name=f"window state {i}", **TOL[jnp.float64])


def test_commit_picks_step():
    with x64_if(jnp.float64):
        q, k, v, g, beta, s0 = make_inputs(8, b=4, t=5, dtype=jnp.float64)
        _, states = window(q, k, v, g, beta, s0)
        got = np.asarray(commit(s0, states, jnp.array([0, 1, 3, 5], jnp.int32)))
    np.testing.assert_array_equal(got[0], np.asarray(s0[0]))
    for b, n in [(1, 1), (2, 3), (3, 5)]:
        np.testing.assert_array_equal(got[b], np.asarray(states[b, n - 1]))


def test_replay_matches_commit():
    with x64_if(jnp.float64):
        q, k, v, g, beta, s0 = make_inputs(9, b=4, t=5, dtype=jnp.float64)
        _, states = window(q, k, v, g, beta, s0)
        lens = jnp.array([3, 0, 5, 1], jnp.int32)
        want = commit(s0, states, lens)
        got = replay(s0, k, v, g, beta, lens)
        assert_close(got, want, name="replay vs commit", **TOL[jnp.float64])
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(s0[1]))
        # A snapshot inside the committed prefix (a track point) from the same pass.
        snaps = jnp.array([2, 0, 4, 1], jnp.int32)
        final, snap = replay(s0, k, v, g, beta, lens, snaps)
        assert_close(final, want, name="replay with snapshot", **TOL[jnp.float64])
        assert_close(snap, commit(s0, states, snaps), name="snapshot", **TOL[jnp.float64])


def _loss(fn, q, k, v, g, beta, s0, w_o, w_s):
    o, s = fn(q, k, v, g, beta, s0)
    return jnp.sum(o * w_o) + jnp.sum(s * w_s)


_ARGNUMS = tuple(range(6))
grad_chunked = _jit(
    jax.grad(functools.partial(_loss, functools.partial(kda_chunked, chunk_size=16)), _ARGNUMS)
)
grad_recurrent = _jit(jax.grad(functools.partial(_loss, kda_recurrent), _ARGNUMS))


@pytest.mark.parametrize("decay", ["normal", "mixed"])
def test_grad_chunked_matches_recurrent(decay):
    with x64_if(jnp.float64):
        args = make_inputs(10, b=1, t=37, h=2, dk=8, dv=12, decay=decay, dtype=jnp.float64)
        rng = np.random.default_rng(11)
        w_o = jnp.asarray(rng.normal(size=(1, 37, 2, 12)))
        w_s = jnp.asarray(rng.normal(size=(1, 2, 8, 12)))
        g_c = grad_chunked(*args, w_o, w_s)
        g_r = grad_recurrent(*args, w_o, w_s)
        for name, a, e in zip(["q", "k", "v", "g", "beta", "s0"], g_c, g_r, strict=True):
            assert_close(a, e, name=f"grad {name}", **TOL[jnp.float64])
