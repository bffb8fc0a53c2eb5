"""Tokenizers: a byte-level one for random models, Kimi's tiktoken release format, and HF JSON.

All three share one small interface (`Tokenizer`) so the CLI and server never care which one
backs a model. `load_tokenizer` picks one from a checkpoint directory and checks that every id
it can emit fits the model's embedding table.
"""

from __future__ import annotations

import abc
import base64
import functools
import json
import re
import secrets
from collections.abc import Iterable, Sequence
from itertools import groupby
from pathlib import Path
from typing import Any

import jinja2
import tiktoken
import tokenizers
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

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

# One turn is `<|im_ROLE|>ROLE<|im_middle|>CONTENT<|im_end|>`; tool results ride on the system
# role token, as in Kimi's own template. Pieces are concatenated so no stray newline leaks in.
KIMI_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}<|im_user|>"
    "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>"
    "{%- else -%}<|im_system|>"
    "{%- endif -%}"
    "{{ message['role'] }}<|im_middle|>{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

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

# Names that end a turn or a document; whichever of them a vocabulary has become stop ids.
_EOS_NAMES = ("[EOS]", "<|im_end|>")
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


class Tokenizer(abc.ABC):
    """Text <-> ids, plus chat-template rendering.

    `vocab_size` is the size of the id space: every id the tokenizer can emit is below it, and
    `decode` accepts any int (unknown ids are skipped, or shown as `<|ID|>`).
    """

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    def __init__(
        self, *, chat_template: str | None, bos_token: str | None, eos_token: str | None
    ) -> None:
        self._template = None if chat_template is None else _compile_template(chat_template)
        self._bos_token = bos_token
        self._eos_token = eos_token

    @abc.abstractmethod
    def encode(
        self, text: str, *, add_special_tokens: bool = False, parse_special: bool = True
    ) -> list[int]:
        """Ids for `text`. Special-token strings in it become their ids, unless
        `parse_special=False`: then they are encoded as the plain text they are."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text for `ids`; invalid UTF-8 becomes U+FFFD."""

    def apply_chat_template(
        self, messages: list[dict], *, add_generation_prompt: bool = True
    ) -> str:
        """Render `messages` (dicts with `role` and str `content`) into a prompt string."""
        validate_messages(messages)
        if self._template is None:
            raise ValueError(f"{type(self).__name__} has no chat template")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._bos_token or "",
            eos_token=self._eos_token or "",
        )

    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
        """Ids of the rendered conversation in which only the template's own markup yields
        special ids: message content is encoded as plain text, so a user cannot forge a turn
        boundary by writing `<|im_end|>` (vLLM and HF do the same for chat).

        The template is rendered with a unique marker in place of each content, and the pieces
        between markers are encoded with special tokens parsed, the contents without. A
        template that rewrites content (trims it, say) defeats the markers: then the rendered
        text is encoded whole, which is safe only if no content holds special-token text, and
        a ValueError names the message otherwise.
        """
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        marks = [f"\ue000{secrets.token_hex(8)}\ue001" for _ in messages]
        contents = {m: msg["content"] for m, msg in zip(marks, messages, strict=True)}
        masked = [{**msg, "content": m} for m, msg in zip(marks, messages, strict=True)]
        rendered = self.apply_chat_template(masked, add_generation_prompt=add_generation_prompt)
        pieces = re.split("(" + "|".join(map(re.escape, marks)) + ")", rendered)
        if "".join(contents.get(p, p) for p in pieces) == text:
            ids: list[int] = []
            for p in pieces:
                content = contents.get(p)
                ids += (
                    self.encode(p) if content is None else self.encode(content, parse_special=False)
                )
            return ids
        for index, msg in enumerate(messages):
            if self.encode(msg["content"], parse_special=False) != self.encode(msg["content"]):
                raise ValueError(
                    f"messages[{index}]['content'] holds special-token text, and this chat "
                    "template rewrites content, so it cannot be kept plain text"
                )
        return self.encode(text)

    # Subclasses say which ids they can decode and which are special, and `_decodable` turns
    # any id sequence into backend ids plus placeholder strings, so no backend sees a bad id.
    @abc.abstractmethod
    def _is_known(self, token_id: int) -> bool: ...

    @abc.abstractmethod
    def _is_special(self, token_id: int) -> bool: ...

    def _decodable(self, ids: Iterable[int], skip_special_tokens: bool) -> list[int | str]:
        items: list[int | str] = []
        for token_id in map(int, ids):
            if skip_special_tokens and self._is_special(token_id):
                continue
            if self._is_known(token_id):
                items.append(token_id)
            elif not skip_special_tokens:
                items.append(f"<|{token_id}|>")
        return items


def validate_messages(messages: Any) -> None:
    """Raise ValueError unless `messages` is a non-empty list of {role, str content} dicts."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of dicts, got {messages!r:.80}")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{index}] must be a dict, got {type(message).__name__}")
        role = message.get("role")
        # isinstance first: a list or dict role is unhashable, so `in` would raise TypeError.
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise ValueError(
                f"messages[{index}]['role'] must be one of {sorted(CHAT_ROLES)}, got {role!r:.60}"
            )
        content = message.get("content")
        if not isinstance(content, str):
            raise ValueError(
                f"messages[{index}]['content'] must be a str, got {type(content).__name__}"
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

    def _is_known(self, token_id: int) -> bool:
        return 0 <= token_id < 256 or token_id in self._special_names

    def _is_special(self, token_id: int) -> bool:
        return not 0 <= token_id < 256


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

    def _is_known(self, token_id: int) -> bool:
        return 0 <= token_id < self._num_base or token_id in self._special_names

    def _is_special(self, token_id: int) -> bool:
        return token_id >= self._num_base


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
        self._tokenizer.encode_special_tokens = not parse_special
        try:
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        finally:
            self._tokenizer.encode_special_tokens = False

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

    def _is_known(self, token_id: int) -> bool:
        return token_id in self._known_ids

    def _is_special(self, token_id: int) -> bool:
        # Known special tokens are skipped by the library; only unknown ids are ours to drop.
        return token_id not in self._known_ids


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


def _eos_ids(vocab: dict[str, int], eos_token: str | None = None) -> tuple[int, ...]:
    names = {*_EOS_NAMES, eos_token} - {None}
    return tuple(sorted({vocab[name] for name in names if name in vocab}))


def _special_token_regex(special_ids: dict[str, int]) -> re.Pattern[str]:
    # Longest first, so a special that is a prefix of another cannot win.
    names = sorted(special_ids, key=len, reverse=True)
    return re.compile("(" + "|".join(map(re.escape, names)) + ")")


def _runs(items: list[int | str]) -> Iterable[tuple[bool, list]]:
    """Group consecutive placeholders (True) and consecutive backend ids (False)."""
    for is_text, group in groupby(items, key=lambda item: isinstance(item, str)):
        yield is_text, list(group)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(value: Any) -> str | None:
    # HF configs spell a token either as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    template_file = directory / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    # Some configs hold a list of named templates; "default" is the one HF would use.
    if isinstance(template, list):
        by_name = {entry.get("name"): entry.get("template") for entry in template}
        template = by_name.get("default", next(iter(by_name.values()), None))
    return template if isinstance(template, str) else None


@functools.cache
def _jinja_env() -> ImmutableSandboxedEnvironment:
    # Same settings HF uses, so published templates render the way their authors tested them.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_error
    return env


def _compile_template(source: str) -> jinja2.Template:
    return _jinja_env().from_string(source)


def _tojson(value: Any, indent: int | None = None) -> str:
    # Jinja's own tojson HTML-escapes <, >, & and ', which would corrupt prompts.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template error: {message}")
