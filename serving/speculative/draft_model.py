"""Draft-model drafter: a smaller checkpoint with the same vocabulary, with its own caches.

Its caches mirror the target's layout (same page ids, block tables and state slots), so the
runner drives both with the same batches: the draft prefills each chunk the target prefills,
proposes k tokens greedily with k + 1 fused decode steps (the extra step consumes d_k, so that
the state after any accepted length exists), and after the verify rolls its KDA state and conv
windows back to step `commit_lens - 1`, exactly like the target. Its KV past the accepted
length is overwritten by the next window. A draft of attention layers only has no state to
roll back: it keeps no per-step states and makes no rollback call (a compiled call costs about
0.2 ms on a CPU, 7% of the built-in model's step).

A row that rests (no drafts this step) runs no draft step: its last token joins the slot's
`Lag`, written in one window pass before the draft next runs for it, before its state is
copied, or once the lag is full. That pass computes the draft's logits at every lag position,
so under cost-aware widths (`keep_shadows`) it also scores them: whether the draft's greedy
token was the one that followed (`take_shadows`), which measures a resting request's drafts
with no probe window. With lookup first, a step in which no row drafts may go on as plain
steps on device (`Verifier._until_recurs`, `recurrence_n`), cut where stepping would have
drafted with the model (`run_steps`); the run's tokens join the lags (`ran`).

Lookup first (`lookup`, `lookup.py`): a row whose context recurs drafts by prompt lookup
instead, up to `lookup_tokens` tokens, and runs no draft-model step; after the verify the draft
writes that row's accepted tokens (from the verify's accepted lengths, on device), so, lags
aside, every row's draft cache holds exactly the target's tokens, as prefix caching and
preemption assume. The model's own windows stay `num_draft_tokens` wide, judged by their own
record (`DraftRecord`): their misses rested whole requests, lookup windows too.

Track points: where the target's verify snapshots a row's state for the prefix cache, a draft
with KDA layers writes its own state after the same window step into the same slot of its
cache (from its window's per-step states, from the catch-up pass, or, for a resting row, from
its slot), since a prefix hit copies that slot in both caches.

Trees (`propose_tree`, `draft_tree.py`): the same greedy chain, each depth's top-k tokens as
siblings. After the verify (`rollback_tree`) a row commits its per-step state at the end of
the chain part of its accepted path and one pass writes the rest (at most the leaf it ended
on) from there, KV and state, as the catch-up of lookup rows does for whole paths: the caches
then hold exactly the accepted tokens, as after a chain verify. The slot itself no longer
holds the state before the window (each fused step commits), so that is the only way back.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kimi_linear_jax.cache import CacheLayout
from kimi_linear_jax.model import prefill_step, split_flat
from kimi_linear_jax.parallel.rules import layout_cache
from serving.core.decode import decode_steps
from serving.core.state_pool import copy_slots, reset_cache_slots
from serving.speculative.draft_tree import depth_for, tree_drafts, tree_parents
from serving.speculative.draft_writes import (
    catch_up,
    commit_window,
    track_resting,
    tree_rollback,
    write_lag,
)
from serving.speculative.drafter import Drafter, DraftRecord, pack_trees
from serving.speculative.lag import LAG_WIDTHS, Lag
from serving.speculative.lookup import Ahead, look_up, lookup_window


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "depth", "keep_states", "top_k"),
    donate_argnames=("cache",),
)
def draft_steps(graphdef, params, last, cache, batch, steps, *, depth, keep_states, top_k):
    """`depth` fused greedy draft steps and one more (`decode_steps`): (each drafted step's
    `top_k` best tokens [B, depth, top_k], the picked ones [B, depth], per-step states,
    cache). The slices are this program's: taken eagerly on the host, two slices of a
    window's drafts cost 0.3 ms, a tenth of a model window at B = 1 on a CPU."""
    (_, _, top, _), per_step, cache = decode_steps(
        graphdef,
        params,
        last,
        cache,
        batch,
        steps,
        num_steps=depth + 1,
        keep_states=keep_states,
        top_k=top_k,
    )
    return top[:, :depth], top[:, :depth, 0], per_step, cache


class DraftModelDrafter(Drafter):
    def __init__(
        self,
        model,
        layout: CacheLayout,
        *,
        num_draft_tokens: int | None = None,
        lookup: Drafter | None = None,
        lookup_tokens: int = 0,
        min_acceptance: float = 0.0,
    ) -> None:
        """`model` is placed already (the engine builds it for the target's mesh when its
        shapes allow, else on one device); its caches follow its own plan, with the target's
        slots and pages (`layout`: the same ids, pages of the target's allocator page).
        `num_draft_tokens`: the model's drafts per window (None: the runner's k); `lookup`: a
        host drafter tried first, for up to `lookup_tokens` drafts, the model drafting where
        its own acceptance is `min_acceptance` or above (with lookup only)."""
        self.num_draft_tokens = num_draft_tokens
        self.lookup = lookup
        self.lookup_tokens = lookup_tokens
        self.min_acceptance = min_acceptance if lookup is not None else 0.0
        self._window = None  # lookup rows of the last window: (rows, window ids, batch)
        self._ahead = Ahead()  # the lookup drafts `plan` found for this step's `propose`
        self.lookup_draft_tokens = 0  # drafts proposed by lookup (metrics)
        self.config = model.config
        self.par = model.par
        self.has_state = model.has_recurrent_state
        self.graphdef, self.params = split_flat(model)
        self._new_cache = functools.partial(layout_cache, model, layout)
        self.cache = self._new_cache()
        self._per_step = None  # the last window's per-step KDA states, for the rollback
        self._model_rows = None  # the rows the draft model ran for in the last window
        self._tree = None  # the last tree window: (chain [B, D], lookup rows, batch, topk)
        self.lag = Lag()
        self._lag_hits: list = []
        self.lag_passes = 0  # lag passes written (a step that wrote one is not a price)

    def prefill(self, ids, batch, fresh_slots, has_prefix: bool) -> None:
        self.lag.drop(fresh_slots)
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

    def propose(self, requests, max_drafts, batch, k: int, checkpointed=()):
        b = int(batch.slots.shape[0])
        k_model = min(self.num_draft_tokens or k, k)
        looked = self._look_up(requests, max_drafts, b)
        last, num, steps = self._rows(requests, max_drafts, looked, k_model, topk=1)
        model = [r.request_id for r, s in zip(requests, steps[: len(requests)], strict=True) if s]
        self.ungated = frozenset(model if self._apart else ())
        self._flush_lags(requests, batch, last, steps, looked, checkpointed)
        model_rows = steps > 0
        window = lookup_window(looked, last, k)
        self._window = None if window is None else (*window, batch)
        self._model_rows, self._tree = model_rows, None
        top = self._model_drafts(last, batch, steps, k_model, topk=1)
        tokens = None if top is None else top[1]
        if self._window is None:
            return (np.zeros((b, k), np.int32) if tokens is None else tokens), num
        drafts = self._window[1][:, 1:]
        if tokens is not None:  # on device: the verify reads the drafts without a host sync
            padded = jnp.pad(tokens, ((0, 0), (0, k - k_model)))
            drafts = jnp.where(jnp.asarray(model_rows)[:, None], padded, drafts)
        return drafts, num

    def propose_tree(self, requests, max_nodes, batch, n: int, topk: int, checkpointed=()):
        """The model's top-k trees (`draft_tree.py`) of up to min(num_draft_tokens, n)
        nodes; lookup rows draft their lookup's tree. Drafts on device, parents on the host."""
        b = int(batch.slots.shape[0])
        n_model = min(self.num_draft_tokens or n, n)
        looked = [nodes[:n] for nodes in self._look_up(requests, max_nodes, b, topk)]
        last, num, steps = self._rows(requests, max_nodes, looked, n_model, topk)
        self._flush_lags(requests, batch, last, steps, looked, checkpointed)
        model_rows = steps > 0
        lookup_rows = np.array([bool(nodes) for nodes in looked], bool)
        self._model_rows, self._window = model_rows, None
        top = self._model_drafts(last, batch, steps, depth_for(n_model, topk), topk)
        top, chain = (None, None) if top is None else top
        drafts, parents, _ = pack_trees(looked, b, n)
        parents = np.where(model_rows[:, None], tree_parents(num, n, topk), parents)
        self._tree = (chain, lookup_rows, batch, topk)
        if top is not None:
            drafts = tree_drafts(top, num, model_rows, drafts, n=n)
        return drafts, parents, num

    def _rows(self, requests, max_drafts, looked, k_model: int, topk: int):
        """(last tokens, drafts or nodes, draft steps) per row: lookup rows draft what they
        looked up and, like padding and resting rows, run no step; model rows a chain deep
        enough for their nodes, and one step more."""
        b = len(looked)
        last, num, steps = (np.zeros(b, np.int32) for _ in range(3))
        for i, (request, n) in enumerate(zip(requests, max_drafts, strict=True)):
            last[i] = request.all_token_ids[-1]
            if looked[i]:
                num[i] = len(looked[i])
                self.lookup_draft_tokens += int(num[i])
                continue
            num[i] = min(n, k_model) if self._may_draft(request, n) else 0
            steps[i] = depth_for(num[i], topk) + 1 if num[i] else 0
        return last, num, steps

    @property
    def _apart(self) -> bool:
        """Lookup first, gated (`min_acceptance`) or under cost-aware widths: the model's
        drafts are judged by their own record (`DraftRecord`), the lookup's by the request's
        acceptance. Counted together, each kind's misses held the other back."""
        return self.lookup is not None and (self.min_acceptance > 0 or self.keep_shadows)

    @staticmethod
    def _record(request) -> DraftRecord:
        request.drafter_state = request.drafter_state or DraftRecord()
        return request.drafter_state

    def _may_draft(self, request, room: int) -> bool:
        # Without lookup the scheduler gates the model's drafts; with it, the model's record.
        if not self.min_acceptance or room <= 0:
            return True
        return self._record(request).may_draft(self.min_acceptance)

    def verified(self, requests, accepted, drafts) -> None:
        # Score the model's own windows (`ungated`); lookup windows count for the scheduler.
        for i, request in enumerate(requests):
            if request.request_id in self.ungated and drafts[i]:
                record = self._record(request)
                record.score(accepted[i] / drafts[i])
                record.count(int(accepted[i]), int(drafts[i]))

    def own_shadows(self, request, hits: list[bool]) -> list[bool]:
        # The lag pass scores the model's drafts: its record's, when judged apart.
        if not self._apart:
            return hits
        for hit in hits:
            self._record(request).count(int(hit), 1)
        return []

    def shadow(self, request) -> int | None:
        # Judged apart, a resting request's acceptance is its lookup's: measured for free.
        return self.lookup.shadow(request) if self._apart else None

    @property
    def lookup_first(self) -> bool:
        return self.lookup is not None

    def plan(self, requests, max_drafts):
        """(lookup drafts, model drafts, the model's acceptance) per row with `max_drafts`
        room (a row drafts one way), the lookup's kept for `propose`; None without lookup."""
        if self.lookup is None:
            return None
        looked = look_up(self.lookup, self.lookup_tokens, requests, max_drafts, len(requests))
        self._ahead.keep(requests, looked)
        k = self.num_draft_tokens or max(max_drafts, default=0)
        model = [0 if d or n <= 0 else min(n, k) for d, n in zip(looked, max_drafts, strict=True)]
        alphas = [self._record(r).alpha if self._apart else r.spec_alpha for r in requests]
        return [len(d) for d in looked], model, alphas

    def _look_up(self, requests, max_drafts, b: int, topk: int | None = None) -> list[list]:
        """Each row's lookup drafts (those `plan` found, if it ran for this step), or its
        tree's nodes with `topk`."""
        kept = self._ahead.take(requests, max_drafts) if topk is None else None
        if kept is not None:
            return kept + [[] for _ in range(b - len(kept))]
        return look_up(self.lookup, self.lookup_tokens, requests, max_drafts, b, topk)

    def _model_drafts(self, last, batch, steps, depth: int, topk: int):
        """The draft model's part of the window: `depth` greedy drafts and one step more for
        the rows with `steps`, as (each step's `topk` best tokens, the picked one first [B,
        depth, topk], the picked ones [B, depth]) on device, or None when none drafts."""
        self._per_step = None
        if not steps.any():
            return None
        top, chain, self._per_step, self.cache = draft_steps(
            self.graphdef,
            self.params,
            last,
            self.cache,
            batch,
            steps,
            depth=depth,
            keep_states=self.has_state,  # without: states None, so `rollback` does nothing
            top_k=topk,
        )
        return top, chain

    def _flush_lags(self, requests, batch, last, steps, looked, checkpointed) -> None:
        """Resting rows add their last token to their slot's lag; then the lags of the rows
        the draft runs for in this window (model or lookup drafts) are written, so that those
        slots hold every token before `last`, and those of the full and the checkpointed rows
        (the prefix cache may hand their pages to another request's draft)."""
        slots = np.asarray(batch.slots)
        due = []
        for i in range(len(requests)):
            if steps[i] or looked[i]:
                due.append(slots[i])
                continue
            self.lag.add(slots[i], batch.start[i], last[i], np.asarray(batch.block_table[i]))
            if self.lag.full(slots[i]) or i in checkpointed:
                due.append(slots[i])
        self._write_lags(due, len(slots))

    def _write_lags(self, slots, rows: int) -> None:
        work = self.lag.take(slots, rows)
        if work is not None:
            ids, lag = work
            self.cache, hits = write_lag(self.graphdef, self.params, ids, self.cache, lag)
            self.lag_passes += 1
            if self.keep_shadows:  # cost-aware widths: `take_shadows` drains them
                self._lag_hits.append((lag.slots, lag.lengths, hits))

    # A draft step costs a model step, but a resting row's shadows come with its lag pass.
    shadows = True

    def take_shadows(self) -> dict[int, list[bool]]:
        """The lags written since the last call, scored: slot -> whether the draft's greedy
        token at each lag position but the last was the token that followed, in order."""
        taken, self._lag_hits = self._lag_hits, []
        out: dict[int, list[bool]] = {}
        for slots, lengths, hits in taken:
            hits = np.asarray(hits)
            for i, (slot, n) in enumerate(zip(slots, lengths, strict=True)):
                out.setdefault(int(slot), []).extend(hits[i, : max(n - 1, 0)].tolist())
        return {slot: h for slot, h in out.items() if h}

    lag_widths = LAG_WIDTHS

    def padding_lag(self, batch, width: int = 1):
        ids = np.zeros((int(batch.slots.shape[0]), width), np.int32)
        self.cache, hits = write_lag(self.graphdef, self.params, ids, self.cache, batch)
        return hits

    def starts_rest(self, slots) -> bool:
        return not all(self.lag.pending(s) for s in slots)

    @property
    def recurrence_n(self) -> int | None:
        # Lookup first: in a step where no row drafted, the model rests (gated, or by the
        # cost-aware widths) and lookup found nothing; lookup drafts again where the n-gram
        # would, and the model no sooner than `run_steps` allows. So such steps run on
        # device as the n-gram drafter's do (half the model's steps were these on code).
        return None if self.lookup is None else self.lookup.recurrence_n

    def run_steps(self, requests, slots, steps):
        # Each row's lag takes the run's tokens short of full (it holds `last` already:
        # `_flush_lags`; stepping, the step that fills it writes it), and a gated row drafts
        # again at its probe (`DraftRecord.may_draft` counted this step's proposal): the
        # steps up to either are what stepping one at a time runs.
        bound = list(steps)
        for i, (request, slot) in enumerate(zip(requests, np.asarray(slots), strict=False)):
            bound[i] = min(bound[i], self.lag.room(slot))
            record = self._gate(request)
            rest = 0 if record is None else record.resting(self.min_acceptance)
            bound[i] = min(bound[i], rest or bound[i])
        return bound

    def ran(self, requests, batch, samples, steps) -> None:
        # The run's tokens after `last` join the rows' lags; a gated row's record counts
        # the proposals it skipped in them, so its probe comes on the same step.
        slots, start = np.asarray(batch.slots), np.asarray(batch.start)
        table = np.asarray(batch.block_table)
        for i, request in enumerate(requests):
            tokens = [s.token for s in samples[request.request_id][: steps[i] - 1]]
            for j, token in enumerate(tokens):
                self.lag.add(slots[i], start[i] + 1 + j, token, table[i])
            record = self._gate(request)
            if record is not None:
                record.refused(len(tokens), self.min_acceptance)

    def _gate(self, request) -> DraftRecord | None:
        """The record that gates the request's model drafts (`_may_draft`), if one does."""
        return request.drafter_state if self.min_acceptance else None

    def reset(self) -> None:
        self.cache, self._per_step, self._window = self._new_cache(), None, None
        self._tree, self._lag_hits = None, []
        self.lag = Lag()

    def copy_slots(self, pairs, width: int) -> None:
        # A copied state must hold every token: write the sources' lags first.
        self._write_lags([src for src, _ in pairs], width)
        self.lag.drop([dst for _, dst in pairs])
        self.cache = copy_slots(self.cache, pairs, width)

    def padding_step(self, batch, k: int, lookup: bool = False):
        """The draft's part of a window of k drafts on padding rows (the cost profile): its
        k + 1 fused steps and the rollback, or with `lookup` the pass that writes a lookup
        window's tokens; nothing of a request's is touched."""
        b = int(batch.slots.shape[0])
        rows = np.ones(b, bool)
        ids = np.zeros((b, k + 1), np.int32)
        self._model_rows = ~rows if lookup else rows
        self._window = (rows, ids, batch) if lookup else None
        if not lookup:
            self._model_drafts(ids[:, 0], batch, np.full(b, k + 1, np.int32), k, 1)
        self.rollback(batch.slots, np.ones(b, np.int32))
        return self.cache

    def rollback(self, slots, commit_lens, track=None) -> None:
        # A draft with KDA layers snapshots its state where the target does (`track`), for a
        # prefix hit restores the checkpoint slot in both caches. Attention-only drafts need
        # not: their KV is in the pages, lags included (`_flush_lags`).
        if not self.has_state:
            track = None
        lookup_rows = None if self._window is None else self._window[0]
        if self._per_step is not None:
            rows = self._model_rows
            self.cache = commit_window(self.cache, self._per_step, slots, commit_lens, rows, track)
            self._per_step = None
        if self._window is not None:
            rows, window, batch = self._window
            self.cache = catch_up(
                self.graphdef, self.params, window, self.cache, batch, rows, commit_lens, track
            )
            self._window = None
        if track is not None:
            drafted = self._model_rows if lookup_rows is None else self._model_rows | lookup_rows
            self.cache = track_resting(self.cache, slots, ~drafted, commit_lens, track)

    def rollback_tree(self, slots, window, commit_lens, track=None) -> None:
        # Every drafted row's caches end holding its accepted path (`tree_rollback`); an
        # attention-only draft needs the pass too: its KV at a leaf's position is the chain's.
        if self._tree is None:
            return
        if not self.has_state:
            track = None
        chain, lookup_rows, batch, topk = self._tree
        drafted = self._model_rows | lookup_rows
        # A chain-shaped tree (topk 1) leaves no tail; a lookup row's may be its whole path.
        width = window.shape[1] if lookup_rows.any() else int(topk > 1 and drafted.any())
        if width or self._per_step is not None:
            if chain is None:
                chain = jnp.zeros((len(drafted), 1), jnp.int32)
            self.cache = tree_rollback(
                self.graphdef,
                self.params,
                self.cache,
                self._per_step,
                chain,
                window,
                batch,
                self._model_rows,
                drafted,
                commit_lens,
                track,
                width=width,
            )
        self._per_step = self._tree = None
        if track is not None:
            self.cache = track_resting(self.cache, slots, ~drafted, commit_lens, track)
