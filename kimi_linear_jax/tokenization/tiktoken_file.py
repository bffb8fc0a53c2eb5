"""`TiktokenTokenizer`: Kimi's release format, a `tiktoken.model` file of BPE ranks with the
special tokens of `tokenizer_config.json` in a reserved block after them."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tiktoken

from kimi_linear_jax.tokenization.chat_template import KIMI_CHAT_TEMPLATE
from kimi_linear_jax.tokenization.interface import Tokenizer, _eos_ids, _runs, check_text, digest
from kimi_linear_jax.tokenization.tokenizer_config import (
    _read_chat_template,
    _read_json,
    _token_content,
)

# Kimi's pre-tokenisation regex; `&&` is class intersection, which tiktoken's regex engine has.
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# Kimi reserves this many ids after the BPE ranks for special tokens, named or not.
NUM_RESERVED_SPECIAL_TOKENS = 256


class TiktokenTokenizer(Tokenizer):
    """Kimi's release format: `tiktoken.model` ranks + specials from `tokenizer_config.json`."""

    def __init__(
        self,
        mergeable_ranks: dict[bytes, int],
        special_tokens: dict[str, int],
        *,
        chat_template: str | None = KIMI_CHAT_TEMPLATE,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        super().__init__(chat_template=chat_template, bos_token=bos_token, eos_token=eos_token)
        self._num_base = _check_ranks(mergeable_ranks, special_tokens)
        self._encoding = tiktoken.Encoding(
            "kimi",
            pat_str=KIMI_PAT_STR,
            mergeable_ranks=mergeable_ranks,
            special_tokens=special_tokens,
        )
        self._special_names = {i: name for name, i in special_tokens.items()}
        self._ranks = mergeable_ranks  # for `fingerprint` (a reference, not a copy)
        self.vocab_size = self._encoding.n_vocab
        self.bos_token_id = special_tokens.get(bos_token) if bos_token else None
        self.eos_token_ids = _eos_ids(special_tokens, eos_token)

    @classmethod
    def from_dir(cls, path: str | Path) -> TiktokenTokenizer:
        """Load `tiktoken.model`, `tokenizer_config.json` and the chat template from `path`."""
        directory = Path(path)
        ranks = read_tiktoken_ranks(directory / "tiktoken.model")
        config = _read_json(directory / "tokenizer_config.json")
        special_tokens = _kimi_special_tokens(len(ranks), config)
        # Kimi's configs name "[BOS]"; fall back to it when the field is missing.
        default_bos = "[BOS]" if "[BOS]" in special_tokens else None
        return cls(
            ranks,
            special_tokens,
            chat_template=_read_chat_template(directory, config) or KIMI_CHAT_TEMPLATE,
            bos_token=_token_content(config.get("bos_token")) or default_bos,
            eos_token=_token_content(config.get("eos_token")),
        )

    def encode(
        self, text: str, *, add_special_tokens: bool = False, parse_special: bool = True
    ) -> list[int]:
        check_text(text)
        if parse_special:
            ids = self._encoding.encode(text, allowed_special="all")
        else:  # special-token strings are ordinary text here
            ids = self._encoding.encode(text, allowed_special=set(), disallowed_special=())
        if add_special_tokens and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        chunks = []
        for is_text, group in _runs(self._decodable(ids, skip_special_tokens)):
            chunks.append(
                "".join(group).encode() if is_text else self._encoding.decode_bytes(group)
            )
        return b"".join(chunks).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        if self._is_known(token_id) and not self._is_special(token_id):
            return self._encoding.decode_single_token_bytes(token_id)
        return super().token_bytes(token_id)

    def fingerprint(self) -> str:
        ranks = b"".join(
            rank.to_bytes(4, "little") + len(token).to_bytes(4, "little") + token
            for token, rank in sorted(self._ranks.items(), key=lambda kv: kv[1])
        )
        specials = ",".join(f"{i}:{name}" for i, name in sorted(self._special_names.items()))
        return digest("tiktoken", KIMI_PAT_STR, ranks, specials)

    def _is_known(self, token_id: int) -> bool:
        return 0 <= token_id < self._num_base or token_id in self._special_names

    def _is_special(self, token_id: int) -> bool:
        return token_id >= self._num_base


def read_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Parse a `tiktoken.model` file: one `<base64 token> <rank>` per line."""
    ranks: dict[bytes, int] = {}
    for line_no, line in enumerate(Path(path).read_text(encoding="ascii").splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as err:
            raise ValueError(f"{path}:{line_no}: expected '<base64 token> <rank>'") from err
    return ranks


def _check_ranks(ranks: dict[bytes, int], special_tokens: dict[str, int]) -> int:
    # Ids below len(ranks) must all be BPE tokens, else decode could meet ids nobody owns and
    # special ids could collide with ranks.
    num_base = len(ranks)
    if sorted(ranks.values()) != list(range(num_base)):
        raise ValueError(f"tiktoken ranks must be exactly 0..{num_base - 1}, each used once")
    clashing = {name: i for name, i in special_tokens.items() if i < num_base}
    if clashing:
        raise ValueError(f"special token ids overlap the {num_base} BPE ranks: {clashing}")
    return num_base


def _kimi_special_tokens(num_base: int, config: dict[str, Any]) -> dict[str, int]:
    # Every id in the reserved block gets a name, so the model can never emit an undecodable id.
    named = {
        int(i): entry["content"] for i, entry in config.get("added_tokens_decoder", {}).items()
    }
    reserved = range(num_base, num_base + NUM_RESERVED_SPECIAL_TOKENS)
    names = {i: f"<|reserved_token_{i}|>" for i in reserved} | named
    return {name: i for i, name in names.items()}
