"""The runner's speculative steps (`Verifier`, which the `ModelRunner` of an engine with a
drafter holds): a decode step becomes one verify window per row, or, where no row drafts,
plain steps.

- `_verify`: the drafter proposes, the target verifies every row's window and accepts on device
  (`speculative/verify.py`), the drafter rolls back to what was committed; one transfer.
- `_draftless`: no row drafted, so the plain decode program runs (cheaper than a one-token
  window). With the n-gram drafter, a step in which no row finds a recurring suffix to draft
  from goes on as plain steps on device until some row's would recur
  (`draftless.decode_until_recurs`, at most each row's reserved window, `_until_recurs`): one call
  for what would be one call per token; where each request proposes stays the same.

The verifier steps the runner's `DeviceState`, pads with its `Buckets`, and runs a plain
decode through the runner's `plain(output, steps)`.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from kimi_linear_jax.cache import Batch
from serving.core.allocator import NULL_PAGE
from serving.core.buckets import Buckets
from serving.core.decode import decode_steps
from serving.core.device_state import DeviceState
from serving.core.request import Request
from serving.core.scheduler_output import SchedulerOutput
from serving.core.state_pool import NULL_SLOT
from serving.core.step_result import StepResult, host_samples, sample_mode
from serving.speculative.draftless import decode_until_recurs
from serving.speculative.tree_verify import verify_tree_step
from serving.speculative.verify import verify_step
from serving.speculative.widths import WidthPolicy, time_rounds, window_key

# Smallest width of the token history a draftless run checks for recurrence (`_until_recurs`).
MIN_HISTORY = 256


class Verifier:
    """Verify windows and draftless runs over the runner's state."""

    def __init__(
        self,
        state: DeviceState,
        buckets: Buckets,
        drafter,
        *,
        num_draft_tokens: int,
        commit_recurrent: bool,
        plain,
        widths: WidthPolicy | None = None,
        topk: int = 1,
    ) -> None:
        self.state, self.buckets, self.drafter = state, buckets, drafter
        self.widths = widths  # cost-aware widths; None: each row drafts its room
        drafter.keep_shadows = widths is not None
        self.topk = topk  # > 1: draft trees of num_draft_tokens nodes, topk children at most
        self.num_draft_tokens = num_draft_tokens
        self.commit_recurrent = commit_recurrent
        self._plain = plain
        self.counts = dict(draft_tokens=0, accepted_tokens=0, verify_rows=0)
        # Draftless rows run on device until their drafter would draft (`_until_recurs`);
        # False steps them one call at a time (the reference the tests compare with).
        self.draftless_runs = True
        self._lookup = False  # cost-aware widths: this step's window is of lookup drafts alone
        self._alphas: list[float] = []  # and the acceptance its width is chosen on, per row
        self._rest = 0.0  # and what resting the model's rows costs later (`WidthPolicy.best`)
        self._passes = 0  # the drafter's lag passes when the step began (`_prices`)

    def run(self, output: SchedulerOutput, result: StepResult) -> None:
        """Speculative decode: drafts, then one verify window per row, accepted on device.
        With cost-aware widths (`self.widths`), the window is as wide as pays (maybe none),
        and the step's time refreshes the cost curve."""
        t0, self._passes = time.perf_counter(), self.drafter.lag_passes
        requests = output.decode
        b, batch = self.buckets.batch([output.placement[r.request_id] for r in requests])
        last = np.zeros(b, np.int32)
        for i, r in enumerate(requests):
            last[i] = r.all_token_ids[-1]
        k, max_drafts = self.num_draft_tokens, output.max_drafts
        if self.widths is not None:  # a first choice on room alone: what the drafter may draft
            k, max_drafts = self._narrow(output, max_drafts, b)
        tracked = [i for i, r in enumerate(requests) if r.request_id in output.track]
        parents = None
        if self.topk > 1:
            drafts, parents, num = self.drafter.propose_tree(
                requests, max_drafts, batch, k, self.topk, tracked
            )
        else:
            drafts, num = self.drafter.propose(requests, max_drafts, batch, max(k, 1), tracked)
        drafted = bool(np.asarray(num).any())
        if self.widths is not None:  # the choice on what it did draft
            k, drafts, num = self._fit(output, drafts, num, b)
        shadows = self._shadows(output, num)
        if not np.asarray(num).any():
            if not output.track:
                self._draftless(output, batch, result, t0, runs=not drafted)
                return self._score(output, shadows, result)
            drafts, parents = drafts[:, :0], None  # the width-1 window: one of two compiled widths
        mode = sample_mode(requests)
        rows: list[Request | None] = list(requests)
        nodes = np.asarray(num)
        verify = self._chain if parents is None else functools.partial(self._tree, parents)
        picked, drafts_per_row = verify(last, drafts, num, batch, rows, b, mode, output)
        tokens, commit_lens, *logprobs = picked
        host = jax.device_get((commit_lens, drafts_per_row, tokens, *logprobs))  # one transfer
        commit_lens, num = np.asarray(host[0]), np.asarray(host[1])
        samples = host_samples(host[2:], rows, mode)
        n = len(requests)
        self.counts["draft_tokens"] += int(nodes[:n].sum())
        self.counts["accepted_tokens"] += int(commit_lens[:n].sum()) - n
        self.counts["verify_rows"] += n
        for i, (r, row) in enumerate(zip(requests, samples, strict=True)):
            result.samples[r.request_id] = row[: commit_lens[i]]
            gated = r.request_id not in self.drafter.ungated
            result.num_drafts[r.request_id] = int(num[i]) if gated else 0
        if parents is None:
            self.drafter.verified(requests, commit_lens[:n] - 1, num[:n])
        self._score(output, shadows, result)
        if self._prices(output):
            key = window_key(int(drafts.shape[1]), self._lookup)
            self.widths.curve.observe(key, b, time.perf_counter() - t0)

    def _prices(self, output: SchedulerOutput) -> bool:
        """Whether this step's time is its width's price. Not with a track point: it runs
        another program (the snapshot's: 10-15% more a window, and a one-token window where
        no row drafted), and priced as the width's or a plain step's, it made plain steps
        look dearer than windows where they were rare. Nor where the draft wrote a lag: the
        pass is the price of the rest that started it (`WidthPolicy.best`'s `rest`), and in
        the window that ends a rest it made the model's windows look dearer, so the model
        rested more (a 2-draft window read 3-6.4 ms from one run to the next)."""
        fresh = self.drafter.lag_passes == self._passes
        return self.widths is not None and not output.track and fresh

    def _shadows(self, output: SchedulerOutput, num) -> dict:
        """Under cost-aware widths, with a drafter that shadows: the shadow draft of each
        row that verifies no draft in this step (resting, or narrowed to none), scored
        against its first sample after the step (`_score`). A resting request is measured
        so at no cost, where a probe window would cost more than a plain step."""
        if self.widths is None or not self.drafter.shadows:
            return {}
        num, out = np.asarray(num), {}
        for i, r in enumerate(output.decode):
            token = None if num[i] else self.drafter.shadow(r)
            if token is not None:
                out[r.request_id] = token
        return out

    def _score(self, output: SchedulerOutput, shadows: dict, result: StepResult) -> None:
        """Each row's shadows of this step (`StepResult.shadows`): its lag's, older, then
        whether its host shadow draft was the token the step sampled first."""
        if self.widths is None:
            return
        lag = self.drafter.take_shadows()
        for r in output.decode:
            rid = r.request_id
            hits = self.drafter.own_shadows(r, list(lag.get(output.placement[rid].slot, ())))
            if rid in shadows:
                hits.append(result.samples[rid][0].token == shadows[rid])
            if hits:
                result.shadows[rid] = hits

    def _track_arrays(self, output: SchedulerOutput, b: int):
        """(track slots, track steps [b], -1: none) of the rows that snapshot in this step."""
        track_slots = np.full(b, -1, np.int32)
        track_steps = np.full(b, -1, np.int32)
        for i, r in enumerate(output.decode):
            if r.request_id in output.track:
                track_slots[i], tp = output.track[r.request_id]
                track_steps[i] = tp.ith
        return track_slots, track_steps

    def _chain(self, last, drafts, num, batch, rows, b: int, mode: str, output):
        """The chain verify and the drafter's rollback: (picks, drafts per row)."""
        state = self.state
        track_slots, track_steps = self._track_arrays(output, b)
        picked, state.cache = verify_step(
            state.graphdef,
            state.params,
            last,
            drafts,
            num,
            state.cache,
            batch,
            *self.buckets.sampling(rows, b, mode),
            track_slots,
            track_steps,
            mode=mode,
            commit_recurrent=self.commit_recurrent,
            # Under cost-aware widths the profile compiles both programs of each width: the
            # snapshot's made every window 10-15% slower at B = 8 when all ran with it.
            track=bool(output.track),
        )
        track = (track_slots, track_steps) if output.track else None
        self.drafter.rollback(batch.slots, picked[1], track)
        return picked, num

    def _tree(self, parents, last, drafts, num, batch, rows, b: int, mode: str, output):
        """The tree verify and the drafter's rollback to the accepted path: (picks, each
        row's tree depth, which adaptive drafting counts as its drafts)."""
        state = self.state
        track_slots, track_steps = self._track_arrays(output, b)
        picked, accepted, depth, state.cache = verify_tree_step(
            state.graphdef,
            state.params,
            last,
            drafts,
            parents,
            num,
            state.cache,
            batch,
            *self.buckets.sampling(rows, b, mode),
            track_slots,
            track_steps,
            mode=mode,
            commit_recurrent=self.commit_recurrent,
            track=bool(output.track),
        )
        track = (track_slots, track_steps) if output.track else None
        self.drafter.rollback_tree(batch.slots, accepted, picked[1], track)
        return picked, depth

    def _narrow(self, output: SchedulerOutput, max_drafts, b: int):
        """(width, each row's most drafts) chosen on the rows' room and acceptance. Resting
        rows are offered their room too: a window paid for costs a row nothing more, and the
        choice counts each row at its own acceptance, so resting rows alone still choose no
        window (they rest below the break-even). Left out, a row that dipped below it took
        one token from a window its batch ran anyway (0.86 of fixed k = 4 at B = 8, A =
        0.75). Probing rows (and rows not yet verified) draft the probe width at least: a
        probe is what tells whether a request's drafts got better."""
        self._alphas = [r.spec_alpha for r in output.decode]
        rest, rows = output.resting, output.decode
        max_drafts = [rest.get(r.request_id, n) for r, n in zip(rows, max_drafts, strict=True)]
        w, max_drafts = self._planned(output, max_drafts, b)
        probes = self._probing(output)
        if w == 0 and any(probes):
            w = self.widths.probe_width(b)
            return w, [min(n, w) if p else 0 for n, p in zip(max_drafts, probes, strict=True)]
        return w, [min(n, w) for n in max_drafts]

    def _planned(self, output: SchedulerOutput, max_drafts, b: int):
        """(width, room) on what each row would draft (`Drafter.plan`). Lookup first: the
        model's windows (its rows at the model's own acceptance), or lookup windows alone
        with the model's rows resting (priced without its steps), whichever pays more.
        Otherwise on the room alone. Sets the acceptance `_fit` chooses on again."""
        self._lookup, alphas = False, self._alphas
        plan = self.drafter.plan(output.decode, max_drafts)
        if plan is None:
            rest = self._rest = self._rest_price(output, max_drafts, b)
            return self.widths.best(alphas, max_drafts, b, rest=rest)[0], max_drafts
        lookup, model, model_alphas = plan
        both = [a + m for a, m in zip(lookup, model, strict=True)]
        own = [ma if m else a for a, m, ma in zip(alphas, model, model_alphas, strict=True)]
        rest = self._rest = self._rest_price(output, model, b)
        # Lookup windows alone, with the model's rows resting; none where lookup found nothing.
        alone = self.widths.best(alphas, lookup, b, True, rest) if any(lookup) else (0, 0.0)
        if any(model):  # the model's windows, against the lookup rows alone
            choice = self.widths.best(own, both, b, rest=rest)
            if choice[1] >= alone[1]:
                self._alphas = own
                return choice[0], max_drafts
        self._lookup = True
        return alone[0], [n if a else 0 for a, n in zip(lookup, max_drafts, strict=True)]

    def _rest_price(self, output: SchedulerOutput, drafting, b: int) -> float:
        """The lag pass that resting the rows with `drafting` drafts would start (0: none)."""
        rows = zip(output.decode, drafting, strict=True)
        slots = [output.placement[r.request_id].slot for r, n in rows if n]
        return self.widths.rest_price(b) if slots and self.drafter.starts_rest(slots) else 0.0

    @staticmethod
    def _probing(output: SchedulerOutput) -> list[bool]:
        return [r.request_id in output.probes for r in output.decode]

    def _fit(self, output: SchedulerOutput, drafts, num, b: int):
        """(width, drafts [B, width], num) with the width chosen again on the drafts each row
        proposed (an n-gram finds fewer than its room), padded to that compiled width."""
        num = np.asarray(num)
        if not num.any():  # a plain step (or a track point's alone): no width to choose
            return 0, drafts, num
        n = len(output.decode)
        w = self.widths.best(self._alphas, num[:n].tolist(), b, self._lookup, self._rest)[0]
        if w == 0 and any(p and num[i] for i, p in enumerate(self._probing(output))):
            w = int(num.max())
            w = next(c for c in self.widths.widths if c >= w)
        num = np.minimum(num, w)
        if drafts.shape[1] != w:  # a device slice or pad costs a dispatch: only when needed
            xp = jnp if isinstance(drafts, jax.Array) else np
            drafts = drafts[:, :w]
            drafts = xp.pad(drafts, ((0, 0), (0, w - drafts.shape[1])))
        return w, drafts, num

    def profile(self, rows, repeats: int = 5) -> None:
        """Seed the cost curve: a plain step and a window of each candidate width, for batches
        of each of `rows`, on padding rows (same programs, same work; nothing is written):
        the median of `repeats` rounds that call each width once in turn, after a compiling
        round and a warm one (timed one width after another, the first calls after a compile
        ran up to 1.4x slow). Untimed, it compiles the other programs a step may run: the
        windows with a track point's snapshot and a draft model's lag passes of every width.
        Its block table is as wide as a short row's (`min_width`), as such steps are. Each
        program first compiled mid-run had cost 0.4-2 s there (benchmarks/RESULTS.md)."""
        for b in rows:
            batch = Batch(
                np.full(b, NULL_SLOT, np.int32),
                np.full((b, self.buckets.min_width), NULL_PAGE, np.int32),
                np.zeros(b, np.int32),
                np.zeros(b, np.int32),
            )
            sampling = self.buckets.sampling([], b, "greedy")
            # Lookup first: lookup windows too (without the model's steps; w = 0 is one key).
            kinds = (False, True) if self.drafter.lookup_first else (False,)
            calls = {
                window_key(w, lookup): functools.partial(
                    self._padding_step, w, batch, sampling, lookup=lookup
                )
                for lookup in kinds
                for w in (0, *self.widths.widths)
            }
            if self.drafter.padding_lag(batch) is not None:  # a draft model's lag pass
                calls["lag"] = functools.partial(self.drafter.padding_lag, batch)
            timed = time_rounds(calls, repeats)
            self.widths.lag[b] = timed.pop("lag", 0.0)
            for key, seconds in timed.items():
                self.widths.curve.profile(key, b, seconds)
            for w in (-1, *self.widths.widths):  # -1: a step where only a track point verifies
                jax.block_until_ready(self._padding_step(w, batch, sampling, track=True))
            for w in self.drafter.lag_widths[1:]:  # one token is timed above
                jax.block_until_ready(self.drafter.padding_lag(batch, w))

    def _padding_step(self, w: int, batch, sampling, track: bool = False, lookup: bool = False):
        state, b = self.state, batch.slots.shape[0]
        zeros = np.zeros(b, np.int32)
        if w < 0:  # the one-token window of a step where only a track point verifies
            w = 0
        elif w == 0:
            out, _, state.cache = decode_steps(
                state.graphdef,
                state.params,
                zeros,
                state.cache,
                batch,
                zeros,
                *sampling,
                num_steps=1,
                mode="greedy",
            )
            return out
        if lookup:  # the pass that writes a lookup window's tokens into the draft's cache
            draft = self.drafter.padding_step(batch, w, lookup=True)
        else:
            draft = self.drafter.padding_step(batch, w) if w else None
        out, state.cache = verify_step(
            state.graphdef,
            state.params,
            zeros,
            np.zeros((b, w), np.int32),
            zeros,
            state.cache,
            batch,
            *sampling,
            zeros - 1,
            zeros - 1,
            mode="greedy",
            commit_recurrent=self.commit_recurrent,
            track=track,
        )
        return out, draft

    def _draftless(
        self, output: SchedulerOutput, batch, result: StepResult, t0: float, runs: bool = True
    ) -> None:
        """No row drafted (nothing recurs, or adaptive drafting stopped them all): the window
        is each row's last token alone, which the plain decode step computes for less than a
        verify program (no window, no acceptance, no commit). A drafter with a cache keeps
        its one step. Where the drafter's next proposal is foreseeable on device and every row
        may draft in every step (none rests or probes), the steps go on there until one would
        (`_until_recurs`). `runs` False: one plain step (cost-aware widths chose none
        although rows drafted: their suffixes recur, so a run would stop at once). A row
        resting under cost-aware widths may run too: its shadow, the only thing it drafts,
        exists where its suffix recurs, which ends a run."""
        requests = output.decode
        n = self.drafter.recurrence_n
        steady = not output.probes and all(map(self._may_run, requests, output.max_drafts))
        if runs and self.draftless_runs and n is not None and steady:
            samples, steps = self._until_recurs(output, batch, n)
            self.drafter.ran(requests, batch, samples, steps)
        else:
            samples = self._plain(output, [1] * len(requests))
            steps = np.ones(batch.slots.shape, np.int32)
        self.drafter.rollback(batch.slots, steps)
        result.samples.update(samples)
        # Each step counts as the one-token verify it is synchronously: the metrics are those
        # of stepping one call at a time.
        self.counts["verify_rows"] += int(steps[: len(requests)].sum())
        for r in requests:
            result.num_drafts[r.request_id] = 0
        if self._prices(output):  # per plain step: a run's steps are each one
            seconds = (time.perf_counter() - t0) / max(int(steps.max()), 1)
            self.widths.curve.observe(0, int(batch.slots.shape[0]), seconds)

    def _may_run(self, request: Request, max_drafts: int) -> bool:
        """Whether a row may join a draftless run: it may draft, or it rests and shadows (a
        probe is counted in steps, and a penalised row samples on the host's counts)."""
        if max_drafts:
            return True
        shadowed = self.widths is not None and self.drafter.shadows
        return shadowed and not request.params.has_penalty

    def _until_recurs(self, output: SchedulerOutput, batch, n: int):
        """Run draftless rows' plain steps on device until some row's last n tokens recur
        (`draftless.decode_until_recurs`), at most each row's reserved window: one call and one
        transfer instead of one per token. (samples by request, steps run per batch row)."""
        requests = output.decode
        b = batch.slots.shape[0]
        steps = np.zeros(b, np.int32)
        steps[: len(requests)] = self.drafter.run_steps(requests, batch.slots, output.decode_steps)
        tokens = [r.all_token_ids for r in requests]
        width = MIN_HISTORY  # power-of-two widths: few programs
        while width < max(map(len, tokens)) + self.num_draft_tokens + 1:
            width *= 2
        seq = np.zeros((b, width), np.int32)
        length = np.ones(b, np.int32)  # padding rows: token 0, no steps
        for i, t in enumerate(tokens):
            seq[i, : len(t)] = t
            length[i] = len(t)
        mode = sample_mode(requests)
        state = self.state
        picked, ran, state.cache = decode_until_recurs(
            state.graphdef,
            state.params,
            seq,
            length,
            state.cache,
            batch,
            steps,
            self.buckets.sampling(list(requests), b, mode)[0],
            num_steps=self.num_draft_tokens + 1,
            min_n=n,
            mode=mode,
        )
        ran, picked = jax.device_get((ran, picked))  # one transfer
        steps = np.minimum(steps, int(ran))
        rows = host_samples(picked, list(requests), mode)
        samples = {r.request_id: row[: steps[i]] for i, (r, row) in enumerate(zip(requests, rows))}
        return samples, steps
