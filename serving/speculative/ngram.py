"""N-gram (prompt lookup) drafter: model-free, on the host.

Find the most recent earlier occurrence of the request's last n tokens (n from `max_n` down to
`min_n`) in its own tokens, and propose the tokens that followed it. Repetitive text (code,
quoted context, lists) accepts many drafts; elsewhere it usually proposes nothing, which costs
nothing: the step then verifies a window of one.
"""

from __future__ import annotations

from serving.speculative.drafter import Drafter


def ngram_lookup(tokens: list[int], max_drafts: int, max_n: int, min_n: int = 1) -> list[int]:
    """The continuation of the latest earlier match of the longest suffix n-gram, n in
    [min_n, max_n]; [] when none matches."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n :]
        # Latest match first: recent context predicts best. The match must end before the suffix.
        for start in range(size - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + max_drafts]
                if follow:
                    return follow
    return []


class NgramDrafter(Drafter):
    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}"
            )
        self.max_n = max_n
        self.min_n = min_n

    def propose_tokens(self, request, max_drafts: int) -> list[int]:
        return ngram_lookup(request.all_token_ids, max_drafts, self.max_n, self.min_n)
