"""Explicit cache pytrees. They are passed into jitted steps and returned, never module state.

- `KDAState` per KDA layer, indexed by a request's state slot (slot 0 is the null slot that
  padding rows point at): the three pre-conv windows and the recurrent state S (fp32).
- `MLACache` per MLA layer: paged latent rows `[num_pages, page_size, L + R]`, reached through
  a block table. A contiguous per-sequence cache is the special case of one page a sequence.
- `Batch`: the metadata of one step, all arrays, so one compiled step serves any batch of the
  same bucket shape.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kimi_linear_jax.config import KimiLinearConfig


class KDAState(NamedTuple):
    conv_q: jax.Array  # [slots, W-1, P]
    conv_k: jax.Array  # [slots, W-1, P]
    conv_v: jax.Array  # [slots, W-1, P]
    S: jax.Array  # [slots, H, K, V] float32


class KDAInputs(NamedTuple):
    """What a verify window keeps per KDA layer for a replay commit: the recurrence's per-step
    inputs, O(T*H*K) per row, instead of the state after every step, O(T*H*K*V) (at the
    release's shapes, k = 4, about 40x less). Step axis 1, as the per-step states."""

    pre_q: jax.Array  # [B, T, P] pre-conv projections: the conv windows continue from them
    pre_k: jax.Array  # [B, T, P]
    pre_v: jax.Array  # [B, T, P]
    k: jax.Array  # [B, T, H, K] conv'd, normalised, fp32
    v: jax.Array  # [B, T, H, V]
    g: jax.Array  # [B, T, H, K] log-decay
    beta: jax.Array  # [B, T, H]


class MLACache(NamedTuple):
    latent: jax.Array  # [num_pages, page_size, L + R]


class ModelCache(NamedTuple):
    kda: tuple[KDAState, ...]  # one per KDA layer, in layer order
    mla: tuple[MLACache, ...]  # one per MLA layer, in layer order


class Batch(NamedTuple):
    """Metadata of one cached step over B rows of T tokens (right padded).

    slots [B]: state slot of each row (0 for padding rows); block_table [B, max_pages]: page ids;
    start [B]: tokens of the row already in the cache; lengths [B]: valid new tokens (<= T).
    """

    slots: jax.Array
    block_table: jax.Array
    start: jax.Array
    lengths: jax.Array


# The chunked KDA prefill holds the state at every multiple of its chunk.
KDA_CHUNK = 64


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Where things live in the caches; the one place that says it.

    State slots (one KDA state + conv windows each): slot 0 is the null slot that padding rows
    point at, then one slot per running request, then the prefix cache's checkpoint slots, all
    in the same arrays so a restore or snapshot is one on-device copy. Pages: page 0 is the null
    page; an allocator page holds `page_size` tokens on each of the `dcp_size` DCP ranks.
    """

    num_pages: int
    page_size: int  # tokens of a page on one device
    dcp_size: int = 1
    max_num_seqs: int = 1
    num_checkpoint_slots: int = 0

    NULL_SLOT: ClassVar[int] = 0
    NULL_PAGE: ClassVar[int] = 0

    @property
    def tokens_per_page(self) -> int:
        """An allocator (virtual) page: page_size on every DCP rank."""
        return self.page_size * self.dcp_size

    @property
    def request_slots(self) -> range:
        return range(1, self.max_num_seqs + 1)

    @property
    def checkpoint_slots(self) -> range:
        first = self.max_num_seqs + 1
        return range(first, first + self.num_checkpoint_slots)

    @property
    def num_slots(self) -> int:
        return self.max_num_seqs + 1 + self.num_checkpoint_slots

    @property
    def pool_tokens(self) -> int:
        """Tokens the page pool holds (every page but the null page)."""
        return (self.num_pages - 1) * self.tokens_per_page

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_page)

    @property
    def checkpoint_grid(self) -> int:
        """lcm(state_chunk, tree_page): the depths where recurrent-state checkpoints may live
        (state_chunk = max(KDA chunk, page_size), tree_page = the allocator page)."""
        return math.lcm(max(KDA_CHUNK, self.page_size), self.tokens_per_page)


def init_kda_state(config: KimiLinearConfig, num_slots: int, dtype) -> KDAState:
    W = config.short_conv_kernel_size
    P = config.kda_dim
    H, d = config.linear_num_heads, config.linear_head_dim
    # Distinct buffers (not one shared zeros array): the caches are donated to jitted steps.
    windows = [jnp.zeros((num_slots, W - 1, P), dtype) for _ in range(3)]
    return KDAState(*windows, jnp.zeros((num_slots, H, d, d), jnp.float32))


def init_cache(
    config: KimiLinearConfig, *, num_slots: int, num_pages: int, page_size: int, dtype
) -> ModelCache:
    """Zeroed caches for `num_slots` state slots and `num_pages` latent pages per MLA layer."""
    kda = tuple(init_kda_state(config, num_slots, dtype) for _ in config.kda_layer_ids)
    shape = (num_pages, page_size, config.latent_dim)
    mla = tuple(MLACache(jnp.zeros(shape, dtype)) for _ in config.mla_layer_ids)
    return ModelCache(kda, mla)


def contiguous_batch(
    batch_size: int, max_len: int, page_size: int, *, start=None, lengths=None
) -> Batch:
    """A Batch for `batch_size` sequences with private pages and slots 1..B.

    Sequence b owns pages [b * n, (b + 1) * n) with n = ceil(max_len / page_size); the cache
    then needs `batch_size * n` pages and `batch_size + 1` slots.
    """
    n = -(-max_len // page_size)
    table = np.arange(batch_size * n, dtype=np.int32).reshape(batch_size, n)
    zeros = np.zeros(batch_size, np.int32)
    return Batch(
        slots=jnp.arange(1, batch_size + 1, dtype=jnp.int32),
        block_table=jnp.asarray(table),
        start=jnp.asarray(zeros if start is None else start, jnp.int32),
        lengths=jnp.asarray(zeros if lengths is None else lengths, jnp.int32),
    )
