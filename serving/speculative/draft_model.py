"""Draft-model drafter: a smaller checkpoint with the same vocabulary, with its own caches.

Its caches mirror the target's layout (same page ids, block tables and state slots), so the
runner drives both with the same batches: the draft prefills each chunk the target prefills,
proposes k tokens greedily with k + 1 fused decode steps (the extra step consumes d_k, so that
the state after any accepted length exists; one step when no row drafts), and after the verify
rolls its KDA state and conv windows back to step `commit_lens - 1`, exactly like the target.
Its KV past the accepted length is overwritten by the next window. A draft of attention layers
only has no state to roll back: it keeps no per-step states and makes no rollback call (a
compiled call costs about 0.2 ms on a CPU, 7% of the built-in model's step).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kimi_linear_jax.cache import CacheLayout
from kimi_linear_jax.model import commit_kda, prefill_step, split_flat
from kimi_linear_jax.parallel.rules import init_cache
from serving.decode import decode_steps
from serving.speculative.drafter import Drafter
from serving.state_pool import copy_slots, reset_cache_slots


@functools.partial(jax.jit, donate_argnames=("cache",))
def _rollback(cache, per_step, slots, commit_lens):
    return commit_kda(cache, per_step, slots, commit_lens)


class DraftModelDrafter(Drafter):
    def __init__(self, model, layout: CacheLayout) -> None:
        """`model` is placed already (the engine builds it for the target's mesh when its
        shapes allow, else on one device); its caches follow its own plan, with the target's
        slots and pages (`layout`: the same ids, pages of the target's allocator page)."""
        self.config = model.config
        self.par = model.par
        self.has_state = model.has_recurrent_state
        self.graphdef, self.params = split_flat(model)
        self._new_cache = lambda: init_cache(
            self.config,
            model.par,
            num_slots=layout.num_slots,
            num_pages=layout.num_pages,
            page_size=layout.tokens_per_page,
            dtype=model.dtype,
        )
        self.cache = self._new_cache()
        self._per_step = None

    def prefill(self, ids, batch, fresh_slots, has_prefix: bool) -> None:
        if np.asarray(fresh_slots).any():
            self.cache = reset_cache_slots(self.cache, jnp.asarray(fresh_slots))
        _, self.cache = prefill_step(
            self.graphdef,
            self.params,
            ids,
            self.cache,
            batch,
            has_prefix=has_prefix,
            last_only=True,
        )

    def propose(self, requests, max_drafts, batch, k: int):
        b = int(batch.slots.shape[0])
        last = np.zeros(b, np.int32)
        num = np.zeros(b, np.int32)
        steps = np.zeros(b, np.int32)  # padding rows run no step
        for i, (request, n) in enumerate(zip(requests, max_drafts, strict=True)):
            last[i] = request.all_token_ids[-1]
            num[i] = n
            steps[i] = n + 1
        if not num.any():
            # No row drafts (adaptive drafting stopped them, or no room): one plain step keeps
            # the draft in step with the target; k idle steps more, with their states kept for
            # a rollback, would cost as much as the target's own step on a small model.
            _, _, self.cache = decode_steps(
                self.graphdef, self.params, last, self.cache, batch, steps, num_steps=1
            )
            self._per_step = None  # the step is the committed one: nothing to roll back
            return np.zeros((b, k), np.int32), num
        (tokens, *_), self._per_step, self.cache = decode_steps(
            self.graphdef,
            self.params,
            last,
            self.cache,
            batch,
            steps,
            num_steps=k + 1,
            keep_states=self.has_state,  # without: states None, so `rollback` does nothing
        )
        return tokens[:, :k], num

    def reset(self) -> None:
        self.cache, self._per_step = self._new_cache(), None

    def copy_slots(self, pairs, width: int) -> None:
        self.cache = copy_slots(self.cache, pairs, width)

    def rollback(self, slots, commit_lens) -> None:
        if self._per_step is not None:
            self.cache = _rollback(self.cache, self._per_step, slots, commit_lens)
            self._per_step = None
