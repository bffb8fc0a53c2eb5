"""The drafter interface, for chain and tree windows.

Chain layout: a request gets at most k drafts, one per position after its last token; the
verify window is `[last, d_1 .. d_n]`. Tree layout (`propose_tree`): the window holds T = n + 1
nodes per row, node 0 the row's last token (the root), drafts the nodes 1..n; node j + 1 has
token drafts[b, j] and parent node parents[b, j] in [0, j]; a row's valid nodes are its first
num[b] drafts; padding nodes have token 0 and parents[b, j] = j. Siblings have distinct tokens
(the verify follows at most one child per node). A chain is the tree with parents[b, j] = j.

The runner calls, per step: `prefill` after the target's prefill (same batch and block tables,
so a drafter with its own caches stays in step), `propose` (or `propose_tree`) before the
verify, and `rollback` (or `rollback_tree`) after it. Host drafters (n-gram, oracle) only
implement `propose_tokens`, and `propose_tree_tokens` where they branch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from serving.core.request import acceptance_ema, alpha_counts, alpha_estimate

# A request whose self-gated drafts keep failing tries them again after this many proposals.
PROBE_INTERVAL = 16
# `DraftRecord.alpha` before its source's first window: even odds. A draft model's lag passes
# score 15 shadows each, which soon outweigh it.
ALPHA_PRIOR = 0.5


@dataclasses.dataclass
class DraftRecord:
    """A request's record of the drafts one source gives it, judged apart from the
    scheduler's acceptance (`Drafter.ungated`): their acceptance (an EMA, as the scheduler
    keeps for all drafts) and the proposals skipped since the source last drafted for it."""

    acceptance: float = 1.0
    skipped: int = 0
    # Its per-draft estimate (`alpha`), for cost-aware widths: as `Request.spec_alpha`.
    hits: float = 0.0
    trials: float = 0.0

    def score(self, rate: float) -> None:
        self.acceptance = acceptance_ema(self.acceptance, rate)

    def count(self, accepted: int, drafts: int) -> None:
        """One more window (a shadow: one draft) into `alpha`."""
        self.hits, self.trials = alpha_counts(self.hits, self.trials, accepted, drafts)

    @property
    def alpha(self) -> float:
        return alpha_estimate(self.hits, self.trials, ALPHA_PRIOR)

    def may_draft(self, min_acceptance: float) -> bool:
        """May the source draft now: its acceptance is high enough, or a probe (every
        `PROBE_INTERVAL`-th proposal while it is not)."""
        if self.acceptance >= min_acceptance:
            return True
        self.skipped += 1
        if self.skipped < PROBE_INTERVAL:
            return False
        self.skipped = 0
        return True

    def resting(self, min_acceptance: float) -> int:
        """After a proposal `may_draft` refused: the proposals it refuses in a row, that one
        first, before its probe (0 when its acceptance lets it draft)."""
        return 0 if self.acceptance >= min_acceptance else PROBE_INTERVAL - self.skipped

    def refused(self, proposals: int, min_acceptance: float) -> None:
        """Count `proposals` more that `may_draft` would have refused (a draftless run's)."""
        if self.acceptance < min_acceptance:
            self.skipped += proposals


class Drafter:
    """Base: a host drafter proposing from the request's tokens."""

    # Requests whose drafts of the last `propose` do not count toward adaptive drafting
    # (`min_acceptance`): drafts a drafter gates by its own statistics.
    ungated: frozenset = frozenset()

    # n when the drafter drafts exactly where a request's last n tokens occur earlier in its
    # tokens (and the row may draft): the runner then runs draftless rows on device until
    # that holds (`draftless.decode_until_recurs`). None: its next proposal is not foreseeable.
    recurrence_n: int | None = None

    def propose_tokens(self, request, max_drafts: int) -> list[int]:
        """Up to `max_drafts` draft tokens continuing `request.all_token_ids`."""
        raise NotImplementedError

    # True when a request that verifies no draft in a step is still measured: its shadow
    # draft against the token the step samples (`shadow`, a host lookup, free), or on the
    # device (`take_shadows`), so cost-aware widths need no probe windows to see its drafts
    # get better.
    shadows: bool = False

    def shadow(self, request) -> int | None:
        """The first draft `propose` would give `request` now, or None (none, or a drafter
        whose drafts cost a model step)."""
        return None

    # Set by cost-aware widths: keep the device's shadows until `take_shadows`.
    keep_shadows: bool = False

    def take_shadows(self) -> dict[int, list[bool]]:
        """Shadows scored on the device since the last call (a draft model's lag passes),
        by state slot: whether each draft was the token that followed, oldest first."""
        return {}

    def own_shadows(self, request, hits: list[bool]) -> list[bool]:
        """Those of `request`'s `take_shadows` that the scheduler is to record: a drafter
        that judges those drafts apart (`ungated`) keeps them in its own record instead."""
        return hits

    def propose(
        self, requests: Sequence, max_drafts: Sequence[int], batch, k: int, checkpointed=()
    ):
        """(drafts [B, w] int32, num_drafts [B] int32) for the rows `requests` (padded to
        `batch`'s rows), w <= k: the verify window is w + 1 wide, so a drafter may narrow it.
        Host drafters return numpy; a device drafter may return jax arrays. `checkpointed`:
        the rows whose state the target checkpoints in this step (a drafter with caches must
        then hold their tokens too)."""
        b = int(batch.slots.shape[0])
        drafts = np.zeros((b, k), np.int32)
        num = np.zeros(b, np.int32)
        for i, (request, n) in enumerate(zip(requests, max_drafts, strict=True)):
            tokens = self.propose_tokens(request, n)[:n] if n > 0 else []
            drafts[i, : len(tokens)] = tokens
            num[i] = len(tokens)
        return drafts, num

    # True for a draft model with prompt lookup first: its lookup windows run none of its
    # steps, so cost-aware widths price them apart (`widths.window_key`) and `plan` says
    # which rows draft which way before the width is chosen.
    lookup_first: bool = False

    def plan(self, requests: Sequence, max_drafts: Sequence[int]):
        """(lookup drafts, model drafts, the model's acceptance) of each row with `max_drafts`
        room, before the width is chosen (lookup first: the model's drafts are judged by
        their own estimate, the lookup's by the request's); None: found out in `propose`."""
        return None

    def propose_tree_tokens(self, request, max_nodes: int, topk: int) -> list[tuple[int, int]]:
        """Up to `max_nodes` tree nodes (token, parent) continuing `request.all_token_ids`,
        node i + 1 the i-th, parents numbered as window nodes (0: the root, the last token),
        at most `topk` children a node. Without a tree of its own a drafter drafts its chain."""
        return chain(self.propose_tokens(request, max_nodes))

    def propose_tree(
        self,
        requests: Sequence,
        max_nodes: Sequence[int],
        batch,
        n: int,
        topk: int,
        checkpointed=(),
    ):
        """(drafts [B, n] int32, parents [B, n] int32, num [B] int32): each row's tree of at
        most max_nodes[i] nodes (0: none), at most `topk` children a node, in the module's
        tree layout. Host drafters return numpy; a device drafter may return jax arrays.
        `checkpointed` as in `propose`."""
        trees = [
            self.propose_tree_tokens(request, m, topk)[:m] if m > 0 else []
            for request, m in zip(requests, max_nodes, strict=True)
        ]
        return pack_trees(trees, int(batch.slots.shape[0]), n)

    def verified(self, requests: Sequence, accepted, drafts) -> None:
        """After a chain verify, on the host: each row's accepted drafts of its drafts (a
        drafter scores the drafts it judges by its own record here)."""

    def prefill(self, ids, batch, fresh_slots, has_prefix: bool) -> None:
        """Mirror the target's prefill chunk (drafters with caches)."""

    def copy_slots(self, pairs, width: int) -> None:
        """Mirror the target's prefix-cache slot copies (drafters with caches)."""

    def rollback(self, slots, commit_lens, track=None) -> None:
        """Keep the drafter's state for the accepted tokens only (drafters with caches).
        `track`: (track slots, track steps [B], -1: none) when the target snapshots rows of
        this window for the prefix cache; a drafter with a recurrent state snapshots its own
        state there too."""

    def rollback_tree(self, slots, window, commit_lens, track=None) -> None:
        """`rollback` after a tree verify: window [B, T] holds each row's accepted path
        `[last, a_1 .. a_d]` (zeros after), commit_lens [B] = d + 1 (0: padding rows)."""

    def padding_step(self, batch, k: int, lookup: bool = False):
        """Run the drafter's device work of a window of k drafts on padding rows, for the
        cost profile (`Verifier.profile`; `lookup`: of a lookup window's, with
        `lookup_first`); returns what to wait for, None for host drafters."""
        return None

    def padding_lag(self, batch, width: int = 1):
        """A lag pass `width` tokens wide on padding rows (the cost profile; one token: what a
        row that rested costs when it drafts again); None for drafters that keep no lag."""
        return None

    # The widths a lag pass may take (`padding_lag`): the profile compiles each.
    lag_widths: tuple[int, ...] = ()

    # Lag passes written so far (a draft model's): a step that wrote one prices no width.
    lag_passes: int = 0

    def starts_rest(self, slots) -> bool:
        """Whether resting a row of these slots would start a lag (a lag pass later)."""
        return False

    def run_steps(self, requests, slots, steps):
        """Each row's steps of a draftless run (`Verifier._until_recurs`): `steps`, its
        reserved window, or fewer where the drafter's next proposal could come sooner than
        the recurrence `recurrence_n` foresees."""
        return steps

    def ran(self, requests, batch, samples, steps) -> None:
        """After a draftless run (`Verifier._until_recurs`): row i consumed `steps[i]` tokens
        from its last one, `samples[request_id]` the tokens the run sampled."""

    def reset(self) -> None:
        """Empty every slot and page (the engine rebuilt the target's caches after a fault)."""


def chain(tokens: Sequence[int]) -> list[tuple[int, int]]:
    """A chain of drafts as tree nodes: each the child of the node before it."""
    return [(int(t), j) for j, t in enumerate(tokens)]


def pack_trees(trees: Sequence[Sequence[tuple[int, int]]], rows: int, n: int):
    """(drafts [rows, n], parents [rows, n], num [rows]) from each row's first n nodes
    (token, parent); rows past `trees` and nodes past a row's own are padding."""
    drafts = np.zeros((rows, n), np.int32)
    parents = np.tile(np.arange(n, dtype=np.int32), (rows, 1))
    num = np.zeros(rows, np.int32)
    for i, nodes in enumerate(trees):
        nodes = list(nodes)[:n]
        num[i] = len(nodes)
        for j, (token, parent) in enumerate(nodes):
            if not 0 <= parent <= j:
                raise ValueError(f"row {i}: node {j + 1} has parent {parent}, not in [0, {j}]")
            drafts[i, j], parents[i, j] = token, parent
    return drafts, parents, num
