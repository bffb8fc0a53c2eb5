"""The corpus n-gram table (`serving/speculative/ngram_table.py`) against counting loops, and
the n-gram drafter with a corpus in the engine: greedy output unchanged, table drafts in
windows of their own width."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest

from kimi_linear_jax import corpus
from kimi_linear_jax.bpe import save_tokenizer, train_bpe
from kimi_linear_jax.checkpoint import BUILTIN_MODEL
from kimi_linear_jax.presets import preset
from kimi_linear_jax.testing import random_model
from kimi_linear_jax.tokenizer import load_tokenizer
from serving.core.sampling import SamplingParams
from serving.engine import LLM
from serving.speculative.ngram import NgramDrafter
from serving.speculative.ngram_table import (
    NgramTable,
    cache_dir,
    cache_key,
    corpus_texts,
    ngram_table_reference,
    table_from_corpus,
)


def _as_dict(table: NgramTable, n: int) -> dict[tuple[int, ...], int]:
    keys, followers = table.tables[n]
    mask = (1 << table.bits) - 1
    out = {}
    for key, token in zip(keys.tolist(), followers.tolist(), strict=True):
        out[tuple((key >> (table.bits * (n - 1 - j))) & mask for j in range(n))] = token
    return out


def _chain_reference(refs: dict[int, dict], tokens: list[int], k: int) -> list[int]:
    """Each draft: the follower of the longest known context of the tokens so far."""
    seq, out = list(tokens), []
    while len(out) < k:
        for n in sorted(refs, reverse=True):
            if len(seq) >= n and tuple(seq[-n:]) in refs[n]:
                out.append(refs[n][tuple(seq[-n:])])
                seq.append(out[-1])
                break
        else:
            break
    return out


def test_table_equals_its_reference():
    rng = np.random.default_rng(0)
    for trial in range(40):
        vocab = 2 + trial % 6
        streams = [
            rng.integers(0, vocab, size=int(rng.integers(0, 60))).tolist()
            for _ in range(int(rng.integers(1, 4)))
        ]
        streams[0] = streams[0] or [0]
        min_count, min_share = int(rng.integers(1, 4)), float(rng.choice([0.0, 0.3, 0.5, 0.9]))
        table = NgramTable(streams, (1, 2, 3), min_count, min_share)
        refs = {n: ngram_table_reference(streams, n, min_count, min_share) for n in (1, 2, 3)}
        for n in (1, 2, 3):
            assert _as_dict(table, n) == refs[n], (trial, n)
        for _ in range(5):
            tokens = rng.integers(0, vocab + 1, size=int(rng.integers(0, 6))).tolist()
            assert table.draft(tokens, 6) == _chain_reference(refs, tokens, 6), (trial, tokens)


def test_table_drafts_by_majority_and_backs_off():
    # (1, 2) went on with 3 twice and 4 once; (2, 3) with 5 twice; 9 was never followed.
    streams = [[1, 2, 3, 5], [1, 2, 3, 5, 1, 2, 4, 9]]
    table = NgramTable(streams, (2, 1), min_count=1, min_share=0.0)
    assert table.draft([7, 1, 2], 8) == [3, 5, 1, 2, 3, 5, 1, 2]
    # Context (8, 2) is unseen: 2 alone is (followed by 3 twice, 4 once).
    assert table.draft([8, 2], 2) == [3, 5]
    assert table.draft([4, 9], 3) == []
    # Ids beyond the corpus's (and so beyond its packing) match nothing.
    assert table.next_token([1, 1 << 20]) is None
    # Windows never cross documents: (5, 1) only occurs inside the second stream.
    assert _as_dict(table, 2)[(5, 1)] == 2
    assert (3, 1) not in _as_dict(NgramTable([[1, 3], [1, 3]], (2,), 1, 0.0), 2)


def test_table_thresholds():
    streams = [[1, 2, 1, 2, 1, 3, 1, 4]]  # 1 -> 2, 2, 3, 4: the 2s hold half
    assert NgramTable(streams, (1,), min_count=2, min_share=0.5).next_token([1]) == 2
    assert NgramTable(streams, (1,), min_count=2, min_share=0.6).next_token([1]) is None
    # 3 was followed once: kept from min_count 1 only.
    assert NgramTable(streams, (1,), min_count=1, min_share=0.0).next_token([3]) == 1
    assert NgramTable(streams, (1,), min_count=2, min_share=0.0).next_token([3]) is None


@pytest.mark.parametrize(
    ("streams", "orders", "match"),
    [
        ([[]], (2,), "at least one non-empty token stream"),
        ([[1, -2]], (2,), "must be >= 0"),
        ([[1 << 20]], (4,), r"pack into 64 bits \(21 bits per token: at most 3 tokens\)"),
        ([[1, 2]], (0,), "must be >= 1"),
    ],
)
def test_bad_table(streams, orders, match):
    with pytest.raises(ValueError, match=match):
        NgramTable(streams, orders)


def test_table_from_a_corpus_directory(tmp_path):
    tokenizer = load_tokenizer(BUILTIN_MODEL, 4096)
    texts = {"a.py": "def f(self):\n    return self.x\n", "b/c.py": "import os\nimport sys\n"}
    _write(tmp_path, texts)
    (tmp_path / "skip.bin").write_bytes(b"\x00")
    table = table_from_corpus(tmp_path, tokenizer)
    eos = tokenizer.eos_token_ids[0]
    streams = [tokenizer.encode(t, parse_special=False) + [eos] for t in texts.values()]
    assert tokenizer.encode_batch(list(texts.values())) == [s[:-1] for s in streams]
    for n in table.orders:
        assert _as_dict(table, n) == ngram_table_reference(streams, n)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        table_from_corpus(tmp_path, None)


def _write(root, texts: dict[str, str]):
    for name, text in texts.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def _assert_table_of(table: NgramTable, tokenizer, texts: list[str]) -> None:
    """`table` is the one the counting reference gives for `texts` tokenized by `tokenizer`."""
    eos = tokenizer.eos_token_ids[0]
    streams = [tokenizer.encode(t, parse_special=False) + [eos] for t in texts]
    want = {n: ngram_table_reference(streams, n) for n in table.orders}
    assert {n: _as_dict(table, n) for n in table.orders} == want


class _Counting:
    """A tokenizer that counts its `encode_batch` calls (each is a table build)."""

    def __init__(self, tokenizer):
        self.inner, self.builds = tokenizer, 0
        self.eos_token_ids, self.fingerprint = tokenizer.eos_token_ids, tokenizer.fingerprint

    def encode_batch(self, texts):
        self.builds += 1
        return self.inner.encode_batch(texts)


def test_corpus_tables_are_kept_and_found_again(tmp_path, monkeypatch, caplog):
    """A table is built once per corpus and tokenizer, then loaded from the cache directory;
    an edited corpus, another tokenizer, or a damaged file builds it again, and the table is
    always the one its corpus gives."""
    cache, data = tmp_path / "cache", tmp_path / "data"
    monkeypatch.setenv("KIMI_LINEAR_JAX_CACHE", str(cache))
    texts = {"a.py": "def f(self):\n    return self.x\n" * 3, "b/c.py": "import os\n" * 4}
    _write(data, texts)
    tokenizer = _Counting(load_tokenizer(BUILTIN_MODEL, 4096))

    def check(table, texts):
        _assert_table_of(table, tokenizer.inner, list(texts.values()))

    check(table_from_corpus(data, tokenizer), texts)
    check(table_from_corpus(data, tokenizer), texts)
    assert tokenizer.builds == 1 and len(list((cache / "ngram").iterdir())) == 1

    texts["b/c.py"] = "import sys\n" * 5  # edited: the key changes, the table follows
    _write(data, texts)
    check(table_from_corpus(data, tokenizer), texts)
    assert tokenizer.builds == 2

    saved = cache / "ngram" / f"{cache_key(data, tokenizer)}.npz"
    saved.write_bytes(saved.read_bytes()[:100])  # a damaged file: rebuilt and replaced
    with caplog.at_level("WARNING", logger="kimi_linear_jax.engine"):
        check(table_from_corpus(data, tokenizer), texts)
    assert tokenizer.builds == 3 and "rebuilding the corpus n-gram table" in caplog.text
    check(NgramTable.load(saved), texts)

    # Another tokenizer with the same stop id but other merges: its own table.
    save_tokenizer(train_bpe([t * 4 for t in texts.values()], 300), tmp_path / "tok")
    other = _Counting(load_tokenizer(tmp_path / "tok", 300))
    assert other.eos_token_ids == load_tokenizer(BUILTIN_MODEL, 4096).eos_token_ids
    _assert_table_of(table_from_corpus(data, other), other.inner, list(texts.values()))
    assert other.builds == 1

    monkeypatch.setenv("KIMI_LINEAR_JAX_CACHE", "off")
    before = sorted((cache / "ngram").iterdir())
    check(table_from_corpus(data, tokenizer), texts)
    assert tokenizer.builds == 4 and sorted((cache / "ngram").iterdir()) == before


def test_a_cache_that_cannot_be_written_still_gives_the_table(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache directory would be")
    monkeypatch.setenv("KIMI_LINEAR_JAX_CACHE", str(blocker))
    _write(tmp_path / "data", {"a.py": "x = 1\n" * 5})
    tokenizer = load_tokenizer(BUILTIN_MODEL, 4096)
    with caplog.at_level("WARNING", logger="kimi_linear_jax.engine"):
        table = table_from_corpus(tmp_path / "data", tokenizer)
    assert "could not keep the corpus n-gram table" in caplog.text
    _assert_table_of(table, tokenizer, ["x = 1\n" * 5])


def test_load_refuses_what_is_not_a_table(tmp_path):
    path = tmp_path / "t.npz"
    path.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a saved n-gram table"):
        NgramTable.load(path)
    np.savez(path, bits=np.int64(3))  # an .npz without the table's arrays
    with pytest.raises(ValueError, match="not a saved n-gram table"):
        NgramTable.load(path)
    NgramTable([[1, 2, 3, 1, 2, 3]], (2,), 1, 0.0).save(path)
    with np.load(path) as f:
        arrays = dict(f)
    arrays["keys_2"] = arrays["keys_2"][::-1].copy()  # unsorted keys: binary search would lie
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match="bad order 2"):
        NgramTable.load(path)


def test_corpus_fingerprint_follows_its_files(tmp_path):
    _write(tmp_path, {"a.py": "x = 1\n", "t/skip.bin": "?"})
    first = corpus.fingerprint(tmp_path)
    (tmp_path / "t" / "skip.bin").write_text("not read")  # not a corpus file: no change
    assert corpus.fingerprint(tmp_path) == first
    _write(tmp_path, {"b.py": "y = 2\n"})
    second = corpus.fingerprint(tmp_path)
    (tmp_path / "a.py").write_text("x = 10\n")
    assert len({first, second, corpus.fingerprint(tmp_path)}) == 3


def test_stdlib_corpus_is_the_training_split():
    train, held = corpus.split(corpus.documents(corpus.STDLIB))
    texts = corpus_texts(corpus.STDLIB)
    assert texts == list(train.values())
    assert held and not set(held.values()) & set(texts)


def test_table_acceptance_record():
    table = NgramTable([[1, 2, 3, 4, 5, 6]], (1,), 1, 0.0)  # t -> t + 1 for 1..5
    drafter = NgramDrafter(3, 2, table, 2, min_acceptance=0.5)
    request = types.SimpleNamespace(request_id=0, all_token_ids=[9, 1], drafter_state=None)

    def propose(*new_tokens):
        request.all_token_ids += list(new_tokens)
        return drafter.propose_tokens(request, 4)

    assert propose() == [2, 3]
    record = request.drafter_state
    assert propose(2, 7) == []  # 2 accepted, 3 not: half; 7 is not in the table
    assert record.acceptance == pytest.approx(0.85)
    assert propose(8) == [] and record.acceptance == pytest.approx(0.85)  # scored once only
    assert propose(1) == [2, 3]
    assert propose(5) == [6]  # both missed: 0.595, still drafting
    assert record.acceptance == pytest.approx(0.595)
    assert propose(1) == []  # 6 missed: 0.4165, below 0.5: the table rests ...
    assert record.acceptance == pytest.approx(0.4165)
    # (New pairs of tokens, so that the prompt lookup finds nothing; the table knows 3.)
    assert [propose(100 + i, 3) for i in range(14)] == [[]] * 14
    assert propose(200, 3) == [4, 5]  # ... and probes at the 16th proposal


# ---- in the engine ------------------------------------------------------------------------------

SHAPES = dict(num_pages=40, page_size=4, max_num_seqs=2, batch_buckets=(2,), chunk_size=16)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# No suffix of these recurs in them, so prompt lookup has nothing: every draft is the table's.
PROMPTS = [[3, 17, 29, 41, 53], [60, 71, 82, 93, 104, 115]]


def test_ngram_with_a_corpus_greedy_equals_plain():
    model = random_model(preset("tiny"))
    plain = [o.token_ids for o in LLM(model, **SHAPES).generate(PROMPTS, GREEDY, use_tqdm=False)]
    # A corpus that holds the first continuation (drafts accepted) and a wrong one for the
    # second (drafts rejected).
    wrong = [(t + 1) % model.config.vocab_size for t in plain[1]]
    table = NgramTable([PROMPTS[0] + plain[0], PROMPTS[1] + wrong], (2,), 1, 0.0)
    spec = {"method": "ngram", "num_draft_tokens": 4, "corpus": table, "corpus_num_tokens": 2}
    llm = LLM(model, speculative={**spec, "min_acceptance": 0.0}, **SHAPES)
    widths, propose = [], llm.runner.drafter.propose

    def recording_propose(*a, **kw):
        drafts, num = propose(*a, **kw)
        widths.append(drafts.shape[1])
        return drafts, num

    llm.runner.drafter.propose = recording_propose
    out = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert out == plain
    metrics = llm.metrics()
    assert metrics["spec_corpus_draft_tokens"] == metrics["spec_draft_tokens"] > 0
    assert metrics["spec_accepted_tokens"] > 0
    assert set(widths) == {2}  # table drafts only: windows of 3, not 5


def test_failing_table_drafts_stop_alone():
    """A table with a draft for every token, nearly always wrong (t -> t + 1): with the default
    `min_acceptance` its own acceptance stops it after 4 windows (of the 15 steps it could
    draft at), while the prompt lookup drafts exactly as it does with no table: the table's
    misses do not make the request rest."""
    model = random_model(preset("tiny"))
    # Lookup of the last token alone, and a prompt of many ids: where an output id is in it,
    # the prompt lookup drafts.
    prompts = [PROMPTS[0], list(range(100, 160))]
    plain = [o.token_ids for o in LLM(model, **SHAPES).generate(prompts, GREEDY, use_tqdm=False)]
    vocab = model.config.vocab_size
    wrong = NgramTable([list(range(vocab)) + [0]], (1,), 1, 0.0)
    spec = {"method": "ngram", "num_draft_tokens": 4, "corpus_num_tokens": 2}
    spec |= {"prompt_lookup_min": 1, "prompt_lookup_max": 1}
    metrics = {}
    for name, extra in {"gated": {"corpus": wrong}, "no table": {}}.items():
        llm = LLM(model, speculative={**spec, **extra}, **SHAPES)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == plain
        metrics[name] = llm.metrics()
    gated = metrics["gated"]
    assert 0 < gated["spec_corpus_draft_tokens"] <= 2 * 2 * 4  # 4 windows per request at most
    lookup = gated["spec_draft_tokens"] - gated["spec_corpus_draft_tokens"]
    assert lookup == metrics["no table"]["spec_draft_tokens"] > 0


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"method": "draft_model", "corpus": "stdlib"}, "corpus is for method 'ngram'"),
        (
            {"method": "ngram", "corpus": "stdlib", "corpus_num_tokens": 0},
            r"corpus_num_tokens must be in \[1, 16\], got 0",
        ),
        ({"method": "ngram", "corpus": "stdlib"}, "needs a tokenizer"),
        ({"method": "ngram", "corpus": ""}, "must name a corpus, got ''"),
        ({"method": "ngram", "corpus": "/no/such/dir"}, "neither a file nor a directory"),
    ],
)
def test_bad_corpus_config(spec, match):
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        LLM(random_model(preset("tiny")), speculative=spec, **SHAPES)


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KIMI_LINEAR_JAX_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    for off in ("off", ""):
        monkeypatch.setenv("KIMI_LINEAR_JAX_CACHE", off)
        assert cache_dir() is None
    monkeypatch.delenv("KIMI_LINEAR_JAX_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "kimi-linear-jax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "kimi-linear-jax"
    monkeypatch.delenv("HOME")

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    assert cache_dir() is None  # nowhere to keep tables: build them, keep nothing
