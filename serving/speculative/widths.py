"""Cost-aware verify widths: each step's window is as wide as pays, from a measured cost curve.

A verify window of w drafts costs `cost(w, rows)` seconds for a batch of `rows` (w = 0: the
plain decode step), profiled at start-up (`Verifier.profile`) and refreshed from every step's
measured time (an EMA per point). A request whose drafts are each accepted with probability
alpha (given the one before was) emits `expected_tokens(alpha, m)` tokens from a window of m
drafts. A step picks the width w maximising the batch's expected tokens per second,
sum_r E(alpha_r, min(w, n_r)) / cost(w, rows), where n_r is what request r can draft (its
room, or what the drafter found). Width 0 is plain decoding: the step pays only where drafts
are likely enough to be accepted, which is what DSpark does per request (arXiv 2607.05147).

`break_even(rows)` is the acceptance below which no width beats a plain step for one request:
the scheduler's adaptive drafting rests requests below it (and probes them now and then), so a
request whose drafts fail stops paying for windows.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

# Weight of a new measurement in a point's EMA: a few steps follow a change of load, and one
# noisy step (a CPU shared with others) moves the point by a third at most.
SMOOTHING = 0.3
# A step slower than this many times its point's estimate is not the width's price: a first
# call that compiled (a sampling mode, a table width), or the machine stalling.
OUTLIER = 5.0


def expected_tokens(alpha: float, drafts: int) -> float:
    """Tokens a chain window of `drafts` drafts emits: sum_{j=0..drafts} alpha^j (the accepted
    drafts plus the target's own token after them)."""
    if alpha >= 1.0:
        return float(drafts + 1)
    return (1.0 - alpha ** (drafts + 1)) / (1.0 - alpha)


def candidate_widths(max_drafts: int) -> tuple[int, ...]:
    """The compiled window widths: powers of two below `max_drafts`, and `max_drafts`."""
    widths, w = [], 1
    while w < max_drafts:
        widths.append(w)
        w *= 2
    return (*widths, max_drafts)


class CostCurve:
    """Seconds per step by (drafts per row, batch rows); between measured batch sizes of a
    width, linear; outside them, the nearest."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[int, int], float] = {}
        self.frozen = False  # True: live steps no longer move the curve (a pinned curve)

    def observe(self, width: int, rows: int, seconds: float) -> None:
        if self.frozen:
            return
        estimate = self.cost(width, rows)
        if estimate is not None and seconds > OUTLIER * estimate:
            return
        old = self.seconds.get((width, rows))
        self.seconds[width, rows] = seconds if old is None else old + SMOOTHING * (seconds - old)

    def cost(self, width: int, rows: int) -> float | None:
        if (width, rows) in self.seconds:
            return self.seconds[width, rows]
        known = sorted(b for w, b in self.seconds if w == width)
        if not known:
            return None
        i = bisect.bisect_left(known, rows)
        if i == 0 or i == len(known):
            return self.seconds[width, known[min(i, len(known) - 1)]]
        lo, hi = known[i - 1], known[i]
        a, b = self.seconds[width, lo], self.seconds[width, hi]
        return a + (b - a) * (rows - lo) / (hi - lo)


class WidthPolicy:
    """Chooses each verify step's width from the cost curve and the requests' acceptance."""

    def __init__(self, max_drafts: int, curve: CostCurve | None = None) -> None:
        self.widths = candidate_widths(max_drafts)
        self.curve = curve or CostCurve()

    def _priced(self, rows: int) -> list[tuple[int, float]]:
        """(width, cost) for width 0 and every candidate width the curve prices."""
        priced = [(w, self.curve.cost(w, rows)) for w in (0, *self.widths)]
        return [(w, c) for w, c in priced if c is not None and c > 0]

    def choose(self, alphas: Sequence[float], available: Sequence[int], rows: int) -> int:
        """The width maximising expected tokens per second over the step's requests (alpha
        and drafts available each); the widest when the curve prices no plain step yet."""
        priced = self._priced(rows)
        if not priced or priced[0][0] != 0:
            return self.widths[-1]
        pairs = list(zip(alphas, available, strict=True))

        def rate(item):
            w, c = item
            return sum(expected_tokens(a, min(w, n)) for a, n in pairs) / c

        return max(priced, key=rate)[0]

    def break_even(self, rows: int = 1) -> float:
        """The acceptance at which the best width's expected tokens per second equal a plain
        step's, for one request in a batch of `rows` (0 when nothing is priced: no resting)."""
        priced = self._priced(rows)
        if len(priced) < 2 or priced[0][0] != 0:
            return 0.0
        plain = priced[0][1]
        best = 1.0
        for w, c in priced[1:]:
            best = min(best, _solve(w, c / plain))
        return best


def _solve(width: int, ratio: float) -> float:
    """The alpha with expected_tokens(alpha, width) == ratio (bisection; it increases in
    alpha from 1 to width + 1), clamped to [0, 1]."""
    if ratio <= 1.0:
        return 0.0
    if ratio >= width + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, width) < ratio else (lo, mid)
    return hi
