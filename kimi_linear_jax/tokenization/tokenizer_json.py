"""`HFTokenizer`: a `tokenizer.json` run by the HF `tokenizers` library."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import tokenizers

from kimi_linear_jax.tokenization.interface import Tokenizer, _eos_ids, _runs, check_text, digest
from kimi_linear_jax.tokenization.tokenizer_config import (
    _read_chat_template,
    _read_json,
    _token_content,
)


class HFTokenizer(Tokenizer):
    """A `tokenizer.json` run by the `tokenizers` library."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        super().__init__(chat_template=chat_template, bos_token=bos_token, eos_token=eos_token)
        self._tokenizer = tokenizer
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self._known_ids = frozenset(vocab.values())
        self.vocab_size = max(self._known_ids, default=-1) + 1
        self.bos_token_id = vocab.get(bos_token) if bos_token else None
        self.eos_token_ids = _eos_ids(vocab, eos_token)
        decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
        self._byte_level = decoder.get("type") == "ByteLevel"

    @classmethod
    def from_dir(cls, path: str | Path) -> HFTokenizer:
        """Load `tokenizer.json`, plus `tokenizer_config.json` and a chat template if present."""
        directory = Path(path)
        config = _read_json(directory / "tokenizer_config.json")
        return cls(
            tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json")),
            chat_template=_read_chat_template(directory, config),
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
        )

    def encode(
        self, text: str, *, add_special_tokens: bool = False, parse_special: bool = True
    ) -> list[int]:
        # The library's own post-processor decides what "special tokens" to add (e.g. BOS).
        # `encode_special_tokens` makes it encode special-token strings as plain text.
        check_text(text)
        self._tokenizer.encode_special_tokens = not parse_special
        try:
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        finally:
            self._tokenizer.encode_special_tokens = False

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # The library encodes a batch on every core (a corpus of millions of tokens: seconds).
        for text in texts:
            check_text(text)
        self._tokenizer.encode_special_tokens = True
        try:
            encoded = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        finally:
            self._tokenizer.encode_special_tokens = False
        return [e.ids for e in encoded]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        chunks = []
        for is_text, group in _runs(self._decodable(ids, skip_special_tokens)):
            if is_text:
                chunks.append("".join(group))
            else:
                chunks.append(
                    self._tokenizer.decode(group, skip_special_tokens=skip_special_tokens)
                )
        return "".join(chunks)

    def token_bytes(self, token_id: int) -> bytes:
        """Byte-level vocabularies (GPT-2's byte-to-character map) and byte-fallback pieces
        (`<0xNN>`) give their raw bytes; other tokens their text's."""
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None or self._is_special(token_id):
            return super().token_bytes(token_id)
        if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
            return bytes((int(piece[3:5], 16),))
        if self._byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        return super().token_bytes(token_id)

    def fingerprint(self) -> str:
        return digest("tokenizer.json", self._tokenizer.to_str())

    def _is_known(self, token_id: int) -> bool:
        return token_id in self._known_ids

    def _is_special(self, token_id: int) -> bool:
        # Known special tokens are skipped by the library; only unknown ids are ours to drop.
        return token_id not in self._known_ids


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the other
    bytes for the characters from U+0100 on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in kept:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in _byte_to_unicode().items()}
