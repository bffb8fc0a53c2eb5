"""Memory planning: how many latent pages and KDA state slots fit on each device.

Pure arithmetic on abstract shapes: weights from the sharding rules over `nnx.eval_shape`
(nothing is allocated, no device is needed), caches from the config. The engine
(`LLM(gpu_memory_utilization=...)`) and `kimi-linear-jax plan` both call `plan_memory`.

Per device:

    budget = device_memory x gpu_memory_utilization
    rest   = budget - weights - activation    (activation: the largest step's own buffers)
    state  = rest x r / (1 + r)               (r = state_memory_ratio: sglang's
                                               mamba_full_memory_ratio, 0.9), capped so the
                                               pages still hold one max_model_len sequence
    max_num_seqs: the sequences whose slots fit `state` (a request slot, its prefix-cache
                  checkpoint slots, the draft's slot and draft steps, each row's verify
                  window), capped by the caller (default 256, vLLM's max_num_seqs)
    pages  = (rest - what those sequences take) // page bytes   (state left unused goes here)

Dtypes: weights, MLA latents and conv windows in the model dtype; the KDA state S in fp32
whatever the weights.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import jax.numpy as jnp

from kimi_linear_jax.cache import CacheLayout
from kimi_linear_jax.parallel.footprint import (
    kv_bytes_per_token,
    padded_rows,
    prefill_bytes,
    replay_bytes_per_row,
    state_bytes_per_slot,
    step_bytes_per_row,
)
from kimi_linear_jax.parallel.mesh import validate
from kimi_linear_jax.parallel.weights import param_bytes_per_device

STATE_MEMORY_RATIO = 0.9  # sglang's mamba_full_memory_ratio default
MAX_NUM_SEQS = 256  # vLLM's default cap on running requests
CHECKPOINT_SLOTS_PER_SEQ = 2  # the engine's default: 2 x max_num_seqs prefix-cache slots
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)  # the engine's default row buckets

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: int | float | str) -> int:
    """Bytes from an int or a string such as "80GiB", "141GB", "1.5e9" (GB = 1e9, GiB = 2^30)."""
    if isinstance(value, bool):
        raise ValueError(f"device memory must be bytes or a size like '80GiB', got {value!r}")
    if isinstance(value, int | float):
        number, unit = float(value), ""
    else:
        m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(value).lower())
        if m is None or m[2] not in _UNITS:
            raise ValueError(f"device memory: cannot read {value!r} (use e.g. 80GiB or 141GB)")
        number, unit = float(m[1]), m[2]
    nbytes = int(number * _UNITS[unit])
    if not math.isfinite(number) or nbytes <= 0:
        raise ValueError(f"device memory must be > 0 bytes, got {value!r}")
    return nbytes


# ---- the plan ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Pools sized for one device of a device set (every device holds the same shapes)."""

    tensor_parallel_size: int
    dcp_size: int
    dtype: str
    device_memory_bytes: int
    gpu_memory_utilization: float
    budget_bytes: int
    weights_bytes_per_device: int
    activation_bytes: int
    activation_method: str  # "estimate" or "compiled"
    kv_bytes_per_token_per_device: float
    state_bytes_per_slot_per_device: int
    seq_bytes_per_device: int  # one running sequence's slots, draft steps and step buffers
    num_draft_tokens: int
    verify_bytes_per_seq: int  # of seq_bytes: the verify window's (and draft's) extra state
    draft_replicated: bool | None  # None: no draft model
    draft_kv_bytes_per_token_per_device: float
    draft_state_bytes_per_slot_per_device: int
    state_memory_ratio: float
    page_size: int
    tokens_per_page: int
    max_model_len: int
    num_pages: int
    num_state_slots: int
    max_num_seqs: int
    num_checkpoint_slots: int
    max_tokens_in_cache: int
    cache_bytes_per_device: int
    fits: bool
    reason: str | None

    def layout(self) -> CacheLayout:
        if not self.fits:
            raise ValueError(f"the plan does not fit: {self.reason}")
        return CacheLayout(
            self.num_pages,
            self.page_size,
            self.dcp_size,
            self.max_num_seqs,
            self.num_checkpoint_slots,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        """One line: weights, pages, tokens, slots per device (the engine logs it)."""
        if not self.fits:
            return f"memory plan does not fit: {self.reason}"
        return (
            f"memory plan per device (tp {self.tensor_parallel_size}, dcp {self.dcp_size}): "
            f"budget {_size(self.budget_bytes)}, weights {_size(self.weights_bytes_per_device)}, "
            f"activation {_size(self.activation_bytes)} ({self.activation_method}), "
            f"{self.num_pages} pages = {self.max_tokens_in_cache} tokens, "
            f"{self.num_state_slots} state slots, max_num_seqs {self.max_num_seqs}"
        )

    def table(self) -> str:
        """The plan as a two-column text table (the `plan` command's default output)."""
        seqs, ckpt = self.max_num_seqs, self.num_checkpoint_slots
        rows = [
            ("devices", f"tp {self.tensor_parallel_size} x dcp {self.dcp_size}"),
            ("dtype", f"{self.dtype} (KDA state float32)"),
            ("device memory", _size(self.device_memory_bytes)),
            ("budget", f"{_size(self.budget_bytes)} (x {self.gpu_memory_utilization})"),
            ("weights per device", _size(self.weights_bytes_per_device)),
            ("activation", f"{_size(self.activation_bytes)} ({self.activation_method})"),
            ("latent per token per device", f"{self.kv_bytes_per_token_per_device:,.1f} B"),
            ("KDA state per slot per device", _size(self.state_bytes_per_slot_per_device)),
            ("one running sequence", _size(self.seq_bytes_per_device)),
        ]
        if self.num_draft_tokens:
            rows.append(("verify window extra per sequence", _size(self.verify_bytes_per_seq)))
        if self.draft_replicated is not None:
            where = "replicated: x dcp_size" if self.draft_replicated else "sharded"
            kv = self.draft_kv_bytes_per_token_per_device
            rows.append(("draft latent per token", f"{kv:,.1f} B ({where})"))
        rows += [
            ("pages", f"{self.num_pages:,} x {self.tokens_per_page} tokens"),
            ("max tokens in cache", f"{self.max_tokens_in_cache:,}"),
            ("state slots", f"{self.num_state_slots:,} (1 null, {seqs} requests, {ckpt} ckpt)"),
            ("max_num_seqs", str(seqs)),
            ("max_model_len", f"{self.max_model_len:,}"),
            ("caches per device", _size(self.cache_bytes_per_device)),
            ("fits", "yes" if self.fits else f"no: {self.reason}"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _size(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (GiB for the release, KiB
    for test models)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


@dataclasses.dataclass(frozen=True)
class _Costs:
    """Bytes per device of each thing the split hands out."""

    slot: int  # one state slot (target + draft)
    seq: int  # one sequence's own share: its slots and the draft's steps
    row: int  # one padded row's step buffers (0 when the activation was measured)
    page: int  # one page (target + draft)
    fixed_slots: int  # the null slot and any fixed number of checkpoint slots
    buckets: tuple[int, ...]

    def step_buffers(self, seqs: int) -> int:
        """The decode step's row buffers for `seqs` sequences (padded to a row bucket)."""
        return padded_rows(seqs, self.buckets) * self.row if seqs else 0

    def state(self, seqs: int) -> int:
        """What `seqs` sequences take of the state share, their step buffers included."""
        return self.fixed_slots * self.slot + seqs * self.seq + self.step_buffers(seqs)


def plan_memory(
    config,
    *,
    device_memory: int | str,
    tensor_parallel_size: int = 1,
    dcp_size: int = 1,
    gpu_memory_utilization: float = 0.9,
    max_model_len: int | None = None,
    dtype: str = "bfloat16",
    page_size: int = 16,
    max_num_seqs: int | None = None,
    num_checkpoint_slots: int | None = None,
    enable_prefix_caching: bool = True,
    num_draft_tokens: int = 0,
    draft_config=None,
    state_memory_ratio: float = STATE_MEMORY_RATIO,
    max_num_batched_tokens: int = 256,
    batch_buckets: Sequence[int] = BATCH_BUCKETS,
    replicate_q_proj: bool = False,
    attention: str = "kernel",
    weights_bytes: int | None = None,
    activation_bytes: int | None = None,
) -> MemoryPlan:
    """Size the pools for `config` on devices of `device_memory` bytes (or "80GiB").

    `weights_bytes` / `activation_bytes`: what the engine measured (the weights it placed, the
    largest compiled step at `max_num_seqs` rows); else the abstract weights and the estimate
    (`prefill_bytes`, plus `step_bytes_per_row` for every padded row). `num_checkpoint_slots`
    None: 2 per sequence (the engine's default); none without prefix caching. `attention`:
    "kernel" (the Pallas kernel, a GPU) or "reference" (XLA's, which gathers each row's pages).
    """
    tp, dcp = tensor_parallel_size, dcp_size
    validate(config, tp, dcp, num_devices=tp)
    max_model_len = config.model_max_length if max_model_len is None else max_model_len
    _check_counts(max_model_len, page_size, max_num_seqs, num_checkpoint_slots, num_draft_tokens)
    _check_options(gpu_memory_utilization, state_memory_ratio, max_num_batched_tokens, attention)
    if activation_bytes is not None and max_num_seqs is None:
        raise ValueError("activation_bytes (measured) needs the max_num_seqs it was measured at")
    item = jnp.dtype(dtype).itemsize
    memory = parse_bytes(device_memory)
    budget = int(memory * gpu_memory_utilization)
    draft = _draft(draft_config, tp, dcp, dtype, page_size)
    if weights_bytes is None:
        weights_bytes = (
            draft.weights
            + param_bytes_per_device(
                config, tp, dcp, dtype=jnp.dtype(dtype), replicate_q_proj=replicate_q_proj
            )[0]
        )
    measured = activation_bytes is not None
    context = max_model_len if attention == "reference" else 0
    if not measured:
        activation_bytes = prefill_bytes(config, tp, dcp, max_num_batched_tokens, item, context)
    row = (
        0 if measured else step_bytes_per_row(config, tp, dcp, item, num_draft_tokens + 1, context)
    )
    state = state_bytes_per_slot(config, tp, item)
    # A verify row's replay inputs (in `row`) and the draft model's per-step states (in `seq`).
    k = num_draft_tokens
    verify_bytes = replay_bytes_per_row(config, tp, item, k + 1) + k * draft.state if k else 0
    # Checkpoint slots: 2 per sequence by default, or a fixed count; none without the cache.
    per_seq = CHECKPOINT_SLOTS_PER_SEQ if num_checkpoint_slots is None else 0
    fixed_ckpt = num_checkpoint_slots or 0
    if not enable_prefix_caching:
        per_seq = fixed_ckpt = 0
    costs = _Costs(
        slot=state + draft.state,
        seq=(1 + per_seq) * (state + draft.state) + num_draft_tokens * draft.state,
        row=row,
        page=page_size * len(config.mla_layer_ids) * config.latent_dim * item + draft.page,
        fixed_slots=1 + fixed_ckpt,
        buckets=tuple(batch_buckets),
    )
    rest = budget - weights_bytes - activation_bytes
    cap = MAX_NUM_SEQS if max_num_seqs is None else max_num_seqs
    if rest > 0:
        seqs, pages, reason = _split(
            rest, costs, cap, max_model_len, page_size * dcp, state_memory_ratio
        )
    else:
        seqs, pages = 0, 0
        reason = (
            f"weights {_size(weights_bytes)} + activation {_size(activation_bytes)} per device "
            f"exceed the budget {_size(budget)} (device memory x {gpu_memory_utilization}); use "
            "more devices (tensor_parallel_size) or larger ones"
        )
    ckpt = seqs * per_seq + fixed_ckpt if reason is None else 0
    slots = 1 + seqs + ckpt if reason is None else 0
    return MemoryPlan(
        tensor_parallel_size=tp,
        dcp_size=dcp,
        dtype=str(jnp.dtype(dtype)),
        device_memory_bytes=memory,
        gpu_memory_utilization=gpu_memory_utilization,
        budget_bytes=budget,
        weights_bytes_per_device=weights_bytes,
        activation_bytes=activation_bytes + costs.step_buffers(seqs),
        activation_method="compiled" if measured else "estimate",
        kv_bytes_per_token_per_device=kv_bytes_per_token(config, dcp, item),
        state_bytes_per_slot_per_device=state,
        seq_bytes_per_device=costs.seq + row,
        num_draft_tokens=num_draft_tokens,
        verify_bytes_per_seq=verify_bytes,
        draft_replicated=draft.replicated,
        draft_kv_bytes_per_token_per_device=draft.page / (page_size * dcp),
        draft_state_bytes_per_slot_per_device=draft.state,
        state_memory_ratio=state_memory_ratio,
        page_size=page_size,
        tokens_per_page=page_size * dcp,
        max_model_len=max_model_len,
        num_pages=pages,
        num_state_slots=slots,
        max_num_seqs=seqs,
        num_checkpoint_slots=ckpt,
        max_tokens_in_cache=max(pages - 1, 0) * page_size * dcp,
        cache_bytes_per_device=pages * costs.page + slots * costs.slot,
        fits=reason is None,
        reason=reason,
    )


def _split(rest: int, costs: _Costs, cap: int, max_model_len: int, tokens_per_page: int, r: float):
    """(max_num_seqs, num_pages, reason or None): sglang's hybrid split of `rest` bytes."""
    min_pages = 1 + -(-max_model_len // tokens_per_page)  # the null page and one sequence
    share = min(int(rest * r / (1 + r)), rest - min_pages * costs.page)
    if share < costs.state(1):
        if rest - min_pages * costs.page < costs.state(1):
            latents, state = _size(min_pages * costs.page), _size(costs.state(1))
            reason = (
                f"{_size(rest)} per device left after weights and activation cannot hold one "
                f"{max_model_len}-token sequence (latents {latents}, state {state}); lower "
                "max_model_len or raise dcp_size / tensor_parallel_size"
            )
            return 0, 0, reason
        return 0, 0, f"state_memory_ratio {r} leaves no room for one sequence's state"
    # The largest count whose slots and padded rows fit the share (costs.state is monotone;
    # padded rows are at least the rows, so `hi` bounds it).
    hi = (share - costs.fixed_slots * costs.slot) // (costs.seq + costs.row)
    lo, hi = 1, max(1, min(cap, hi))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if costs.state(mid) <= share else (lo, mid - 1)
    return lo, (rest - costs.state(lo)) // costs.page, None


@dataclasses.dataclass(frozen=True)
class _Draft:
    """A draft model's bytes per device (zeros without one)."""

    weights: int = 0
    state: int = 0  # per state slot
    page: int = 0  # per page
    replicated: bool | None = None


def _draft(config, tp: int, dcp: int, dtype: str, page_size: int) -> _Draft:
    """The draft shares the target's mesh when its shapes divide by tp (the engine's rule);
    else it runs whole on one device, its pool too: a virtual page of page_size * dcp tokens
    sits whole there, dcp times a sharded page's latents."""
    if config is None:
        return _Draft()
    item = jnp.dtype(dtype).itemsize
    row = len(config.mla_layer_ids) * config.latent_dim * item
    try:
        validate(config, tp, dcp, num_devices=tp)
    except ValueError:
        weights = param_bytes_per_device(config, 1, 1, dtype=jnp.dtype(dtype))[0]
        return _Draft(weights, state_bytes_per_slot(config, 1, item), page_size * dcp * row, True)
    weights = param_bytes_per_device(config, tp, dcp, dtype=jnp.dtype(dtype))[0]
    return _Draft(weights, state_bytes_per_slot(config, tp, item), page_size * row, False)


def _check_counts(max_model_len, page_size, max_num_seqs, num_checkpoint_slots, k) -> None:
    for name, value, low in (
        ("max_model_len", max_model_len, 1),
        ("page_size", page_size, 1),
        ("max_num_seqs", max_num_seqs, 1),
        ("num_checkpoint_slots", num_checkpoint_slots, 0),
        ("num_draft_tokens", k, 0),
    ):
        ok = value is None or (isinstance(value, int) and not isinstance(value, bool))
        if not ok or (value is not None and value < low):
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _check_options(utilization, ratio, tokens, attention) -> None:
    if attention not in ("kernel", "reference", "interpret"):
        raise ValueError(f"attention must be kernel, reference or interpret, got {attention!r}")
    if isinstance(utilization, bool) or not isinstance(utilization, int | float):
        raise ValueError(f"gpu_memory_utilization must be a number, got {utilization!r}")
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
    if not isinstance(ratio, int | float) or not ratio > 0 or not math.isfinite(ratio):
        raise ValueError(f"state_memory_ratio must be a finite number > 0, got {ratio!r}")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be an integer >= 1, got {tokens!r}")
