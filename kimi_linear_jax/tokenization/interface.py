"""The interface every tokenizer kind shares (`Tokenizer`): text <-> ids, chat-template rendering
and chat encoding in which only the template's markup yields special ids; plus the helpers the
kinds share (stop ids, placeholder runs)."""

from __future__ import annotations

import abc
import hashlib
import re
import secrets
from collections.abc import Iterable, Sequence
from itertools import groupby

from kimi_linear_jax.tokenization.chat_template import _compile_template, validate_messages

# Names that end a turn or a document; whichever of them a vocabulary has become stop ids.
_EOS_NAMES = ("[EOS]", "<|im_end|>")


def check_text(text: str) -> str:
    """`text` if it is valid Unicode text; a lone surrogate (U+D800..U+DFFF, which JSON's
    "\\ud800" can carry) is not, and every tokenizer kind refuses it with this ValueError
    (the server's 400) rather than each library's own error."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"text is not valid Unicode: a lone surrogate U+{ord(text[e.start]):04X} at "
            f"character {e.start}"
        ) from None
    return text


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
        # The template's source and the special strings it renders with, as the server's
        # /tokenizer_info gives them to clients that render prompts themselves (lm-eval).
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token

    @abc.abstractmethod
    def encode(
        self, text: str, *, add_special_tokens: bool = False, parse_special: bool = True
    ) -> list[int]:
        """Ids for `text`. Special-token strings in it become their ids, unless
        `parse_special=False`: then they are encoded as the plain text they are."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Ids of each of `texts`, documents rather than prompts: special-token strings are
        plain text. Kinds with a parallel encoder override this."""
        return [self.encode(text, parse_special=False) for text in texts]

    @abc.abstractmethod
    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text for `ids`; invalid UTF-8 becomes U+FFFD."""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, which may be part of a UTF-8 character (its decode
        alone is then U+FFFD). By default its decoded text's bytes; the byte-level kinds give
        the raw bytes."""
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    @abc.abstractmethod
    def fingerprint(self) -> str:
        """A digest of what maps text to ids (vocabulary, merges, specials): equal for two
        tokenizers that encode alike, so that data built from token ids (a corpus n-gram
        table) can be kept on disk and found again."""

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
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
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


def _eos_ids(vocab: dict[str, int], eos_token: str | None = None) -> tuple[int, ...]:
    names = {*_EOS_NAMES, eos_token} - {None}
    return tuple(sorted({vocab[name] for name in names if name in vocab}))


def _runs(items: list[int | str]) -> Iterable[tuple[bool, list]]:
    """Group consecutive placeholders (True) and consecutive backend ids (False)."""
    for is_text, group in groupby(items, key=lambda item: isinstance(item, str)):
        yield is_text, list(group)


def digest(*parts: str | bytes) -> str:
    """sha256 hex digest of `parts`, each length-prefixed (no two splits of one string
    collide)."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()
