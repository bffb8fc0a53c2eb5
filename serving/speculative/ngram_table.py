"""A corpus n-gram table: for each context of n tokens seen in a corpus, the token that most
often followed it. The n-gram drafter chains it (longest context first, backing off to
shorter ones) where the request's own tokens do not recur.

Prompt lookup finds nothing at about a third of the tokens of held-out code continuations;
those steps are plain decode steps. Code repeats across files, though (`self.`, `return`,
`def __init__(self`), so the training corpus predicts many of them: in a replay of the
built-in model's own continuations, corpus drafts turned most of those steps into windows of
about two tokens (benchmarks/RESULTS.md, "corpus n-grams"). The table is REST's datastore
(He et al., 2023) reduced to what a chain drafter needs: one next token per context, kept
only where the corpus agrees on it.

Contexts are packed into one uint64 per context (`n * bits <= 64`), sorted, and looked up by
binary search: a few microseconds per draft token, a few MB for a corpus of millions of
tokens.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from kimi_linear_jax import corpus

# Defaults chosen on the replay (RESULTS.md): contexts of 3 tokens, then 2; a context must
# have been seen twice, and its most frequent follower must hold 30% of what followed it.
ORDERS = (3, 2)
MIN_COUNT = 2
MIN_SHARE = 0.3


def _pack(windows: np.ndarray, bits: int) -> np.ndarray:
    """[N, n] token windows -> [N] uint64 keys, first token most significant, so that the keys
    sort as the windows do."""
    key = np.zeros(windows.shape[0], np.uint64)
    for j in range(windows.shape[1]):
        key = (key << np.uint64(bits)) | windows[:, j].astype(np.uint64)
    return key


def _windows(stream: np.ndarray, n: int) -> np.ndarray:
    return np.lib.stride_tricks.sliding_window_view(stream, n + 1)


def _best_followers(keys: np.ndarray, nxt: np.ndarray, min_count: int, min_share: float):
    """(context keys, follower) kept: per distinct key, the most frequent follower (ties: the
    smallest id), where the key occurs `min_count` times or more and that follower makes up
    `min_share` of them."""
    order = np.lexsort((nxt, keys))
    keys, nxt = keys[order], nxt[order]
    new_key = np.ones(keys.shape[0], bool)
    new_key[1:] = keys[1:] != keys[:-1]
    new_pair = new_key.copy()
    new_pair[1:] |= nxt[1:] != nxt[:-1]
    pair_start = np.flatnonzero(new_pair)
    pair_count = np.diff(np.append(pair_start, keys.shape[0]))
    pair_key = np.cumsum(new_key)[pair_start] - 1  # which distinct key each pair belongs to
    key_start = np.flatnonzero(new_key)
    key_count = np.diff(np.append(key_start, keys.shape[0]))
    # Per key, the pair with the largest count; among equals the first, i.e. the smallest id.
    by_count = np.lexsort((np.arange(pair_count.shape[0]), -pair_count, pair_key))
    first = np.ones(by_count.shape[0], bool)
    first[1:] = pair_key[by_count][1:] != pair_key[by_count][:-1]
    best = by_count[first]  # one pair per key, in key order
    keep = (key_count >= min_count) & (pair_count[best] >= min_share * key_count)
    return keys[key_start][keep], nxt[pair_start[best]][keep].astype(np.int32)


class NgramTable:
    """Next-token tables for contexts of `orders` tokens, built from token streams."""

    def __init__(
        self,
        streams: Iterable[Sequence[int]],
        orders: Sequence[int] = ORDERS,
        min_count: int = MIN_COUNT,
        min_share: float = MIN_SHARE,
    ) -> None:
        streams = [np.asarray(s, np.int64) for s in streams]
        if not streams or not any(s.size for s in streams):
            raise ValueError("an n-gram table needs at least one non-empty token stream")
        if any(s.size and s.min() < 0 for s in streams):
            raise ValueError("an n-gram table's token ids must be >= 0")
        top = max(int(s.max()) for s in streams if s.size)
        self.bits = max(1, top.bit_length())
        self.orders = tuple(sorted(set(orders), reverse=True))
        if not self.orders or self.orders[-1] < 1 or self.orders[0] * self.bits > 64:
            raise ValueError(
                f"n-gram table orders {tuple(orders)} must be >= 1 and pack into 64 bits "
                f"({self.bits} bits per token: at most {64 // self.bits} tokens)"
            )
        self.tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for n in self.orders:
            # Windows never cross two streams (documents): each is cut on its own.
            wins = [_windows(s, n) for s in streams if s.size > n]
            win = np.concatenate(wins) if wins else np.zeros((0, n + 1), np.int64)
            keys = _pack(win[:, :n], self.bits)
            self.tables[n] = _best_followers(keys, win[:, n], min_count, min_share)

    def __len__(self) -> int:
        return sum(keys.shape[0] for keys, _ in self.tables.values())

    def next_token(self, tokens: Sequence[int]) -> int | None:
        """The kept follower of the longest context ending `tokens`, or None."""
        for n in self.orders:
            if len(tokens) < n:
                continue
            ctx = tokens[len(tokens) - n :]
            if any(t < 0 or t >> self.bits for t in ctx):  # beyond the corpus's ids: unseen
                continue
            key = 0
            for t in ctx:
                key = (key << self.bits) | int(t)
            keys, followers = self.tables[n]
            i = int(np.searchsorted(keys, np.uint64(key)))
            if i < keys.shape[0] and int(keys[i]) == key:
                return int(followers[i])
        return None

    def draft(self, tokens: Sequence[int], max_drafts: int) -> list[int]:
        """Up to `max_drafts` tokens: each the next token of the tokens so far, drafts included;
        stops where no context is known."""
        seq = list(tokens[-self.orders[0] :])
        out: list[int] = []
        while len(out) < max_drafts:
            token = self.next_token(seq)
            if token is None:
                break
            out.append(token)
            seq = (seq + [token])[-self.orders[0] :]
        return out


def ngram_table_reference(
    streams: Iterable[Sequence[int]], n: int, min_count: int = MIN_COUNT, min_share=MIN_SHARE
) -> dict[tuple[int, ...], int]:
    """`NgramTable.tables[n]` as a dict built with counters (its test reference)."""
    followers: dict[tuple[int, ...], collections.Counter] = collections.defaultdict(
        collections.Counter
    )
    for stream in streams:
        stream = list(stream)
        for i in range(len(stream) - n):
            followers[tuple(stream[i : i + n])][stream[i + n]] += 1
    out = {}
    for ctx, counts in followers.items():
        total = sum(counts.values())
        token, count = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        if total >= min_count and count >= min_share * total:
            out[ctx] = token
    return out


def corpus_texts(source: str | Path) -> list[str]:
    """The documents of a corpus: "stdlib" is the running interpreter's standard library,
    training split only (the built-in model's held-out files stay unseen); a directory or a
    file as `kimi-linear-jax train --data` reads it, every file."""
    docs = corpus.documents(source)
    if str(source) == corpus.STDLIB:
        docs = corpus.split(docs)[0]
    return list(docs.values())


def table_from_corpus(source: str | Path, tokenizer) -> NgramTable:
    """An `NgramTable` of `source`'s documents (`corpus_texts`), tokenized by `tokenizer`; each
    document ends with the tokenizer's first stop id, which the model emits at a file's end."""
    texts = corpus_texts(source)
    if tokenizer is None:
        raise ValueError("speculative corpus needs a tokenizer (the model has none)")
    eos = list(tokenizer.eos_token_ids[:1])
    return NgramTable(ids + eos for ids in tokenizer.encode_batch(texts))
