"""Oracle drafter for tests and benchmarks: replays a known continuation of each prompt, with
wrong tokens injected, so that acceptance is controlled exactly.

`continuations` maps a prompt (tuple of ids) to the tokens that greedy decoding produces after
it. `wrong(position)` says whether the draft for output position `position` (0-based index into
the continuation) is replaced by a wrong token, which rejects it and everything after it in the
window.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from serving.speculative.drafter import Drafter


class OracleDrafter(Drafter):
    def __init__(
        self,
        continuations: Mapping[tuple[int, ...], Sequence[int]],
        vocab_size: int,
        wrong: Callable[[int], bool] = lambda position: False,
    ) -> None:
        self.continuations = {tuple(k): list(v) for k, v in continuations.items()}
        self.vocab_size = vocab_size
        self.wrong = wrong

    def propose_tokens(self, request, max_drafts: int) -> list[int]:
        truth = self.continuations.get(tuple(request.prompt_token_ids))
        if truth is None:
            return []
        done = len(request.output_token_ids)
        drafts = []
        for position in range(done, min(done + max_drafts, len(truth))):
            token = truth[position]
            drafts.append((token + 1) % self.vocab_size if self.wrong(position) else token)
        return drafts
