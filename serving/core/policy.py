"""Adaptive speculation: whether a request drafts in a step, from its recent acceptance.

A request whose acceptance (an EMA over its verifies) is below `min_acceptance` stops drafting
(its step is a plain decode) except for probes: the first after `probe_interval` verifies, each
later one twice as far (up to `MAX_PROBE_BACKOFF` intervals), back to the interval once it
drafts again. A verify window costs several decode steps on a CPU, so drafts that keep failing
are a loss. `min_acceptance` 0 turns it off. Pure functions of the request's numbers: the
scheduler keeps them on the request.

Which acceptance: `by="rate"` (the default) the EMA of accepted / drafted per window;
`by="alpha"` the per-draft estimate `Request.spec_alpha`, which cost-aware widths use, with
`min_acceptance` set to the cost curve's break-even (`speculative/widths.py`). A new request's
estimate starts at the engine's recent acceptance (`AcceptancePool`), and `probes=False` (a
drafter that shadows: `Drafter.shadow`) rests without probes, since every resting step
measures the request's drafts for free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence

from serving.core.request import (
    ALPHA_DECAY,
    PRIOR_TRIALS,
    Request,
    acceptance_ema,
    alpha_counts,
    window_trials,
)

# The longest wait between two probes of a request that stopped drafting, in probe intervals.
MAX_PROBE_BACKOFF = 8


# Decay of the pool's sums per recorded window: about the last 50 windows of all requests.
POOL_DECAY = 0.98
# The spread of requests' acceptance around the pool's assumed before any is measured (a
# variance; sd 0.32, a prior worth 2.5 trials at 0.5), itself worth this many trials.
SPREAD_PRIOR, SPREAD_PRIOR_TRIALS = 0.1, 16.0
# The most trials the pool's prior is worth to a request (`AcceptancePool.weight`).
MAX_PRIOR_TRIALS = 32.0


class AcceptancePool:
    """The engine's recent per-draft acceptance over every request's windows (and shadows):
    each request's prior. A workload whose drafts fail then starts new requests resting
    rather than paying a first window each, and one whose drafts hold starts them at the
    widest window that pays. Before any window: 1.0 (speculate, and learn).

    How much the prior is worth (`weight`) is measured too: the requests' estimates spread
    around the pool's by their trials' noise plus the spread of their true acceptance
    (`spread`, an empirical-Bayes moment). Where requests draft alike (one drafter, one kind
    of text) the noise is all of it, and a request's five-window estimate (sd 0.12 at 0.75)
    chose a window two widths off in a third of the steps (0.97 of the best fixed width);
    the pool's estimate, 50 windows deep, does not. Where they differ, a request's own
    windows outweigh the pool within a few windows, as before."""

    def __init__(self) -> None:
        self.hits = self.trials = 0.0
        self.excess = self.evidence = 0.0  # trial-weighted sums of `observe`

    def record(self, accepted: int, drafts: int) -> None:
        self.hits = POOL_DECAY * self.hits + accepted
        self.trials = POOL_DECAY * self.trials + window_trials(accepted, drafts)

    @property
    def prior(self) -> float:
        return self.hits / self.trials if self.trials else 1.0

    def observe(self, hits: float, trials: float, square: float) -> None:
        """One request's estimate after a window (decayed hits, trials and squared weights):
        its squared distance from the pool's, less what its trials' noise alone explains,
        weighted by its effective trials (trials**2 / square)."""
        if trials < 1.0:
            return
        p, n = self.prior, trials * trials / square
        self.excess = POOL_DECAY * self.excess + n * (hits / trials - p) ** 2 - p * (1.0 - p)
        self.evidence = POOL_DECAY * self.evidence + n

    @property
    def spread(self) -> float:
        """The variance of requests' true acceptance around the pool's (at least 1e-6)."""
        excess = self.excess + SPREAD_PRIOR * SPREAD_PRIOR_TRIALS
        return max(excess / (self.evidence + SPREAD_PRIOR_TRIALS), 1e-6)

    @property
    def weight(self) -> float:
        """Trials the prior is worth: a beta prior's p (1 - p) / spread, between
        `PRIOR_TRIALS` (requests differ) and `MAX_PRIOR_TRIALS` (they measure alike)."""
        p = self.prior
        return min(max(p * (1.0 - p) / self.spread, PRIOR_TRIALS), MAX_PRIOR_TRIALS)


@dataclasses.dataclass(frozen=True)
class DraftPolicy:
    min_acceptance: float = 0.0
    probe_interval: int = 16
    by: str = "rate"
    probes: bool = True
    # Every request's windows, for new requests' priors (one pool through `replace`).
    pool: AcceptancePool = dataclasses.field(default_factory=AcceptancePool)

    def __post_init__(self) -> None:
        if self.by not in ("rate", "alpha"):
            raise ValueError(f"DraftPolicy.by must be 'rate' or 'alpha', got {self.by!r}")

    def acceptance(self, request: Request) -> float:
        """The request's acceptance this policy gates on. By alpha, a request not measured
        yet is at its prior (`Request.spec_prior`)."""
        if self.by == "alpha":
            return request.spec_alpha
        return request.spec_acceptance

    def drafts(
        self, room: int, acceptance: float, skipped: int, probe_after: int
    ) -> tuple[int, int, int]:
        """(most drafts this step, skipped, probe_after) for a request with `room` window
        slots, its acceptance EMA, the verifies it skipped since its last probe and the
        verifies until its next one (0: the interval; nonzero after a probe)."""
        if room <= 0:
            return 0, skipped, probe_after
        if acceptance >= self.min_acceptance:
            return room, skipped, 0
        if not self.probes:
            return 0, skipped, probe_after
        skipped += 1
        after = probe_after or self.probe_interval
        if skipped < after:
            return 0, skipped, probe_after
        # Probe; should it fail too, the next one waits twice as long.
        return room, 0, min(2 * after, self.probe_interval * MAX_PROBE_BACKOFF)

    def prior(self) -> float:
        """A new request's prior acceptance (`Request.spec_prior`)."""
        return self.pool.prior

    def record(self, request: Request, accepted: int, drafts: int) -> None:
        """Both estimates after a verify that accepted `accepted` of its `drafts` drafts, or a
        shadow (one draft; the scheduler calls this: it alone changes a request)."""
        self.pool.record(accepted, drafts)
        request.spec_acceptance = acceptance_ema(request.spec_acceptance, accepted / drafts)
        counts = alpha_counts(request.spec_hits, request.spec_trials, accepted, drafts)
        request.spec_hits, request.spec_trials = counts
        square = ALPHA_DECAY**2 * request.spec_square + window_trials(accepted, drafts)
        request.spec_square = square
        self.pool.observe(*counts, square)
        request.spec_prior, request.spec_prior_weight = self.pool.prior, self.pool.weight

    def record_step(
        self,
        decode: Sequence[Request],
        sampled: Mapping[Hashable, Sequence[int]],
        num_drafts: Mapping[Hashable, int] | None,
        shadows: Mapping[Hashable, Sequence[bool]] | None,
    ) -> None:
        """Record a step's shadows (each a window of one draft, hit or not, in order), then
        its windows (a row's tokens are its accepted drafts plus one)."""
        num_drafts, shadows = num_drafts or {}, shadows or {}
        for request in decode:
            rid = request.request_id
            for hit in shadows.get(rid, ()):
                self.record(request, int(hit), 1)
            if num_drafts.get(rid, 0) > 0:
                self.record(request, len(sampled[rid]) - 1, num_drafts[rid])
