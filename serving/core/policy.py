"""Adaptive speculation: whether a request drafts in a step, from its recent acceptance.

A request whose acceptance (an EMA over its verifies) is below `min_acceptance` stops drafting
(its step is a plain decode) except for probes: the first after `probe_interval` verifies, each
later one twice as far (up to `MAX_PROBE_BACKOFF` intervals), back to the interval once it
drafts again. A verify window costs several decode steps on a CPU, so drafts that keep failing
are a loss. `min_acceptance` 0 turns it off. Pure functions of the request's numbers: the
scheduler keeps them on the request.

Which acceptance: `by="rate"` (the default) the EMA of accepted / drafted per window;
`by="alpha"` the per-draft estimate `Request.spec_alpha`, which cost-aware widths use, with
`min_acceptance` set to the cost curve's break-even (`speculative/widths.py`).
"""

from __future__ import annotations

import dataclasses

from serving.core.request import ALPHA_DECAY, Request, acceptance_ema

# The longest wait between two probes of a request that stopped drafting, in probe intervals.
MAX_PROBE_BACKOFF = 8


@dataclasses.dataclass(frozen=True)
class DraftPolicy:
    min_acceptance: float = 0.0
    probe_interval: int = 16
    by: str = "rate"

    def __post_init__(self) -> None:
        if self.by not in ("rate", "alpha"):
            raise ValueError(f"DraftPolicy.by must be 'rate' or 'alpha', got {self.by!r}")

    def acceptance(self, request: Request) -> float:
        """The request's acceptance this policy gates on. By alpha, a request not verified
        yet drafts: its first window is its first measurement."""
        if self.by == "alpha":
            return request.spec_alpha if request.spec_trials else 1.0
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
        skipped += 1
        after = probe_after or self.probe_interval
        if skipped < after:
            return 0, skipped, probe_after
        # Probe; should it fail too, the next one waits twice as long.
        return room, 0, min(2 * after, self.probe_interval * MAX_PROBE_BACKOFF)

    @staticmethod
    def record(request: Request, accepted: int, drafts: int) -> None:
        """Both estimates after a verify that accepted `accepted` of its `drafts` drafts (the
        scheduler calls this: it alone changes a request)."""
        request.spec_acceptance = acceptance_ema(request.spec_acceptance, accepted / drafts)
        missed = 1.0 if accepted < drafts else 0.0
        request.spec_hits = ALPHA_DECAY * request.spec_hits + accepted
        request.spec_trials = ALPHA_DECAY * request.spec_trials + accepted + missed
