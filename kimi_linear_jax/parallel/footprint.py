"""Bytes per device of each thing the memory planner (`parallel/plan.py`) hands out: a
token's latents, a state slot, a step's transient buffers. Arithmetic on the config alone.

Dtypes: MLA latents and conv windows in the model dtype (`itemsize`), the KDA state S fp32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kimi_linear_jax.cache import KDA_CHUNK

S_ITEMSIZE = 4  # the KDA state S is fp32 whatever the weights
# Bytes per vocabulary entry of one sampled row: f32 logits, probabilities and the sorted
# copy top-p / top-k keep, int32 penalty counts and a bool prompt mask.
SAMPLING_BYTES_PER_VOCAB = 3 * 4 + 4 + 1


def kv_bytes_per_token(config, dcp: int, itemsize: int) -> float:
    """MLA latent bytes of one token per device: every MLA layer's [L + R] row, spread over the
    DCP group by token."""
    return len(config.mla_layer_ids) * config.latent_dim * itemsize / dcp


def state_bytes_per_slot(config, tp: int, itemsize: int) -> int:
    """One state slot per device: per KDA layer, S [H/tp, K, V] in fp32 and the three conv
    windows [W-1, H*d/tp] in the model dtype (both sharded by heads over the TP group)."""
    H, d, W = config.linear_num_heads, config.linear_head_dim, config.short_conv_kernel_size
    per_layer = (H // tp) * d * d * S_ITEMSIZE + 3 * (W - 1) * (config.kda_dim // tp) * itemsize
    return len(config.kda_layer_ids) * per_layer


def replay_bytes_per_row(config, tp: int, itemsize: int, window: int) -> int:
    """What a verify window keeps per row for its replay commit (`KDAInputs`), per device: per
    KDA layer and window token, the three pre-conv projections [H*d/tp] in the model dtype and
    k, g [H/tp, K], v [H/tp, V], beta [H/tp] in fp32."""
    H, d = config.linear_num_heads // tp, config.linear_head_dim
    per_token = 3 * H * d * itemsize + (3 * H * d + H) * S_ITEMSIZE
    return len(config.kda_layer_ids) * window * per_token


def step_bytes_per_row(
    config, tp: int, dcp: int, itemsize: int, window: int, reference_context: int = 0
) -> int:
    """A decode (window 1) or verify (window k + 1) row's transient buffers: the row's gathered
    state and the one its commit writes, a verify's per-step inputs for the replay commit, the
    sampling of each window token over the whole vocabulary, and with the XLA reference
    attention (`reference_context` tokens; 0 for the paged kernel) its gathered pages and
    scores."""
    states = 2 * state_bytes_per_slot(config, tp, itemsize)
    replay = replay_bytes_per_row(config, tp, itemsize, window) if window > 1 else 0
    sampling = window * config.vocab_size * SAMPLING_BYTES_PER_VOCAB
    context = reference_bytes(config, tp, dcp, itemsize, window, reference_context)
    return states + replay + sampling + context


def reference_bytes(config, tp: int, dcp: int, itemsize: int, tokens: int, context: int) -> int:
    """The XLA reference attention of one row of `tokens` queries over `context` cached tokens
    (the Pallas kernel on a GPU reads the pages in place): the row's gathered latents, in the
    cache dtype and as f32, and the scores, their sum and the probabilities [tokens, group
    heads, context] (f32), on the context's 1/dcp share."""
    if not context:
        return 0
    local, heads = -(-context // dcp), config.num_attention_heads // tp * dcp
    return local * (config.latent_dim * (itemsize + 4) + 3 * tokens * heads * 4)


def prefill_bytes(
    config, tp: int, dcp: int, tokens: int, itemsize: int, reference_context: int = 0
) -> int:
    """Estimated buffers of a prefill step of `tokens` tokens, per device: the largest layer's
    (XLA frees a layer's buffers before the next) plus the residual stream. f32 throughout,
    an upper bound for bf16 models.

    - MoE: tokens are replicated, so every device holds all N*k (token, expert) rows: the
      gathered inputs and outputs [N*k, D], gate, up and their product [N*k, I].
    - MLA: the chunk's own heads expanded to keys and values [N, H/tp, 2 (R + nope) + V],
      its scores and probabilities [N, H/tp, N], the group's latent query and output
      [N, H*dcp/tp, L + R]; the paged kernel reads the cached prefix without a score matrix,
      the XLA reference (`reference_context`) gathers it as one row of N queries.
    - KDA: q, k, v, g, o [N, H*d/tp] and the chunked form's state at every chunk boundary.
    """
    N, f32 = tokens, 4
    D, k = config.hidden_size, config.num_experts_per_token
    moe = N * k * (2 * D + 3 * config.moe_intermediate_size) * f32 if config.num_experts else 0
    dense = 3 * N * config.intermediate_size // tp * f32
    h = config.num_attention_heads // tp
    head = config.qk_head_dim + config.qk_rope_head_dim + config.v_head_dim
    mla = (N * h * (head + 2 * N) + 2 * N * h * dcp * config.latent_dim) * f32
    mla += reference_bytes(config, tp, dcp, itemsize, N, reference_context)
    H, d = config.linear_num_heads // tp, config.linear_head_dim
    kda = (5 * N * H * d + math.ceil(N / KDA_CHUNK) * H * d * d) * f32
    return max(moe, dense, mla, kda) + 4 * N * D * f32


def padded_rows(n: int, buckets: Sequence[int]) -> int:
    """The rows a step of n rows compiles for, as the runner pads them: the smallest bucket
    that holds them, past the largest the next multiple of it."""
    for b in sorted(buckets):
        if b >= n:
            return b
    top = max(buckets)
    return -(-n // top) * top
