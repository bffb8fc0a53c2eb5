"""Cost-aware verify widths: each step's window is as wide as pays, from a measured cost curve.

A verify window of w drafts costs `cost(w, rows)` seconds for a batch of `rows` (w = 0: the
plain decode step), profiled at start-up (`Verifier.profile`) and refreshed from every step's
measured time (the median of each point's recent steps). A request whose drafts are each
accepted with probability alpha (given the one before was) emits `expected_tokens(alpha, m)`
tokens from a window of m drafts. A step picks the width w maximising the batch's expected
tokens per second, sum_r E(alpha_r, min(w, n_r)) / cost(w, rows), where n_r is what request r
can draft (its room, or what the drafter found). Width 0 is plain decoding: the step pays only
where drafts are likely enough to be accepted, which is what DSpark does per request (arXiv
2607.05147). A width whose price is still a guess (no live steps yet) is tried when the guess
puts it near the best (`EXPLORE`), so that a guess too high is corrected.

Lookup first (a draft model with prompt lookup tried first): a window of lookup drafts runs none
of the draft model's steps, so it is priced on its own points, `window_key(w, lookup=True)`;
the plain step (w = 0) is one point. The verifier learns which rows would draft which way
before it chooses (`Drafter.plan`), and compares the model's windows with lookup windows alone.

`break_even(rows)` is the acceptance below which no width (of either kind) beats a plain step
for one request: the scheduler's adaptive drafting rests requests below it (and probes them
now and then), so a request whose drafts fail stops paying for windows.
"""

from __future__ import annotations

import bisect
import collections
import math
import statistics
import time
from collections.abc import Sequence

import jax

# A live point is the median of its last this many steps: it follows a change of load within
# a few steps, and one slow step (a CPU shared with others, a collection) does not move it. An
# EMA did: one 10x step set a window's price so high that it was never tried again.
WINDOW = 9
# Live steps a point needs before they price it instead of its profile: the first steps of a
# width may compile something small (under OUTLIER) that one median of two would still show.
MIN_LIVE = 3
# A step slower than this many times its point's estimate is not the width's price: a first
# call that compiled (a sampling mode, a table width), or the machine stalling.
OUTLIER = 5.0
# A width the live steps have not priced yet, whose guessed price (profile plus host) puts it
# within this share of the best width's rate, is chosen instead until MIN_LIVE steps price it:
# a guess that is too high is otherwise never corrected. At B = 8 the profile put a window of
# 1 draft at the price of one of 2, where it ran 20% cheaper, and one of 4 above one of 8.
EXPLORE = 0.9
# A live point not observed in this many steps (of any width) is priced as a guess again (its
# profile plus host) and its old steps are dropped when it is next chosen: a point priced
# high in a slow spell was otherwise never chosen again, so never corrected. With lookup first
# a 2-draft window read 3-6.4 ms from one run to the next, and the model rested at 6.4.
STALE = 64
# A stale point whose steps priced it again within this share of its old price was right:
# its horizon doubles (up to STALE_MAX steps), so that a settled curve stops paying for the
# re-tries. At B = 8 a run of 64 tokens is about 60 steps of the curve, and every width near
# the best was re-tried in each run.
CONFIRMED, STALE_MAX = 0.9, 16 * STALE


def expected_tokens(alpha: float, drafts: int) -> float:
    """Tokens a chain window of `drafts` drafts emits: sum_{j=0..drafts} alpha^j (the accepted
    drafts plus the target's own token after them)."""
    if alpha >= 1.0:
        return float(drafts + 1)
    return (1.0 - alpha ** (drafts + 1)) / (1.0 - alpha)


# The cost curve's key of a lookup window's width (`window_key`): priced apart from the draft
# model's windows of the same width, which run its steps too.
LOOKUP = "lookup"


def window_key(width: int, lookup: bool = False):
    """The curve's key of a window of `width` drafts: the width, or (LOOKUP, width) for a
    window of lookup drafts alone (a plain step is one key, 0, either way)."""
    return (LOOKUP, width) if lookup and width else width


def candidate_widths(max_drafts: int) -> tuple[int, ...]:
    """The compiled window widths: powers of two below `max_drafts`, and `max_drafts`."""
    widths, w = [], 1
    while w < max_drafts:
        widths.append(w)
        w *= 2
    return (*widths, max_drafts)


class CostCurve:
    """Seconds per step by (drafts per row, batch rows). Two sources: the start-up profile
    (the compiled calls alone, on padding rows) and the live steps (a whole engine step: the
    host's part and the drafter's too). A point measured live is its own price; one only
    profiled is priced at its profile plus the host's part that the plain step shows at that
    batch size (live minus profiled), so that profiled and measured points compare. Between
    measured batch sizes of a width, linear; outside them, the nearest."""

    def __init__(self) -> None:
        self._seconds: dict[tuple[int, int], float] = {}  # live: the median of `_recent`
        self._recent: dict[tuple[int, int], collections.deque] = {}
        self.profiled: dict[tuple[int, int], float] = {}
        self.frozen = False  # True: live steps no longer move the curve (a pinned curve)
        # Moves whenever a price may have: the policy's prices of a step are computed once
        # for it (`WidthPolicy._priced`), not once a question (five a step at B = 1).
        self.version = 0
        self._clock = 0  # live steps observed, of every point
        self._last: dict[tuple[int, int], int] = {}  # the clock at each point's last step
        self._horizon: dict[tuple[int, int], int] = {}  # steps until a point is stale
        self._before: dict[tuple[int, int], float] = {}  # a stale point's last price

    @property
    def seconds(self) -> dict[tuple[int, int], float]:
        return self._seconds

    @seconds.setter
    def seconds(self, points: dict[tuple[int, int], float]) -> None:  # a pinned curve's
        self._seconds = points
        self.version += 1

    def profile(self, width: int, rows: int, seconds: float) -> None:
        self.profiled[width, rows] = seconds
        self.version += 1

    def observe(self, width: int, rows: int, seconds: float) -> None:
        if self.frozen:
            return
        estimate = self.cost(width, rows)
        if estimate is not None and seconds > OUTLIER * estimate:
            return
        key, self._clock = (width, rows), self._clock + 1
        recent = self._recent.setdefault(key, collections.deque(maxlen=WINDOW))
        if self._stale(key):
            self._before[key] = self._seconds[key]
            recent.clear()
        recent.append(seconds)
        self._last[key] = self._clock
        median = statistics.median(recent)
        if len(recent) == MIN_LIVE and key in self._before:
            self._confirm(key, median)
        # Half the steps leave their point's median where it was; a point turning stale
        # moves its price back to the guess.
        turned = any(self._clock - t == self._horizon_of(k) + 1 for k, t in self._last.items())
        if self._seconds.get(key) != median or len(recent) <= MIN_LIVE or turned:
            self._seconds[key] = median
            self.version += 1

    def cost(self, width: int, rows: int) -> float | None:
        live = _interpolate(self.seconds, width, rows)
        if (width, rows) in self.seconds and self._measured(width, rows):
            return live
        profiled = _interpolate(self.profiled, width, rows)
        if profiled is None:
            return live
        return profiled + self._host(width, rows)

    def settled(self, width, rows: int) -> bool:
        """Whether the live steps price this point (a pinned curve: always)."""
        return self.frozen or ((width, rows) in self.seconds and self._measured(width, rows))

    def _measured(self, width: int, rows: int) -> bool:
        recent = self._recent.get((width, rows))
        if recent is None:  # set directly (a pinned curve)
            return True
        return len(recent) >= MIN_LIVE and not self._stale((width, rows))

    def _stale(self, key) -> bool:
        return key in self._last and self._clock - self._last[key] > self._horizon_of(key)

    def _horizon_of(self, key) -> int:
        return self._horizon.get(key, STALE)

    def _confirm(self, key, price: float) -> None:
        """A stale point priced again: its horizon doubles where its old price held (it
        was not high), and is STALE again where the point turned out cheaper."""
        held = price >= CONFIRMED * self._before.pop(key)
        self._horizon[key] = min(2 * self._horizon_of(key), STALE_MAX) if held else STALE

    def _host(self, width, rows: int) -> float:
        """The host's part of a step at `rows` that its profile leaves out: the plain step's
        (live less profiled), or for a window, where two or more windows of its kind are
        priced live at `rows`, the least that any of them runs over its profile. A window's
        host work (drafting, judging every row) is more than a plain step's: at B = 8 the
        windows ran 6-9 ms over their profiles and the plain step under its own, so every
        unpriced or stale width looked worth trying. The least, and two at least, since a
        guess should err low: one that is low is tried and corrected, one that is high never
        is (one window's slow spell would price every other width out)."""
        plain = self._plain_host(rows)
        if width == 0:
            return plain
        kind = isinstance(width, tuple)
        over = [
            self._seconds[w, b] - self.profiled[w, b]
            for w, b in self._seconds
            if b == rows
            and w != 0
            and isinstance(w, tuple) == kind
            and (w, b) in self.profiled
            and self._measured(w, b)
        ]
        return max(min(over), plain) if len(over) >= 2 else plain

    def _plain_host(self, rows: int) -> float:
        live, profiled = _interpolate(self.seconds, 0, rows), _interpolate(self.profiled, 0, rows)
        if live is None or profiled is None:
            return 0.0
        return max(live - profiled, 0.0)


def _interpolate(points: dict, width: int, rows: int) -> float | None:
    if (width, rows) in points:
        return points[width, rows]
    known = sorted(b for w, b in points if w == width)
    if not known:
        return None
    i = bisect.bisect_left(known, rows)
    if i == 0 or i == len(known):
        return points[width, known[min(i, len(known) - 1)]]
    lo, hi = known[i - 1], known[i]
    a, b = points[width, lo], points[width, hi]
    return a + (b - a) * (rows - lo) / (hi - lo)


class WidthPolicy:
    """Chooses each verify step's width from the cost curve and the requests' acceptance."""

    def __init__(self, max_drafts: int, curve: CostCurve | None = None) -> None:
        self.widths = candidate_widths(max_drafts)
        self.curve = curve or CostCurve()
        self._cache: dict = {}  # at the curve's `version`: (rows, lookup) -> `_priced`
        self._version = None
        # Batch rows -> seconds of a draft model's lag pass of one token (profiled): what a
        # row that starts to rest costs when it drafts again (`best`'s `rest`).
        self.lag: dict[int, float] = {}

    def rest_price(self, rows: int) -> float:
        """A one-token lag pass at `rows` (the nearest profiled batch; 0 if none)."""
        if not self.lag:
            return 0.0
        return self.lag[min(self.lag, key=lambda b: (abs(b - rows), b))]

    def _priced(self, rows: int, lookup: bool = False) -> list[tuple[int, float]]:
        """(width, cost) for width 0 and every candidate width the curve prices (of lookup
        windows with `lookup`), computed once at each version of the curve: a plain step at
        B = 1 is 1.5 ms, and the policy's host work in it had been 0.13 ms."""
        if self._version != self.curve.version:
            self._cache, self._version = {}, self.curve.version
        priced = self._cache.get((rows, lookup))
        if priced is None:
            keys = [(w, window_key(w, lookup)) for w in (0, *self.widths)]
            priced = [(w, self.curve.cost(key, rows)) for w, key in keys]
            priced = [(w, c) for w, c in priced if c is not None and c > 0]
            self._cache[rows, lookup] = priced
        return priced

    def choose(
        self, alphas: Sequence[float], available: Sequence[int], rows: int, lookup: bool = False
    ) -> int:
        """The width maximising expected tokens per second over the step's requests (alpha
        and drafts available each); the widest when the curve prices no plain step yet."""
        return self.best(alphas, available, rows, lookup)[0]

    def best(
        self,
        alphas: Sequence[float],
        available: Sequence[int],
        rows: int,
        lookup: bool = False,
        rest: float = 0.0,
    ) -> tuple[int, float]:
        """(width, expected tokens per second) of `choose`'s width (rate inf: unpriced): the
        best rate, or an unsettled width near it (`EXPLORE`). `rest`: seconds that resting
        the draft model's rows costs later (a lag pass when they draft again), added to every
        width at which they rest: the plain step, and with `lookup` every window (lookup
        windows alone rest the model's rows)."""
        priced = self._priced(rows, lookup)
        if not priced or priced[0][0] != 0:
            return self.widths[-1], float("inf")
        if rest:
            priced = [(w, c + rest) if lookup or w == 0 else (w, c) for w, c in priced]
        pairs = list(zip(alphas, available, strict=True))
        rated = [(w, sum(expected_tokens(a, min(w, n)) for a, n in pairs) / c) for w, c in priced]
        top = max(rated, key=lambda x: x[1])
        untried = [
            (w, r)
            for w, r in rated
            if r >= EXPLORE * top[1] and not self.curve.settled(window_key(w, lookup), rows)
        ]
        return max(untried, key=lambda x: x[1]) if untried else top

    def break_even(self, rows: int = 1) -> float:
        """The acceptance at which the best width's expected tokens per second equal a plain
        step's, for one request in a batch of `rows` (0 when nothing is priced: no resting)."""
        return self._first_paying(rows)[1]

    def probe_width(self, rows: int = 1) -> int:
        """The width a probe drafts: the one that starts paying first (at the break-even),
        so that a probe tests the window its request would get if its drafts got better."""
        return self._first_paying(rows)[0]

    def _first_paying(self, rows: int) -> tuple[int, float]:
        # Lookup first: a request drafts by lookup where it can, so its cheaper windows count.
        priced = self._priced(rows)
        if len(priced) < 2 or priced[0][0] != 0:
            return 1, 0.0
        found = self._cache.get(("paying", rows))  # `_priced` keeps the cache current
        if found is None:
            plain = priced[0][1]
            windows = priced[1:] + self._priced(rows, lookup=True)[1:]
            found = _lowest_root([(w, c / plain) for w, c in windows])
            self._cache["paying", rows] = found
        return found


def _lowest_root(ratios: list[tuple[int, float]]) -> tuple[int, float]:
    """(width, alpha) of the width that pays from the lowest acceptance, of (width, cost over
    a plain step) pairs; on a tie the first. Widths whose `_floor` is above the best found so
    far are not solved: each bisection is 5 us, and this runs every step."""
    order = sorted(range(len(ratios)), key=lambda i: (_floor(*ratios[i]), i))
    best, at = (1, 1.0), None
    for i in order:
        if at is not None and (_floor(*ratios[i]), i) > (best[1], at):
            break
        alpha = _solve(*ratios[i])
        if at is None or (alpha, i) < (best[1], at):
            best, at = (ratios[i][0], alpha), i
    return best


def _floor(width: int, ratio: float) -> float:
    """A lower bound of `_solve(width, ratio)`: E(alpha, w) <= 1 + w alpha, and
    E(alpha, w) < 1 / (1 - alpha)."""
    if ratio <= 1.0:
        return 0.0
    return min(max((ratio - 1.0) / width, 1.0 - 1.0 / ratio), 1.0)


def _solve(width: int, ratio: float) -> float:
    """The alpha with expected_tokens(alpha, width) == ratio (it increases in alpha from 1
    to width + 1), clamped to [0, 1]: the roots of the linear and quadratic, else bisection."""
    if ratio <= 1.0:
        return 0.0
    if ratio >= width + 1:
        return 1.0
    if width == 1:  # 1 + alpha
        return ratio - 1.0
    if width == 2:  # 1 + alpha + alpha^2
        return (math.sqrt(4.0 * ratio - 3.0) - 1.0) / 2.0
    lo, hi = 0.0, 1.0
    for _ in range(24):  # to 6e-8: it runs for every width at every step (`break_even`)
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, width) < ratio else (lo, mid)
    return hi


def time_rounds(calls: dict, repeats: int) -> dict:
    """Each call's median time (the profile of the curve) over `repeats` rounds that run every
    call once in turn, after a compiling round and a warm one."""
    for _ in range(2):
        for call in calls.values():
            jax.block_until_ready(call())
    times: dict = {key: [] for key in calls}
    for _ in range(repeats):
        for key, call in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(call())
            times[key].append(time.perf_counter() - t0)
    return {key: statistics.median(t) for key, t in times.items()}
