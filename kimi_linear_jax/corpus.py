"""Training text: documents from a directory, a file, or the running interpreter's standard
library, split by file into train and held-out sets; the token stream cut into batches.

The split and the batch order are pure functions of the file names and the seed, so a
resumed run, another machine or a benchmark sees the same held-out set and the same batches.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterable
from pathlib import Path

import numpy as np

STDLIB = "stdlib"  # `--data stdlib`: the running interpreter's standard library sources
# Directories of the standard library that are not library code (test data with odd
# encodings, vendored packages that differ between installs).
_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")
HELD_OUT_PERCENT = 2


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _wanted(rel: Path) -> bool:
    return rel.suffix in TEXT_SUFFIXES and not _SKIP_DIRS.intersection(rel.parts[:-1])


def _root(data: str | Path) -> Path:
    return stdlib_dir() if str(data) == STDLIB else Path(data)


def _files(data: str | Path) -> dict[str, Path]:
    """name -> path of the files `documents` reads (names relative to the directory)."""
    root = _root(data)
    if root.is_file():
        return {root.name: root}
    if not root.is_dir():
        raise FileNotFoundError(f"training data {str(data)!r} is neither a file nor a directory")
    found = []
    for parent, dirs, names in os.walk(root):
        # Pruned, not filtered after: the standard library's skipped directories hold 98% of
        # its 59,000 entries (site-packages, test); walking them took 1-2 s.
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        rel_parent = Path(parent).relative_to(root)
        found += [rel_parent / n for n in names if _wanted(rel_parent / n)]
    # In the order of a sorted path listing (by parts), as the training data has always been.
    return {rel.as_posix(): root / rel for rel in sorted(found) if (root / rel).is_file()}


def documents(data: str | Path) -> dict[str, str]:
    """name -> text. `data`: "stdlib", a directory (its *.py/.txt/.md/.rst files, recursively,
    skipping test and site-packages directories) or one text file. Files that are not UTF-8
    are skipped; names are paths relative to the directory, so the split does not depend on
    where the directory lives."""
    out = {}
    for name, path in _files(data).items():
        try:
            out[name] = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
    if not out:
        raise ValueError(f"training data {str(data)!r} holds no {'/'.join(TEXT_SUFFIXES)} files")
    return out


def fingerprint(data: str | Path) -> str:
    """A digest of the files `documents(data)` reads, from their names, sizes and modification
    times, not their text: reading the standard library's 12 MB took 3 s with a cold page
    cache, which is what keeping a table saves. Editing, adding or removing a file changes it."""
    h = hashlib.sha256(f"{_root(data).resolve()}:{str(data) == STDLIB}:{HELD_OUT_PERCENT}".encode())
    for name, path in _files(data).items():
        st = path.stat()
        h.update(f"\0{name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()


def is_held_out(name: str, percent: int = HELD_OUT_PERCENT) -> bool:
    """A file is held out when the hash of its name falls in the first `percent` of 100."""
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < percent


def split(docs: dict[str, str], percent: int = HELD_OUT_PERCENT):
    """(train, held_out) dicts. One document alone is split by text: its last `percent` %."""
    if len(docs) == 1:
        ((name, text),) = docs.items()
        cut = len(text) - max(1, len(text) * percent // 100)
        return {name: text[:cut]}, {name + "#held-out": text[cut:]}
    held = {n: t for n, t in docs.items() if is_held_out(n, percent)}
    train = {n: t for n, t in docs.items() if n not in held}
    if not held or not train:
        raise ValueError(f"{len(docs)} files split into {len(train)} train / {len(held)} held-out")
    return train, held


def token_stream(tokenizer, texts: Iterable[str], eos_id: int) -> np.ndarray:
    """One int32 stream: each document's ids followed by `eos_id` (the document separator the
    model learns to emit at the end of a file)."""
    encoded = tokenizer.encode_batch(list(texts))
    parts = [np.asarray(e.ids + [eos_id], np.int32) for e in encoded]
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


class Batches:
    """Sequences of `seq_len + 1` tokens at stride `seq_len`, in a seeded order that is
    reshuffled every epoch. Sample `i` (counted over the whole run) is a pure function of `i`,
    so the train state's sample counter is the whole data position."""

    def __init__(self, stream: np.ndarray, seq_len: int, seed: int) -> None:
        self.stream, self.seq_len, self.seed = stream, seq_len, seed
        self.num_sequences = (len(stream) - 1) // seq_len
        if self.num_sequences < 1:
            raise ValueError(
                f"{len(stream)} training tokens are fewer than one sequence of {seq_len + 1}"
            )
        self._epoch, self._order = -1, None

    def _sequence(self, i: int) -> np.ndarray:
        epoch, pos = divmod(i, self.num_sequences)
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch, self._order = epoch, rng.permutation(self.num_sequences)
        start = int(self._order[pos]) * self.seq_len
        return self.stream[start : start + self.seq_len + 1]

    def take(self, start: int, count: int) -> np.ndarray:
        """Samples [start, start + count) as an int32 array [count, seq_len + 1]."""
        return np.stack([self._sequence(i) for i in range(start, start + count)])


def eval_sequences(stream: np.ndarray, seq_len: int, limit: int | None = None) -> np.ndarray:
    """The held-out stream in order, as [N, seq_len + 1] windows at stride seq_len (at most
    `limit`), so that every held-out token but the first is predicted exactly once."""
    n = (len(stream) - 1) // seq_len
    n = n if limit is None else min(n, limit)
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return stream[idx]
