"""Kimi Delta Attention (KDA) in pure JAX.

Per head the state ``S`` is a ``[K, V]`` matrix. For every token ``t``::

    S   = S * exp(g_t)[:, None]                  # per-key-channel decay
    S   = S + k_t (beta_t (v_t - S^T k_t))^T     # delta rule on the decayed state
    o_t = S^T (q_t * scale)

Shape letters: B batch, T tokens, H heads, K key dim, V value dim, C chunk length.
Inputs use the ``[B, T, H, ...]`` layout; ``q`` and ``k`` are expected to be L2-normalised
already, ``g <= 0`` is a log-decay per key channel and ``beta`` lies in ``(0, 1)``.

All math runs in the promoted dtype of the inputs, at least float32.

* :func:`kda_recurrent` - token-by-token reference.
* :func:`kda_chunked` - chunk-parallel prefill path (same result, far fewer sequential steps).
* :func:`kda_window` - small-T path returning the state after every step (decode / verify).
* :func:`kda_commit` / :func:`kda_replay` - pick the state after an accepted prefix.
"""

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array

# Accelerators default to bf16/TF32 passes for float32 dots, which would break parity with the
# recurrent reference; the state recursion amplifies such errors over long sequences.
_PREC = lax.Precision.HIGHEST


def _compute_dtype(*xs: Array | None) -> jnp.dtype:
    return jnp.result_type(*[x for x in xs if x is not None], jnp.float32)


def _init_state(state: Array | None, shape: tuple[int, ...], dtype: jnp.dtype) -> Array:
    if state is None:
        return jnp.zeros(shape, dtype)
    if state.shape != shape:
        raise ValueError(f"initial_state has shape {state.shape}, expected {shape}")
    return state.astype(dtype)


def _prepare(q, k, v, g, beta, initial_state, scale):
    """Cast inputs to the compute dtype and resolve the state and scale defaults."""
    dtype = _compute_dtype(q, k, v, g, beta, initial_state)
    q, k, v, g, beta = (x.astype(dtype) for x in (q, k, v, g, beta))
    b, _, h, dk = k.shape
    dv = v.shape[-1]
    state = _init_state(initial_state, (b, h, dk, dv), dtype)
    scale = dk**-0.5 if scale is None else scale
    return q, k, v, g, beta, state, scale


def _delta_step(state: Array, k_t: Array, v_t: Array, g_t: Array, b_t: Array) -> Array:
    """One token of the recurrence.

    state [B,H,K,V], k_t/g_t [B,H,K], v_t [B,H,V], b_t [B,H] -> state [B,H,K,V].
    """
    state = state * jnp.exp(g_t)[..., None]
    pred = jnp.einsum("bhk,bhkv->bhv", k_t, state, precision=_PREC)
    delta = b_t[..., None] * (v_t - pred)
    return state + k_t[..., :, None] * delta[..., None, :]


def _window_update(s: Array, k_t: Array, v_t: Array, g_t: Array, b_t: Array, q_t: Array):
    """One token of the recurrence that reads the state once, for the serving window.

    `_delta_step` plus the readout make XLA write the decayed state, read it for k^T S,
    write the new state and read that for q^T S_new: four passes over [B, H, K, V] per token.
    Here both products come from one dot with the state before the decay, since
    k^T (S e^g) = (k e^g)^T S and q^T S_new = (q e^g)^T S + (q . k) delta, and the new
    state is one elementwise pass. Equal to the reference up to rounding (tested).
    `q_t` None skips the readout (the replay). Returns (new state, o_t or None).
    """
    decay = jnp.exp(g_t)
    lhs = (k_t * decay)[:, :, None] if q_t is None else jnp.stack([k_t, q_t], 2) * decay[:, :, None]
    products = jnp.einsum("bhnk,bhkv->bhnv", lhs, s, precision=_PREC)
    delta = b_t[..., None] * (v_t - products[:, :, 0])
    s = s * decay[..., None] + k_t[..., :, None] * delta[..., None, :]
    if q_t is None:
        return s, None
    return s, products[:, :, 1] + jnp.sum(q_t * k_t, -1, keepdims=True) * delta


def _reference_update(s: Array, k_t: Array, v_t: Array, g_t: Array, b_t: Array, q_t: Array):
    """`_delta_step`, then the readout q^T S_new: the reference token of the recurrence."""
    s = _delta_step(s, k_t, v_t, g_t, b_t)
    return s, jnp.einsum("bhk,bhkv->bhv", q_t, s, precision=_PREC)


def _run_steps(q, k, v, g, beta, state, scale, *, keep_states: bool, update=_reference_update):
    """Scan the recurrence over T, one token by `update` (the reference, or the serving
    window's `_window_update`).

    Returns o [B,T,H,V], the final state [B,H,K,V] and, if ``keep_states``, the state after
    every step [B,T,H,K,V] (else None).
    """

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs
        s, o_t = update(s, k_t, v_t, g_t, b_t, q_t * scale)
        return s, ((o_t, s) if keep_states else o_t)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    final, ys = lax.scan(step, state, xs)
    if keep_states:
        o, states = ys
        return jnp.moveaxis(o, 0, 1), final, jnp.moveaxis(states, 0, 1)
    return jnp.moveaxis(ys, 0, 1), final, None


def kda_recurrent(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    initial_state: Array | None = None,
    *,
    scale: float | None = None,
) -> tuple[Array, Array]:
    """Reference KDA: a ``lax.scan`` over tokens.

    Args:
      q, k: [B,T,H,K], L2-normalised.
      v: [B,T,H,V].
      g: [B,T,H,K] log-decay (<= 0).
      beta: [B,T,H] in (0, 1).
      initial_state: [B,H,K,V] or None for zeros.
      scale: query scale, default K**-0.5.

    Returns:
      o [B,T,H,V] and the final state [B,H,K,V], both in the compute dtype.
    """
    q, k, v, g, beta, state, scale = _prepare(q, k, v, g, beta, initial_state, scale)
    o, final, _ = _run_steps(q, k, v, g, beta, state, scale, keep_states=False)
    return o, final


# Sub-chunk width inside a chunk: off-diagonal sub-blocks become matmuls whose decay factors
# are both <= 1; only the diagonal sub-blocks need the [S, S, K] masked decay tensor.
_SUB = 16


def _pair_decay_matrix(a: Array, b: Array, gc: Array) -> Array:
    """M[i, j] = sum_c a_i,c b_j,c exp(G_i,c - G_j,c) for j <= i (0 above the diagonal).

    a, b, gc [B,H,C,K] -> [B,H,C,C]. Off-diagonal sub-blocks (I > J) factor through the
    cumulative decay just before sub-chunk I (r = start(I) - 1, with j <= r < i):
    exp(G_i - G_j) = exp(G_i - G_r) * exp(G_r - G_j), both factors <= 1, so nothing
    overflows however strong the decay. Diagonal sub-blocks use the masked exponent directly.
    """
    *lead, c, dk = gc.shape
    s = _SUB if c % _SUB == 0 else c  # odd chunk sizes: one diagonal block
    n = c // s
    sub = lambda x: x.reshape(*lead, n, s, dk)
    a_s, b_s, g_s = sub(a), sub(b), sub(gc)
    # G_r per sub-chunk I: the cumulative decay at the last position of sub-chunk I - 1 (0 for I=0).
    g_ref = jnp.concatenate([jnp.zeros_like(g_s[..., :1, 0, :]), g_s[..., :-1, -1, :]], axis=-2)
    left = a_s * jnp.exp(g_s - g_ref[..., :, None, :])  # [.., I, i, K]
    lower = jnp.tril(jnp.ones((n, n), bool), -1)  # J < I
    expo = g_ref[..., :, None, None, :] - g_s[..., None, :, :, :]  # [.., I, J, j, K]
    expo = jnp.where(lower[:, :, None, None], expo, -jnp.inf)
    right = b_s[..., None, :, :, :] * jnp.exp(expo)
    off = jnp.einsum("...Iik,...IJjk->...IiJj", left, right, precision=_PREC)
    # Diagonal sub-blocks: the masked exponent must be masked before exp (above the diagonal it
    # is positive and can overflow; inf * 0 would be NaN, in gradients too).
    causal = jnp.tril(jnp.ones((s, s), bool))
    diff = g_s[..., :, None, :] - g_s[..., None, :, :]  # [.., I, i, j, K]
    decay = jnp.exp(jnp.where(causal[:, :, None], diff, -jnp.inf))
    diag = jnp.einsum("...Iik,...Iijk,...Ijk->...Iij", a_s, decay, b_s, precision=_PREC)
    eye_blocks = jnp.eye(n, dtype=diag.dtype)[:, None, :, None]  # [I, 1, J, 1]
    full = off + eye_blocks * diag[..., :, :, None, :]
    return full.reshape(*lead, c, c)


def _unit_lower_inverse(a: Array) -> Array:
    """(I + A)^-1 for strictly lower-triangular A [..., C, C], by forward substitution.

    Row i of X = (I + A)^-1 is e_i - A[i, :i] X[:i]; a fori_loop over rows keeps it exact (no
    power series) and avoids XLA-CPU's slow expanded triangular solve.
    """
    c = a.shape[-1]
    eye = jnp.eye(c, dtype=a.dtype)

    def row(i, x):
        a_i = lax.dynamic_index_in_dim(a, i, axis=-2, keepdims=True)  # [.., 1, C]
        x_i = lax.dynamic_index_in_dim(eye, i, axis=0, keepdims=True) - jnp.matmul(
            a_i, x, precision=_PREC
        )
        return lax.dynamic_update_index_in_dim(x, x_i, i, axis=-2)

    return lax.fori_loop(0, c, row, jnp.zeros_like(a))


def _chunk_step(state: Array, xs, *, scale: float):
    """Advance the state over one chunk.

    state [B,H,K,V]; xs = q, k, g [B,H,C,K], v [B,H,C,V], beta [B,H,C].
    Returns the new state and o [B,H,C,V].
    """
    q, k, v, g, beta = xs
    gc = jnp.cumsum(g, axis=-2)
    qs = q * scale
    akk = beta[..., :, None] * jnp.tril(_pair_decay_matrix(k, k, gc), -1)
    aqk = _pair_decay_matrix(qs, k, gc)
    m = _unit_lower_inverse(akk)  # (I + Akk)^-1, then Diag(beta) folded into the RHS
    w = jnp.matmul(m, beta[..., None] * jnp.exp(gc) * k, precision=_PREC)
    u = jnp.matmul(m, beta[..., None] * v, precision=_PREC)

    vn = u - jnp.matmul(w, state, precision=_PREC)
    o = jnp.matmul(qs * jnp.exp(gc), state, precision=_PREC)
    o = o + jnp.matmul(aqk, vn, precision=_PREC)

    g_last = gc[..., -1, :]
    k_tail = jnp.exp(g_last[..., None, :] - gc) * k
    state = jnp.exp(g_last)[..., None] * state
    state = state + jnp.einsum("bhck,bhcv->bhkv", k_tail, vn, precision=_PREC)
    return state, o


def _to_chunks(x: Array, n_chunks: int, chunk: int) -> Array:
    """[B,T,H,...] -> [N,B,H,C,...], zero-padding T up to N*C."""
    pad = n_chunks * chunk - x.shape[1]
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(x.shape[0], n_chunks, chunk, *x.shape[2:])
    # Heads ahead of the chunk axis so per-chunk matmuls see [.., C, K] operands.
    return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 3, 2)


def kda_chunked(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    initial_state: Array | None = None,
    *,
    scale: float | None = None,
    chunk_size: int = 64,
) -> tuple[Array, Array]:
    """Chunk-parallel KDA for prefill; equals :func:`kda_recurrent`.

    Args:
      q, k: [B,T,H,K], L2-normalised.
      v: [B,T,H,V].
      g: [B,T,H,K] log-decay (<= 0).
      beta: [B,T,H] in (0, 1).
      initial_state: [B,H,K,V] or None for zeros.
      scale: query scale, default K**-0.5.
      chunk_size: C, static. T need not be a multiple of C.

    Returns:
      o [B,T,H,V] and the final state [B,H,K,V], both in the compute dtype.
    """
    q, k, v, g, beta, state, scale = _prepare(q, k, v, g, beta, initial_state, scale)
    b, t, h, _ = q.shape
    dv = v.shape[-1]
    if t == 0:
        return jnp.zeros((b, 0, h, dv), state.dtype), state

    n_chunks = -(-t // chunk_size)
    # Zero padding is a no-op step: g = 0 keeps the state, beta = 0 and k = 0 add nothing.
    xs = tuple(_to_chunks(x, n_chunks, chunk_size) for x in (q, k, v, g, beta))

    def body(s, x):
        return _chunk_step(s, x, scale=scale)

    # The [B,H,C,C,K] decay tensor is built per chunk inside the scan, which bounds peak memory
    # by one chunk instead of the whole sequence.
    final, o = lax.scan(body, state, xs)
    o = jnp.moveaxis(o, 0, 1)  # [B,N,H,C,V]
    o = jnp.moveaxis(o, 2, 3).reshape(b, n_chunks * chunk_size, h, dv)
    return o[:, :t], final


KDA_IMPLS = ("auto", "chunked", "recurrent")


def kda_prefill(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    initial_state: Array | None = None,
    *,
    impl: str = "auto",
) -> tuple[Array, Array]:
    """The prefill recurrence, by implementation: 'chunked', 'recurrent', or 'auto'.

    'auto' takes the chunked form on accelerators and the recurrent scan on a CPU, where the
    chunked form does about twice the flops at the same flop rate and measures slower
    (benchmarks/RESULTS.md). Both are tested equal to each other.
    """
    if impl not in KDA_IMPLS:
        raise ValueError(f"kda impl must be one of {KDA_IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = "recurrent" if jax.default_backend() == "cpu" else "chunked"
    fn = kda_chunked if impl == "chunked" else kda_recurrent
    return fn(q, k, v, g, beta, initial_state)


def kda_window(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    initial_state: Array | None,
    *,
    scale: float | None = None,
    keep_states: bool = True,
) -> tuple[Array, Array | None]:
    """Small-T KDA (decode T=1, speculative verify T=k+1) keeping every intermediate state.

    Args:
      q, k: [B,T,H,K]; v: [B,T,H,V]; g: [B,T,H,K]; beta: [B,T,H].
      initial_state: [B,H,K,V] (None means zeros).
      scale: query scale, default K**-0.5.
      keep_states: False returns None for the states (a replay commit re-derives the one it
        needs from the inputs instead of holding T of them).

    Returns:
      o [B,T,H,V] and states [B,T,H,K,V], where states[:, t] is the state after token t.
    """
    q, k, v, g, beta, state, scale = _prepare(q, k, v, g, beta, initial_state, scale)
    o, _, states = _run_steps(
        q, k, v, g, beta, state, scale, keep_states=keep_states, update=_window_update
    )
    return o, states


def kda_commit(initial_state: Array, states: Array, commit_lens: Array) -> Array:
    """Select the state after the first ``commit_lens[b]`` tokens of a window.

    Works for any per-step array with a step axis 1 (the state S, or the conv windows).

    Args:
      initial_state: [B, ...], the value before the window (e.g. [B,H,K,V]).
      states: [B,T, ...] after each step (from :func:`kda_window`).
      commit_lens: int [B] in [0, T]; 0 keeps ``initial_state``.

    Returns:
      [B, ...] in the dtype of ``states``.
    """
    initial_state = initial_state.astype(states.dtype)
    if states.shape[1] == 0:
        return initial_state
    commit_lens = jnp.asarray(commit_lens, jnp.int32)
    idx = jnp.clip(commit_lens - 1, 0, states.shape[1] - 1)
    idx = idx.reshape(-1, 1, *([1] * (states.ndim - 2)))
    picked = jnp.take_along_axis(states, idx, axis=1)[:, 0]
    keep = (commit_lens == 0).reshape(-1, *([1] * (initial_state.ndim - 1)))
    return jnp.where(keep, initial_state, picked)


def kda_replay(
    initial_state: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    commit_lens: Array,
    snapshot_lens: Array | None = None,
) -> Array | tuple[Array, Array]:
    """Re-run the first ``commit_lens[b]`` tokens of a window from ``initial_state``.

    Needs only one state per sequence instead of T, at the cost of a second pass; the result
    equals ``kda_commit(initial_state, kda_window(...)[1], commit_lens)``.

    Args:
      initial_state: [B,H,K,V].
      k: [B,T,H,K]; v: [B,T,H,V]; g: [B,T,H,K]; beta: [B,T,H].
      commit_lens: int [B] in [0, T].
      snapshot_lens: optional int [B] in [0, T]: also return the state after the first
        ``snapshot_lens[b]`` tokens (a track point inside the window), from the same pass.

    Returns:
      [B,H,K,V] in the compute dtype, or (that, the snapshot) when ``snapshot_lens`` is given.
    """
    # q only feeds outputs, which replay does not produce.
    _, k, v, g, beta, state, _ = _prepare(k, k, v, g, beta, initial_state, 1.0)
    commit_lens = jnp.asarray(commit_lens, jnp.int32)
    snap_lens = commit_lens if snapshot_lens is None else jnp.asarray(snapshot_lens, jnp.int32)

    def rows(mask):
        return mask[:, None, None, None]

    def step(carry, xs):
        s, snap = carry
        t, k_t, v_t, g_t, b_t = xs
        # The window's update (not the reference's), so both commits give the same state.
        new, _ = _window_update(s, k_t, v_t, g_t, b_t, None)
        s = jnp.where(rows(t < commit_lens), new, s)
        # The snapshot takes the state once the pass has run its tokens; a snapshot beyond
        # commit_lens is never asked for (the caller drops it), so it may stop early.
        return (s, jnp.where(rows(t + 1 == snap_lens), s, snap)), None

    steps = jnp.arange(k.shape[1], dtype=jnp.int32)
    xs = (steps, *(jnp.moveaxis(x, 1, 0) for x in (k, v, g, beta)))
    (final, snap), _ = lax.scan(step, (state, state), xs)
    return final if snapshot_lens is None else (final, snap)
