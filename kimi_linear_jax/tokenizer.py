"""Tokenizers: a byte-level one for random models, Kimi's tiktoken release format, and HF JSON.

All three share one small interface (`Tokenizer`) so the CLI and server never care which one
backs a model. `load_tokenizer` picks one from a checkpoint directory and checks that every id
it can emit fits the model's embedding table.

The kinds live in `kimi_linear_jax/tokenization/`, one a module; import them from here.
"""

from __future__ import annotations

from pathlib import Path

from kimi_linear_jax.tokenization.byte_level import BYTE_SPECIAL_TOKENS, ByteTokenizer
from kimi_linear_jax.tokenization.chat_template import (
    CHAT_ROLES,
    KIMI_CHAT_TEMPLATE,
    validate_messages,
)
from kimi_linear_jax.tokenization.interface import Tokenizer
from kimi_linear_jax.tokenization.tiktoken_file import (
    KIMI_PAT_STR,
    NUM_RESERVED_SPECIAL_TOKENS,
    TiktokenTokenizer,
    read_tiktoken_ranks,
)
from kimi_linear_jax.tokenization.tokenizer_json import HFTokenizer

__all__ = [
    "BYTE_SPECIAL_TOKENS",
    "CHAT_ROLES",
    "KIMI_CHAT_TEMPLATE",
    "KIMI_PAT_STR",
    "NUM_RESERVED_SPECIAL_TOKENS",
    "ByteTokenizer",
    "HFTokenizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "load_tokenizer",
    "read_tiktoken_ranks",
    "validate_messages",
]


def load_tokenizer(path: str | Path | None, vocab_size: int) -> Tokenizer | None:
    """Tokenizer for a model with `vocab_size` embeddings, or None if `path` has none.

    None -> `ByteTokenizer`; a directory with `tiktoken.model` -> `TiktokenTokenizer`; with
    `tokenizer.json` -> `HFTokenizer`; with neither -> None (prompts must then be token ids).
    """
    if path is None:
        return ByteTokenizer(vocab_size)
    directory = Path(path)
    if not directory.is_dir():
        raise NotADirectoryError(f"tokenizer path {str(directory)!r} is not a directory")
    if (directory / "tiktoken.model").is_file():
        tokenizer: Tokenizer = TiktokenTokenizer.from_dir(directory)
    elif (directory / "tokenizer.json").is_file():
        tokenizer = HFTokenizer.from_dir(directory)
    else:
        return None
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"tokenizer in {str(directory)!r} has vocab_size {tokenizer.vocab_size} but the "
            f"model's vocab_size is {vocab_size}: its ids would index past the embedding table"
        )
    return tokenizer
