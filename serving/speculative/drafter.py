"""The drafter interface. Chain layout only: a request gets at most k drafts, one per position
after its last token; the verify window is `[last, d_1 .. d_n]`.

The runner calls, per step: `prefill` after the target's prefill (same batch and block tables,
so a drafter with its own caches stays in step), `propose` before the verify, and `rollback`
after it with the accepted lengths. Host drafters (n-gram, oracle) only implement `propose`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


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

    def prefill(self, ids, batch, fresh_slots, has_prefix: bool) -> None:
        """Mirror the target's prefill chunk (drafters with caches)."""

    def copy_slots(self, pairs, width: int) -> None:
        """Mirror the target's prefix-cache slot copies (drafters with caches)."""

    def rollback(self, slots, commit_lens, track=None) -> None:
        """Keep the drafter's state for the accepted tokens only (drafters with caches).
        `track`: (track slots, track steps [B], -1: none) when the target snapshots rows of
        this window for the prefix cache; a drafter with a recurrent state snapshots its own
        state there too."""

    def reset(self) -> None:
        """Empty every slot and page (the engine rebuilt the target's caches after a fault)."""
