"""A byte-level BPE tokenizer trained on the training split (the `tokenizers` library), saved
as `tokenizer.json` + `tokenizer_config.json` so `load_tokenizer` runs it like any HF one."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

# Ids 0, 1, 2 in this order; the model config's pad / bos / eos ids follow them.
PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|endoftext|>"
SPECIAL_TOKENS = (PAD, BOS, EOS)
# A plain-text chat template: the built-in model is a code model, so a chat turn is rendered
# as a comment header it can continue.
# Each message ends in a newline, kept: a `{%-` right after it would strip it (it did, and
# the next turn's "# user:" followed the content on the same line).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "# {{ message['role'] }}:\n{{ message['content'] }}\n"
    "{% endfor -%}"
    "{%- if add_generation_prompt -%}# assistant:\n{% endif -%}"
)


def train_bpe(texts: Iterable[str], vocab_size: int) -> tokenizers.Tokenizer:
    """Byte-level BPE with `vocab_size` ids (the 3 specials first, then the 256 bytes)."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} leaves no room for the 256 byte tokens")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def save_tokenizer(tok: tokenizers.Tokenizer, path: str | Path) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def special_ids(tok: tokenizers.Tokenizer) -> dict[str, int]:
    """pad / bos / eos ids of a tokenizer trained here."""
    ids = {
        name: tok.token_to_id(token) for name, token in zip(("pad", "bos", "eos"), SPECIAL_TOKENS)
    }
    missing = [name for name, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"tokenizer has no {missing} token ({SPECIAL_TOKENS})")
    return ids


def token_bytes(tok: tokenizers.Tokenizer) -> np.ndarray:
    """Bytes each id stands for ([vocab] int); 0 for special tokens. A byte-level token's
    string has one character per byte, so its length is its byte count (bits per byte need
    this; decoding single ids would mangle tokens that split a UTF-8 character)."""
    vocab = tok.get_vocab(with_added_tokens=True)
    out = np.zeros(max(vocab.values()) + 1, np.int64)
    for token, i in vocab.items():
        out[i] = 0 if token in SPECIAL_TOKENS else len(token)
    return out
