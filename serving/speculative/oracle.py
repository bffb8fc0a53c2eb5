"""Oracle drafter for tests and benchmarks: replays a known continuation of each prompt, with
wrong tokens injected, so that acceptance is controlled exactly.

`continuations` maps a prompt (tuple of ids) to the tokens that greedy decoding produces after
it. `wrong(position)` says whether the draft for output position `position` (0-based index into
the continuation) is replaced by a wrong token, which rejects it and everything after it in the
window; a mapping of prompts to such functions draws each prompt's wrong positions apart (a
batch's rows then sample an acceptance level independently instead of repeating one draw).

Trees (`propose_tree_tokens`): at each depth up to `topk` siblings, children of the node that
carries the true token one depth up; `branch(position)` is the sibling index (clipped to the
siblings there) that carries the true token of that position, the others wrong distinct
tokens, so that a test can make the verify accept down any branch. Only the true node has
children; with `wrong(position)` no sibling carries the truth. Nodes go depth by depth, so a
cap of max_nodes trims the last depth.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from serving.speculative.drafter import Drafter


class OracleDrafter(Drafter):
    def __init__(
        self,
        continuations: Mapping[tuple[int, ...], Sequence[int]],
        vocab_size: int,
        wrong: Callable[[int], bool] | Mapping[tuple[int, ...], Callable[[int], bool]] = (
            lambda position: False
        ),
        branch: Callable[[int], int] = lambda position: 0,
    ) -> None:
        self.continuations = {tuple(k): list(v) for k, v in continuations.items()}
        self.vocab_size = vocab_size
        self.wrong = wrong
        self.branch = branch

    def _truth(self, request) -> tuple[list[int], int]:
        """(the prompt's continuation, [] if unknown; output tokens so far)."""
        truth = self.continuations.get(tuple(request.prompt_token_ids), [])
        return truth, len(request.output_token_ids)

    def _wrong(self, request) -> Callable[[int], bool]:
        if isinstance(self.wrong, Mapping):
            return self.wrong[tuple(request.prompt_token_ids)]
        return self.wrong

    def propose_tokens(self, request, max_drafts: int) -> list[int]:
        truth, done = self._truth(request)
        wrong, drafts = self._wrong(request), []
        for position in range(done, min(done + max_drafts, len(truth))):
            token = truth[position]
            drafts.append((token + 1) % self.vocab_size if wrong(position) else token)
        return drafts

    shadows = True

    def shadow(self, request) -> int | None:
        drafts = self.propose_tokens(request, 1)
        return drafts[0] if drafts else None

    def propose_tree_tokens(self, request, max_nodes: int, topk: int) -> list[tuple[int, int]]:
        truth, done = self._truth(request)
        nodes: list[tuple[int, int]] = []
        parent, wrong = 0, self._wrong(request)
        for position in range(done, len(truth)):
            width = min(topk, max_nodes - len(nodes))
            if width <= 0:
                break
            true_at = -1 if wrong(position) else min(self.branch(position), width - 1)
            token, base = truth[position], len(nodes) + 1
            for i in range(width):
                # Wrong tokens: the next ones after the truth, distinct and never the truth.
                offset = 0 if i == true_at else i + 1 if true_at < 0 or i < true_at else i
                nodes.append(((token + offset) % self.vocab_size, parent))
            if true_at < 0:
                break
            parent = base + true_at
        return nodes
