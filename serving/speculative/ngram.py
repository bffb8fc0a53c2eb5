"""N-gram (prompt lookup) drafter: model-free, on the host.

Find every earlier occurrence of the request's last n tokens (the longest n in
[`min_n`, `max_n`] that occurs), and draft what followed them, one token at a time: the token
that most of the occurrences still in agreement continue with (ties: the most recent), then
only the occurrences that continued that way go on voting. One occurrence drafts exactly what
followed it. Voting rather than copying the latest match is what suffix-tree drafting does:
on held-out code the built-in model's greedy continuations loop, and the most frequent
continuation of a loop is the one it takes again (benchmarks/RESULTS.md, "n-gram by vote").
Repetitive text (code, quoted context, lists) accepts many drafts; elsewhere it usually
proposes nothing, which costs nothing: the step is then a plain decode step, unless a corpus
n-gram table (`ngram_table.py`) drafts a few tokens there.

Trees (`ngram_tree`): where the occurrences' continuations disagree, the tree holds several.
Each node's children are the up-to-`topk` most voted distinct next tokens of the occurrences
that led to it (ties: the most recent), each child carried on by the occurrences that
continued that way. Nodes are allotted best first by their support, the number of
occurrences that followed the node's whole path: the empirical probability of the path, so
the tree holds the `max_nodes` likeliest continuations (ties: the latest occurrence). With
topk = 1 it is `ngram_lookup`'s chain.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools

import jax.numpy as jnp
import numpy as np

from serving.speculative.drafter import Drafter, DraftRecord, chain

# Lookups kept for shadows (`NgramDrafter.shadow`) before the kept ones are dropped: one a
# running request; a finished request's stays until then.
MAX_KEPT = 1024


def _ends(seq: np.ndarray, n: int) -> np.ndarray:
    """Ascending positions just after each earlier occurrence of seq's last n tokens; each is a
    valid index (a token followed the occurrence), so the suffix itself never counts."""
    size = seq.shape[0]
    hit = np.ones(size - n, bool)
    for j in range(n):
        hit &= seq[j : j + size - n] == seq[size - n + j]
    return np.flatnonzero(hit) + n


def suffix_recurs(seq, length, n: int):
    """On device, per row: whether the last `n` of the first `length[b]` tokens of `seq[b]`
    occur earlier, followed by a token (`_ends(...).size > 0`; `n` static). seq [B, C],
    length [B] (n < length <= C for a hit); whatever lies past `length` is never read as a
    token: an occurrence must start before length - n."""
    pos = jnp.arange(seq.shape[1])
    hit = pos[None, :] < (length - n)[:, None]
    for t in range(n):
        tail = jnp.take_along_axis(seq, jnp.maximum(length - n + t, 0)[:, None], axis=1)
        # Column j of the shifted seq is token j + t; j + t < length, so no wrap is read.
        hit &= jnp.roll(seq, -t, axis=1) == tail
    return hit.any(axis=1)


def _vote(seq: np.ndarray, ends: np.ndarray, max_drafts: int) -> list[int]:
    out: list[int] = []
    while len(out) < max_drafts:
        ends = ends[ends + len(out) < seq.shape[0]]
        if not ends.size:
            break
        nxt = seq[ends + len(out)][::-1]  # most recent first, so ties go to it
        values, first, counts = np.unique(nxt, return_index=True, return_counts=True)
        best = max(range(len(values)), key=lambda i: (counts[i], -first[i]))
        token = values[best]
        out.append(int(token))
        ends = ends[nxt[::-1] == token]
    return out


def _suffix_ends(seq: np.ndarray, max_n: int, min_n: int) -> np.ndarray:
    """`_ends` of the longest suffix n-gram (n in [min_n, max_n]) that occurs; empty if none."""
    for n in range(min(max_n, seq.shape[0] - 1), min_n - 1, -1):
        ends = _ends(seq, n)
        if ends.size:
            return ends
    return np.zeros(0, np.int64)


def ngram_lookup(tokens, max_drafts: int, max_n: int, min_n: int = 1) -> list[int]:
    """Up to `max_drafts` tokens continuing `tokens`, voted by the earlier occurrences of its
    longest suffix n-gram (n in [min_n, max_n]); [] when none occurs."""
    seq = np.asarray(tokens, np.int64)
    ends = _suffix_ends(seq, max_n, min_n)
    return _vote(seq, ends, max_drafts) if ends.size else []


def _children(seq: np.ndarray, ends: np.ndarray, depth: int, topk: int):
    """Up to `topk` (token, its occurrences) continuing the occurrences `ends` after `depth`
    tokens, most voted first (ties: the most recent, as `_vote`)."""
    ends = ends[ends + depth < seq.shape[0]]
    nxt = seq[ends + depth]
    values, first, counts = np.unique(nxt[::-1], return_index=True, return_counts=True)
    order = sorted(range(len(values)), key=lambda i: (-counts[i], first[i]))[:topk]
    return [(int(values[i]), ends[nxt == values[i]]) for i in order]


def ngram_tree(
    tokens, max_nodes: int, max_n: int, min_n: int = 1, topk: int = 1
) -> list[tuple[int, int]]:
    """Up to `max_nodes` tree nodes (token, parent node; 0: the last token) continuing
    `tokens`, voted by the earlier occurrences of its longest suffix n-gram, at most `topk`
    children a node, allotted best first by support (the module's docstring); [] when none
    occurs."""
    seq = np.asarray(tokens, np.int64)
    ends = _suffix_ends(seq, max_n, min_n)
    nodes: list[tuple[int, int]] = []
    # Candidates never share an occurrence (none is another's ancestor), so (support, latest
    # occurrence) orders them totally; the counter only keeps the arrays out of comparisons.
    frontier: list = []
    tie = itertools.count()

    def expand(node: int, depth: int, occurrences: np.ndarray) -> None:
        for token, sub in _children(seq, occurrences, depth, topk):
            entry = (-sub.size, -int(sub[-1]), next(tie), token, node, depth + 1, sub)
            heapq.heappush(frontier, entry)

    if ends.size:
        expand(0, 0, ends)
    while frontier and len(nodes) < max_nodes:
        *_, token, parent, depth, sub = heapq.heappop(frontier)
        nodes.append((token, parent))
        expand(len(nodes), depth, sub)
    return nodes


def ngram_lookup_reference(
    tokens: list[int], max_drafts: int, max_n: int, min_n: int = 1
) -> list[int]:
    """`ngram_lookup` written as plain loops over the occurrences (its test reference)."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        occurrences = [  # most recent first
            s + n for s in range(size - n - 1, -1, -1) if tokens[s : s + n] == tokens[size - n :]
        ]
        if not occurrences:
            continue
        out: list[int] = []
        while len(out) < max_drafts:
            occurrences = [e for e in occurrences if e + len(out) < size]
            votes = collections.Counter(tokens[e + len(out)] for e in occurrences)
            if not votes:
                break
            order = [tokens[e + len(out)] for e in occurrences]
            token = max(votes, key=lambda t: (votes[t], -order.index(t)))
            out.append(token)
            occurrences = [e for e in occurrences if tokens[e + len(out) - 1] == token]
        return out
    return []


def ngram_tree_reference(
    tokens: list[int], max_nodes: int, max_n: int, min_n: int = 1, topk: int = 1
) -> list[tuple[int, int]]:
    """`ngram_tree` written as plain loops over the occurrences (its test reference)."""
    size = len(tokens)

    def children(node, depth, occurrences):  # occurrences: most recent first
        going = [e for e in occurrences if e + depth < size]
        votes = collections.Counter(tokens[e + depth] for e in going)
        order = [tokens[e + depth] for e in going]
        ranked = sorted(votes, key=lambda t: (-votes[t], order.index(t)))[:topk]
        return [(t, node, depth + 1, [e for e in going if tokens[e + depth] == t]) for t in ranked]

    for n in range(min(max_n, size - 1), min_n - 1, -1):
        occurrences = [
            s + n for s in range(size - n - 1, -1, -1) if tokens[s : s + n] == tokens[size - n :]
        ]
        if not occurrences:
            continue
        nodes: list[tuple[int, int]] = []
        candidates = children(0, 0, occurrences)
        while candidates and len(nodes) < max_nodes:
            best = max(candidates, key=lambda c: (len(c[3]), max(c[3])))
            candidates.remove(best)
            nodes.append((best[0], best[1]))
            candidates += children(len(nodes), best[2], best[3])
        return nodes
    return []


@dataclasses.dataclass
class TableRecord(DraftRecord):
    """A request's record of the corpus table's drafts (`DraftRecord`), with the last drafts
    and where they stood."""

    drafts: tuple[int, ...] = ()
    at: int = 0


class NgramDrafter(Drafter):
    """Prompt lookup; where the request's tokens do not recur, an optional corpus n-gram
    `table` drafts up to `table_drafts` tokens (`ngram_table.py`), while the request's
    acceptance of them stays at `min_acceptance` or above."""

    def __init__(
        self,
        max_n: int = 3,
        min_n: int = 2,
        table=None,
        table_drafts: int = 2,
        min_acceptance: float = 0.0,
    ) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}"
            )
        self.max_n = max_n
        self.min_n = min_n
        self.table = table
        self.table_drafts = table_drafts
        self.min_acceptance = min_acceptance
        self.table_draft_tokens = 0  # drafts proposed by the table (metrics)
        # request id -> (its length, its lookup's first draft) from `propose_tokens`: a row
        # that verifies nothing shadows the same lookup's first draft (`shadow`).
        self._first: dict[str, tuple[int, int | None]] = {}

    @property
    def recurrence_n(self) -> int | None:
        # Lookup drafts iff the last min_n tokens recur (a longer match contains that one);
        # a corpus table may draft anywhere else.
        return self.min_n if self.table is None else None

    def propose_tokens(self, request, max_drafts: int) -> list[int]:
        ids = request.all_token_ids
        drafts = ngram_lookup(ids, max_drafts, self.max_n, self.min_n)
        if max_drafts > 0:
            if len(self._first) > MAX_KEPT:  # finished requests' entries
                self._first.clear()
            self._first[request.request_id] = (len(ids), drafts[0] if drafts else None)
        return drafts or self._table_tokens(request, max_drafts)

    shadows = True

    def shadow(self, request) -> int | None:
        # Prompt lookup alone: the corpus table scores its own drafts (`_table_may_draft`).
        # The lookup's first draft is the same for any room (each next token is voted on the
        # same occurrences), so this step's lookup, where it ran, is the shadow: a second
        # lookup was a tenth of the cost-aware policy's host work in a plain step.
        ids = request.all_token_ids
        kept = self._first.pop(request.request_id, None)
        if kept is not None and kept[0] == len(ids):
            return kept[1]
        drafts = ngram_lookup(ids, 1, self.max_n, self.min_n)
        return drafts[0] if drafts else None

    def propose_tree_tokens(self, request, max_nodes: int, topk: int) -> list[tuple[int, int]]:
        # The corpus table drafts a chain where the request's own tokens do not recur.
        tree = ngram_tree(request.all_token_ids, max_nodes, self.max_n, self.min_n, topk)
        return tree or chain(self._table_tokens(request, max_nodes))

    def _table_tokens(self, request, max_drafts: int) -> list[int]:
        """The corpus table's drafts, where it may draft for the request."""
        if self.table is None or not self._table_may_draft(request):
            return []
        tokens = request.all_token_ids
        drafts = self.table.draft(tokens, min(max_drafts, self.table_drafts))
        self.table_draft_tokens += len(drafts)
        if drafts:
            self.ungated |= {request.request_id}
            request.drafter_state.drafts, request.drafter_state.at = tuple(drafts), len(tokens)
        return drafts

    def _table_may_draft(self, request) -> bool:
        """Score the table's last drafts for the request against the tokens that followed
        them, then: may it draft now (acceptance high enough, or a probe)? On text unlike the
        corpus its drafts mostly fail, and each failed window costs more than a plain step."""
        record = request.drafter_state = request.drafter_state or TableRecord()
        if record.drafts:
            after = request.all_token_ids[record.at : record.at + len(record.drafts)]
            hits = next((i for i, (d, t) in enumerate(zip(record.drafts, after)) if d != t), None)
            rate = (len(after) if hits is None else hits) / len(record.drafts)
            record.score(rate)
            record.drafts = ()
        return record.may_draft(self.min_acceptance)

    def propose(self, requests, max_drafts, batch, k: int, checkpointed=()):
        # The table's drafts are judged by their own record (`_table_may_draft`), not by the
        # request's acceptance: counted in, their misses made requests rest, which stopped the
        # prompt lookup's long windows too (1.24x against the lookup alone's 1.27x;
        # RESULTS.md, "corpus n-grams").
        self.ungated = frozenset()
        drafts, num = super().propose(requests, max_drafts, batch, k, checkpointed)
        # Table drafts are short: a window holding only those is that wide, not k + 1 (in the
        # engine on the CPU, a 3-token window costs 1.5-1.66 plain steps, a 9-token one 2.4).
        if self.table is not None and k > self.table_drafts >= num.max():
            drafts = drafts[:, : self.table_drafts]
        return drafts, num

    def propose_tree(self, requests, max_nodes, batch, n: int, topk: int, checkpointed=()):
        self.ungated = frozenset()  # as in `propose`: this window's table drafts only
        return super().propose_tree(requests, max_nodes, batch, n, topk, checkpointed)
