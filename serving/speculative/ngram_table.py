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

Building the standard library's table takes 8-12 s on a 2-core CPU, most of it tokenizing,
at every engine start. `table_from_corpus` keeps each table it builds in the user's cache
directory (`cache_dir`), under a key of the corpus's files (names, sizes, times), the
tokenizer's fingerprint and the table's settings, and loads it from there when nothing of
these changed.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from kimi_linear_jax import corpus
from kimi_linear_jax.tokenization.interface import digest

log = logging.getLogger("kimi_linear_jax.engine")

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

    def save(self, path: str | Path) -> None:
        """Write the table to `path` (an .npz), atomically: a reader sees the old file or the
        whole new one."""
        path = Path(path)
        arrays = {"bits": np.int64(self.bits), "orders": np.asarray(self.orders, np.int64)}
        for n, (keys, followers) in self.tables.items():
            arrays[f"keys_{n}"], arrays[f"followers_{n}"] = keys, followers
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | Path) -> NgramTable:
        """A table `save` wrote; ValueError if the file does not hold one."""
        try:
            with np.load(path, allow_pickle=False) as f:
                bits, orders = int(f["bits"]), tuple(int(n) for n in f["orders"])
                tables = {n: (f[f"keys_{n}"], f[f"followers_{n}"]) for n in orders}
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as e:
            raise ValueError(f"{str(path)!r} is not a saved n-gram table: {e}") from e
        for n, (keys, followers) in tables.items():
            ok = keys.dtype == np.uint64 and followers.dtype == np.int32
            if not (ok and keys.shape == followers.shape and np.all(keys[1:] > keys[:-1])):
                raise ValueError(f"{str(path)!r} is not a saved n-gram table: bad order {n}")
        table = cls.__new__(cls)
        table.bits, table.orders, table.tables = bits, orders, tables
        return table


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


CACHE_ENV = "KIMI_LINEAR_JAX_CACHE"


def cache_dir() -> Path | None:
    """Where built corpus tables are kept: `$KIMI_LINEAR_JAX_CACHE` ("off" or empty: nowhere),
    else `$XDG_CACHE_HOME/kimi-linear-jax`, else `~/.cache/kimi-linear-jax`."""
    env = os.environ.get(CACHE_ENV)
    if env is not None:
        return None if env in ("", "off") else Path(env)
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = Path.home() / ".cache"
        except RuntimeError:  # no home directory (a bare service account): keep nothing
            return None
    return Path(base) / "kimi-linear-jax"


def cache_key(source: str | Path, tokenizer) -> str:
    """What a corpus table depends on: the corpus's files, the tokenizer, the stop id that
    ends each document, and the table's settings."""
    settings = json.dumps([ORDERS, MIN_COUNT, MIN_SHARE, list(tokenizer.eos_token_ids[:1])])
    return digest(corpus.fingerprint(source), tokenizer.fingerprint(), settings)


def table_from_corpus(source: str | Path, tokenizer, cache: bool = True) -> NgramTable:
    """An `NgramTable` of `source`'s documents (`corpus_texts`), tokenized by `tokenizer`; each
    document ends with the tokenizer's first stop id, which the model emits at a file's end.
    With `cache`, loaded from `cache_dir()` if built before, else built and kept there (a
    cache that cannot be read or written is rebuilt or skipped, with a warning)."""
    if tokenizer is None:
        corpus_texts(source)  # a missing corpus is the first error to report
        raise ValueError("speculative corpus needs a tokenizer (the model has none)")
    where = cache_dir() if cache else None
    path = None if where is None else where / "ngram" / f"{cache_key(source, tokenizer)}.npz"
    if path is not None and path.is_file():
        try:
            table = NgramTable.load(path)
            log.info("corpus n-gram table of %s: loaded from %s", source, path)
            return table
        except ValueError as e:
            log.warning("rebuilding the corpus n-gram table: %s", e)
    eos = list(tokenizer.eos_token_ids[:1])
    table = NgramTable(ids + eos for ids in tokenizer.encode_batch(corpus_texts(source)))
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            table.save(path)
            log.info("corpus n-gram table of %s: built, kept in %s", source, path)
        except OSError as e:
            log.warning("could not keep the corpus n-gram table in %s: %s", where, e)
    return table
