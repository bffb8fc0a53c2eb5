"""Adaptive speculation: whether a request drafts in a step, from its recent acceptance.

A request whose acceptance (an EMA over its verifies) is below `min_acceptance` stops drafting
(its step is a plain decode) except for probes: the first after `probe_interval` verifies, each
later one twice as far (up to `MAX_PROBE_BACKOFF` intervals), back to the interval once it
drafts again. A verify window costs several decode steps on a CPU, so drafts that keep failing
are a loss. `min_acceptance` 0 turns it off. Pure functions of the request's numbers: the
scheduler keeps them on the request.
"""

from __future__ import annotations

import dataclasses

from serving.core.request import acceptance_ema

# The longest wait between two probes of a request that stopped drafting, in probe intervals.
MAX_PROBE_BACKOFF = 8


@dataclasses.dataclass(frozen=True)
class DraftPolicy:
    min_acceptance: float = 0.0
    probe_interval: int = 16

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
    def update(acceptance: float, rate: float) -> float:
        """The acceptance EMA after a verify that accepted `rate` of its drafts."""
        return acceptance_ema(acceptance, rate)
