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

from serving.core.request import Request, acceptance_ema, alpha_counts

# The longest wait between two probes of a request that stopped drafting, in probe intervals.
MAX_PROBE_BACKOFF = 8


# Decay of the pool's sums per recorded window: about the last 50 windows of all requests.
POOL_DECAY = 0.98


class AcceptancePool:
    """The engine's recent per-draft acceptance over every request's windows (and shadows):
    a new request's prior. A workload whose drafts fail then starts new requests resting
    rather than paying a first window each, and one whose drafts hold starts them at the
    widest window that pays. Before any window: 1.0 (speculate, and learn)."""

    def __init__(self) -> None:
        self.hits = self.trials = 0.0

    def record(self, accepted: int, drafts: int) -> None:
        self.hits = POOL_DECAY * self.hits + accepted
        self.trials = POOL_DECAY * self.trials + accepted + (accepted < drafts)

    @property
    def prior(self) -> float:
        return self.hits / self.trials if self.trials else 1.0


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
