"""A checkpoint's tokenizer_config.json (a missing file reads as empty), its token fields (a
string or an AddedToken dict) and the chat template it names (or chat_template.jinja)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


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
