"""The tokens a draft model has not consumed yet, per state slot.

A row that rests (adaptive drafting gave it no drafts) runs no draft-model step: its last
token joins the slot's lag instead. A lag is written into the draft's caches in one window
pass (`Lag.take`) before the draft next runs for that slot, before the slot's state is
copied (prefix-cache snapshots and restores), or once it holds `MAX_LAG` tokens. A rest step
then costs the target's decode step alone; the draft's one step had cost a third of it on a
CPU (benchmarks/RESULTS.md, "Resting rows lag").
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kimi_linear_jax.cache import Batch

# A lag is written once it holds this many tokens, which bounds the pass's width (the widths
# compiled are the powers of two up to it).
MAX_LAG = 16
# The widths of a lag pass: the powers of two up to MAX_LAG (`Lag.take`).
LAG_WIDTHS = tuple(1 << i for i in range(MAX_LAG.bit_length()))


@dataclasses.dataclass
class _Pending:
    start: int  # position of the first token
    tokens: list[int]
    pages: np.ndarray  # the slot's block-table row (pages of positions already placed stay)


class Lag:
    def __init__(self) -> None:
        self._by_slot: dict[int, _Pending] = {}

    def add(self, slot: int, position: int, token: int, pages: np.ndarray) -> None:
        """The target consumed `token` at `position` in `slot` and the draft did not."""
        pending = self._by_slot.setdefault(int(slot), _Pending(int(position), [], pages))
        if pending.start + len(pending.tokens) != position:
            raise ValueError(
                f"slot {slot}: lag ends at {pending.start + len(pending.tokens)}, "
                f"token at {position}"
            )
        pending.tokens.append(int(token))
        pending.pages = pages

    def pending(self, slot: int) -> bool:
        return int(slot) in self._by_slot

    def full(self, slot: int) -> bool:
        return self.room(slot) <= 0

    def room(self, slot: int) -> int:
        """Tokens the slot's lag may still take."""
        pending = self._by_slot.get(int(slot))
        return MAX_LAG - (0 if pending is None else len(pending.tokens))

    def drop(self, slots) -> None:
        """Forget these slots' lags (a fresh prefill or a copy overwrites their state)."""
        for slot in np.asarray(slots).reshape(-1):
            self._by_slot.pop(int(slot), None)

    def take(self, slots, rows: int) -> tuple[np.ndarray, Batch] | None:
        """(ids [rows', W], Batch) writing the lags of `slots` (those that have one), and
        forget them; None when none has. rows' = max(rows, lags taken); W = the next power
        of two >= the longest lag."""
        taken = [(s, self._by_slot.pop(int(s))) for s in slots if int(s) in self._by_slot]
        if not taken:
            return None
        b = max(rows, len(taken))
        width = 1 << (max(len(p.tokens) for _, p in taken) - 1).bit_length()
        ids = np.zeros((b, width), np.int32)
        table = np.zeros((b, max(p.pages.shape[0] for _, p in taken)), np.int32)
        slot_ids, start, lengths = (np.zeros(b, np.int32) for _ in range(3))
        for i, (slot, p) in enumerate(taken):
            ids[i, : len(p.tokens)] = p.tokens
            table[i, : p.pages.shape[0]] = p.pages
            slot_ids[i], start[i], lengths[i] = slot, p.start, len(p.tokens)
        return ids, Batch(slot_ids, table, start, lengths)
