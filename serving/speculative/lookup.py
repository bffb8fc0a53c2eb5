"""Lookup first, the draft model's host part: each row's prompt-lookup drafts (a row whose
context recurs drafts so instead of by the model) and the window ids of those rows, which the
draft writes after the verify (`draft_writes.catch_up`).

Under cost-aware widths the verifier asks where each row's drafts come from before it chooses
the width (`DraftModelDrafter.plan`): a lookup window runs none of the model's steps and costs
less, so it may pay wider. The drafts found then are kept for the step's `propose` (`Ahead`),
which trims them to the room the chosen width leaves: prompt lookup's drafts for less room are
the first of those for more (`ngram_lookup` votes each next token on the same occurrences).
"""

from __future__ import annotations

import numpy as np


def look_up(lookup, lookup_tokens: int, requests, max_drafts, b: int, topk=None) -> list[list]:
    """Each row's lookup drafts (up to `lookup_tokens` and its room), or its tree's nodes with
    `topk` ([] where the context does not recur, padding rows, or `lookup` None)."""
    looked: list[list] = [[] for _ in range(b)]
    if lookup is None:
        return looked
    for i, (request, n) in enumerate(zip(requests, max_drafts, strict=True)):
        m = min(n, lookup_tokens)
        if m <= 0:
            continue
        if topk is None:
            looked[i] = lookup.propose_tokens(request, m)[:n]
        else:
            looked[i] = lookup.propose_tree_tokens(request, m, topk)[:m]
    return looked


def lookup_window(looked, last, k: int):
    """(rows [B] bool, window ids [B, k + 1]) of the rows that drafted by lookup, or None."""
    rows = np.array([bool(d) for d in looked], bool)
    if not rows.any():
        return None
    window = np.zeros((len(looked), k + 1), np.int32)
    window[:, 0] = last
    for i, d in enumerate(looked):
        window[i, 1 : 1 + len(d)] = d
    return rows, window


class Ahead:
    """The chain drafts `plan` looked up for a step, kept for that step's `propose` alone."""

    def __init__(self) -> None:
        self._kept: tuple | None = None  # (request ids, drafts per row)

    def keep(self, requests, looked: list[list]) -> None:
        self._kept = (tuple(r.request_id for r in requests), looked)

    def take(self, requests, max_drafts) -> list[list] | None:
        """The kept drafts trimmed to `max_drafts` (padding rows: []), if kept for these
        requests; None otherwise. Either way nothing stays kept."""
        kept, self._kept = self._kept, None
        if kept is None or kept[0] != tuple(r.request_id for r in requests):
            return None
        looked = kept[1]
        rooms = list(max_drafts) + [0] * (len(looked) - len(max_drafts))
        return [d[: max(n, 0)] for d, n in zip(looked, rooms, strict=True)]
