"""`ByteTokenizer`: UTF-8 bytes as ids, for models without a tokenizer (random and test models)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from kimi_linear_jax.tokenization.chat_template import KIMI_CHAT_TEMPLATE
from kimi_linear_jax.tokenization.interface import Tokenizer, _eos_ids, check_text, digest

# Byte-tokenizer specials, in id order starting at 256.
BYTE_SPECIAL_TOKENS = (
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
)


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes are ids 0..255, `BYTE_SPECIAL_TOKENS` follow; higher ids are unused."""

    def __init__(self, vocab_size: int) -> None:
        minimum = 256 + len(BYTE_SPECIAL_TOKENS)
        if vocab_size < minimum:
            raise ValueError(
                f"ByteTokenizer needs vocab_size >= {minimum} (256 bytes + "
                f"{len(BYTE_SPECIAL_TOKENS)} special tokens), got vocab_size={vocab_size}"
            )
        super().__init__(chat_template=KIMI_CHAT_TEMPLATE, bos_token="[BOS]", eos_token="[EOS]")
        self.vocab_size = vocab_size
        self._special_ids = {name: 256 + i for i, name in enumerate(BYTE_SPECIAL_TOKENS)}
        self._special_names = {i: name for name, i in self._special_ids.items()}
        self._special_re = _special_token_regex(self._special_ids)
        self.bos_token_id = self._special_ids["[BOS]"]
        self.eos_token_ids = _eos_ids(self._special_ids)

    def encode(
        self, text: str, *, add_special_tokens: bool = False, parse_special: bool = True
    ) -> list[int]:
        check_text(text)
        ids = [self.bos_token_id] if add_special_tokens else []
        if not parse_special:
            return ids + list(text.encode("utf-8"))
        # re.split with one capture group alternates plain text (even) and specials (odd).
        for index, piece in enumerate(self._special_re.split(text)):
            if index % 2:
                ids.append(self._special_ids[piece])
            else:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        chunks = [self._item_bytes(item) for item in self._decodable(ids, skip_special_tokens)]
        return b"".join(chunks).decode("utf-8", errors="replace")

    def _item_bytes(self, item: int | str) -> bytes:
        if isinstance(item, str):
            return item.encode("utf-8")
        if item < 256:
            return bytes((item,))
        return self._special_names[item].encode("utf-8")

    def token_bytes(self, token_id: int) -> bytes:
        return self._item_bytes(token_id) if self._is_known(token_id) else b""

    def fingerprint(self) -> str:
        # UTF-8 bytes and the fixed specials: nothing but the id space differs.
        return digest("bytes", str(self.vocab_size), ",".join(BYTE_SPECIAL_TOKENS))

    def _is_known(self, token_id: int) -> bool:
        return 0 <= token_id < 256 or token_id in self._special_names

    def _is_special(self, token_id: int) -> bool:
        return not 0 <= token_id < 256


def _special_token_regex(special_ids: dict[str, int]) -> re.Pattern[str]:
    # Longest first, so a special that is a prefix of another cannot win.
    names = sorted(special_ids, key=len, reverse=True)
    return re.compile("(" + "|".join(map(re.escape, names)) + ")")
