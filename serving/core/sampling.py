"""Per-request sampling on device: penalties, temperature, top-k / top-p / min-p, seeded draws.

Host side: `SamplingParams` (vLLM / OpenAI names) and `SamplingBatch.from_params`, which packs the
parameters of the running requests into per-row arrays [B] padded to a bucket size. Device side:
`apply_penalties` and `sample`, pure functions with static shapes that the runner calls inside its
jitted step, so a batch mixing greedy, top-k and nucleus rows compiles once per bucket.

Dimension letters: B batch rows, V vocab, N top-logprob count (static).
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# OpenAI's cap on `logprobs`; the runner compiles the top-N gather for a static N <= this.
MAX_LOGPROBS = 20
# OpenAI's accepted range for presence / frequency penalties.
PENALTY_LIMIT = 2.0
# Below this a temperature is treated as greedy (vLLM's _SAMPLING_EPS): dividing f32 logits by
# a tiny temperature overflows to inf and the draw becomes NaN-driven rather than an argmax.
GREEDY_EPS = 1e-5
# OpenAI's limits on logit_bias: values in [-100, 100] and at most 300 entries. The entry cap is
# also the static width of the per-row bias arrays of a batch in which some row has a bias.
LOGIT_BIAS_LIMIT = 100.0
MAX_LOGIT_BIAS = 300


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What one request asks for. `top_k` of -1 or 0 means no top-k; `seed=None` means the engine
    draws one at admission (`resolve_seed`) so the request stays reproducible from then on."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    # vLLM's prompt_logprobs: per prompt token, its logprob and the top N (engine.RequestOutput).
    prompt_logprobs: int | None = None
    # OpenAI's logit_bias: (token id, bias) pairs added to the logits before every draw. A dict
    # {id: bias} is taken too and stored as its pairs (the dataclass stays hashable).
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        # vLLM's forms: one stop string, or lists. Only the container changes here; the values
        # are checked, never converted, by `validate`.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        elif isinstance(self.logit_bias, list):
            pairs = self.logit_bias
            object.__setattr__(self, "logit_bias", tuple(_pair(p) for p in pairs))

    @property
    def has_penalty(self) -> bool:
        """A repetition, presence or frequency penalty: the row needs its token counts."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def has_bias(self) -> bool:
        """A logit_bias: the row leaves the greedy fast path (a bare argmax of raw logits)."""
        return len(self.logit_bias) > 0

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the first field of a wrong type or outside its limit. The
        one check every entry point uses (offline API, CLI, JSONL lines, HTTP): no coercion,
        so "0.5", 2.5 tokens, True as a token id or an infinite temperature are all refused."""
        self._check_types()
        # `not (x >= lo)` rather than `x < lo` so that NaN is rejected too.
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not -1 <= self.top_k <= vocab_size:
            raise ValueError(
                f"top_k must be -1, 0 (off) or in [1, vocab_size={vocab_size}], got {self.top_k}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise ValueError(
                    f"{name} must be in [-{PENALTY_LIMIT}, {PENALTY_LIMIT}], got {value}"
                )
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        n = self.prompt_logprobs
        if n is not None and not 0 <= n <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {n}")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {vocab_size})"
            )
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        self._validate_bias(vocab_size)

    def _validate_bias(self, vocab_size: int) -> None:
        pairs = self.logit_bias
        if not isinstance(pairs, tuple) or not all(_is_bias_pair(p) for p in pairs):
            raise ValueError(f"logit_bias must map token ids to finite numbers, got {pairs!r:.60}")
        if len(pairs) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(pairs)} entries, at most {MAX_LOGIT_BIAS}")
        seen = set()
        for token, bias in pairs:
            if not 0 <= token < vocab_size:
                raise ValueError(
                    f"logit_bias: token id {token} is outside the vocabulary [0, {vocab_size})"
                )
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(
                    f"logit_bias: the bias of token {token} must be in "
                    f"[-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], got {bias}"
                )
            if token in seen:
                raise ValueError(f"logit_bias: token id {token} appears twice")
            seen.add(token)

    def _check_types(self) -> None:
        for name in _FLOATS:
            value = getattr(self, name)
            if not is_number(value) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r:.60}")
        for name in ("top_k", "max_tokens"):
            if not is_int(getattr(self, name)):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r:.60}")
        for name in ("seed", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not is_int(value):
                raise ValueError(f"{name} must be an integer or None, got {value!r:.60}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r:.60}")
        ids = self.stop_token_ids
        if not isinstance(ids, tuple | list) or not all(is_int(t) for t in ids):
            raise ValueError(f"stop_token_ids must be a list of integers, got {ids!r:.60}")
        stop = self.stop
        if not isinstance(stop, tuple | list) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r:.60}")
        if any(s == "" for s in stop):
            raise ValueError("stop: an empty stop string would end every request at once")


_FLOATS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


def is_int(x) -> bool:
    """An integer proper: bool (an int subclass) and integral floats are not."""
    return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_)


def is_number(x) -> bool:
    return is_int(x) or isinstance(x, float | np.floating)


def _pair(p):
    return tuple(p) if isinstance(p, list | tuple) else p


def _is_bias_pair(p) -> bool:
    return (
        isinstance(p, tuple)
        and len(p) == 2
        and is_int(p[0])
        and is_number(p[1])
        and math.isfinite(p[1])
    )


def logit_bias_from_json(value) -> tuple[tuple[int, float], ...]:
    """OpenAI's JSON form of logit_bias, {"token id": bias}, as (id, bias) pairs. Keys must
    be decimal token ids ("42"); the values are left for `SamplingParams.validate` to check."""
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be an object of token id -> bias, got {value!r:.60}")
    pairs = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdecimal()):
            raise ValueError(f"logit_bias: key {key!r:.40} is not a token id")
        pairs.append((int(key), bias))
    return tuple(pairs)


def resolve_seed(params: SamplingParams) -> int:
    """The request's seed, or a fresh one drawn on the host (called once, at admission)."""
    if params.seed is not None:
        return params.seed
    return secrets.randbits(32)


class SamplingBatch(NamedTuple):
    """Per-row sampling parameters as device arrays [B] (a pytree, so it crosses jit as is).

    `seed` (uint32) and `step` (int32, the request's decode step) name the row's PRNG key, so a
    draw depends only on the request and never on its row or on the rest of the batch.
    """

    temperature: jax.Array  # [B] f32, 0 = greedy
    top_p: jax.Array  # [B] f32
    top_k: jax.Array  # [B] int32, 0 = off
    min_p: jax.Array  # [B] f32
    repetition_penalty: jax.Array  # [B] f32
    presence_penalty: jax.Array  # [B] f32
    frequency_penalty: jax.Array  # [B] f32
    seed: jax.Array  # [B] uint32
    step: jax.Array  # [B] int32
    # The rows' logit_bias, padded with (0, 0.0): K = 1 when no row has one, else MAX_LOGIT_BIAS
    # (static, so a biased batch compiles once per bucket).
    bias_ids: jax.Array  # [B, K] int32
    bias_values: jax.Array  # [B, K] f32

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        steps: Sequence[int],
        bucket_size: int,
        seeds: Sequence[int] | None = None,
    ) -> SamplingBatch:
        """Pack `params` (one per live row) into arrays padded to `bucket_size`.

        `seeds` overrides each request's `seed` (the engine passes the ones it resolved at
        admission); a row with neither raises. Padding rows are greedy with neutral penalties,
        so they cost no draw and cannot produce NaN.
        """
        n = len(params)
        if n > bucket_size:
            raise ValueError(f"{n} rows do not fit bucket_size={bucket_size}")
        if len(steps) != n or (seeds is not None and len(seeds) != n):
            raise ValueError("params, steps and seeds must have the same length")
        temperature = np.zeros(bucket_size, np.float32)
        top_p = np.ones(bucket_size, np.float32)
        top_k = np.zeros(bucket_size, np.int32)
        min_p = np.zeros(bucket_size, np.float32)
        rep = np.ones(bucket_size, np.float32)
        pres = np.zeros(bucket_size, np.float32)
        freq = np.zeros(bucket_size, np.float32)
        seed = np.zeros(bucket_size, np.uint32)
        step = np.zeros(bucket_size, np.int32)
        k = MAX_LOGIT_BIAS if any(p.has_bias for p in params) else 1
        bias_ids = np.zeros((bucket_size, k), np.int32)
        bias_values = np.zeros((bucket_size, k), np.float32)
        for i, p in enumerate(params):
            s = seeds[i] if seeds is not None else p.seed
            if s is None:
                raise ValueError(f"row {i} has no seed; draw one at admission (resolve_seed)")
            temperature[i] = p.temperature if p.temperature >= GREEDY_EPS else 0.0
            top_p[i] = p.top_p
            top_k[i] = max(p.top_k, 0)
            min_p[i] = p.min_p
            rep[i] = p.repetition_penalty
            pres[i] = p.presence_penalty
            freq[i] = p.frequency_penalty
            # PRNG seeds are 32-bit on device (x64 off); any Python int maps onto one.
            seed[i] = s & 0xFFFFFFFF
            step[i] = steps[i]
            for j, (token, bias) in enumerate(p.logit_bias):
                bias_ids[i, j], bias_values[i, j] = token, bias
        arrays = (temperature, top_p, top_k, min_p, rep, pres, freq, seed, step)
        arrays += (bias_ids, bias_values)
        return cls(*arrays)  # numpy: jit takes it without a device_put per array


def row_keys(seed: jax.Array, step: jax.Array) -> jax.Array:
    """Typed PRNG keys [B]: fold_in(fold_in(key(0), seed_b), step_b)."""
    base = jax.random.key(0)
    return jax.vmap(lambda s, t: jax.random.fold_in(jax.random.fold_in(base, s), t))(seed, step)


def apply_penalties(
    logits: jax.Array, token_counts: jax.Array, prompt_mask: jax.Array, batch: SamplingBatch
) -> jax.Array:
    """Repetition, presence and frequency penalties (vLLM / HF rules) on logits [B, V] f32.

    token_counts [B, V] int32 counts only generated tokens; prompt_mask [B, V] bool marks prompt
    tokens. Repetition applies to tokens seen in prompt or output (positive logits divided,
    negative multiplied, so it always lowers them); presence and frequency apply to output only.
    """
    counts = token_counts.astype(jnp.float32)
    generated = token_counts > 0
    seen = prompt_mask | generated
    r = batch.repetition_penalty[:, None]
    penalised = jnp.where(logits > 0, logits / r, logits * r)
    logits = jnp.where(seen, penalised, logits)
    logits = logits - batch.presence_penalty[:, None] * generated.astype(jnp.float32)
    return logits - batch.frequency_penalty[:, None] * counts


def apply_bias(logits: jax.Array, batch: SamplingBatch) -> jax.Array:
    """logits [B, V] f32 plus each row's logit_bias. Padding entries add 0.0 to token 0, which
    leaves it as it was; a row's ids are distinct (`validate`), so the adds never collide."""
    rows = jnp.arange(logits.shape[0])[:, None]
    return jnp.asarray(logits).at[rows, batch.bias_ids].add(batch.bias_values)


def truncation_mask(scaled: jax.Array, batch: SamplingBatch) -> tuple[jax.Array, jax.Array]:
    """(keep [B, V] bool in descending order, order [B, V] token ids sorted by scaled logit).

    Applied in the order top-k, then top-p on the top-k-renormalised probabilities, then min-p
    (tokens with p < min_p * p_max dropped; the ratio does not depend on renormalisation). Sorting
    the whole row gives every rank a fixed position, so top-k is a mask on the rank rather than a
    `lax.top_k` whose k would be data-dependent. The top token is always kept: its exclusive
    cumulative probability is 0 < top_p and its p equals p_max >= min_p * p_max.
    """
    v = scaled.shape[-1]
    order = jnp.argsort(-scaled, axis=-1)
    ranked = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(v, dtype=jnp.int32)[None, :]
    k = jnp.where(batch.top_k > 0, batch.top_k, v)[:, None]
    keep = rank < k
    probs = jax.nn.softmax(jnp.where(keep, ranked, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= mass_before < batch.top_p[:, None]
    keep &= probs >= batch.min_p[:, None] * probs[:, :1]
    return keep, order


def sample(
    logits: jax.Array,
    batch: SamplingBatch,
    keys: jax.Array | None = None,
    *,
    num_top_logprobs: int = MAX_LOGPROBS,
) -> tuple[jax.Array, jax.Array, tuple[jax.Array, jax.Array]]:
    """Draw one token per row from logits [B, V] f32 (already penalised).

    Returns (tokens [B] int32, chosen logprob [B] f32, (top ids [B, N] int32, top values [B, N])).
    `keys` [B] defaults to `row_keys(batch.seed, batch.step)`; N = min(num_top_logprobs, V), static.

    Logprobs are the log_softmax of the logits as passed in: after penalties and logit_bias
    (`apply_bias`, which the callers apply first), before temperature
    and truncation (vLLM's default "raw" logprobs), so they describe the model, not the sampler,
    and a greedy row reports the same values as a sampled one.
    """
    if keys is None:
        keys = row_keys(batch.seed, batch.step)
    logits = logits.astype(jnp.float32)
    greedy = batch.temperature <= 0.0
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    # Greedy rows divide by 1 so their (unused) draw stays finite.
    temperature = jnp.where(greedy, 1.0, batch.temperature)[:, None]
    scaled = logits / temperature
    keep, order = truncation_mask(scaled, batch)
    ranked = jnp.take_along_axis(scaled, order, axis=-1)
    masked = jnp.where(keep, ranked, -jnp.inf)
    picked_rank = jax.vmap(jax.random.categorical)(keys, masked)
    drawn = jnp.take_along_axis(order, picked_rank[:, None], axis=-1)[:, 0].astype(jnp.int32)
    tokens = jnp.where(greedy, greedy_tokens, drawn)

    chosen, top_ids, top_values = token_logprobs(logits, tokens, num_top_logprobs)
    return tokens, chosen, (top_ids, top_values)


def token_logprobs(
    logits: jax.Array, tokens: jax.Array, num_top: int = MAX_LOGPROBS
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(chosen logprob [...], top ids [..., N] int32, top values [..., N]) of tokens [...]
    under logits [..., V] f32, N = min(num_top, V) (static): the log_softmax of the logits as
    passed in (see `sample`). The one logprob tail of every step that samples."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[..., None], axis=-1)[..., 0]
    # A toy vocabulary smaller than N would make top_k fail at trace time.
    top_values, top_ids = jax.lax.top_k(logprobs, min(num_top, logits.shape[-1]))
    return chosen, top_ids.astype(jnp.int32), top_values


def no_logprobs(tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`token_logprobs`' outputs for an all-greedy batch, which reports none: zeros and N = 1
    (the tokens), so the step's outputs keep one structure."""
    zero = jnp.zeros(tokens.shape, jnp.float32)
    return zero, tokens[..., None], zero[..., None]
