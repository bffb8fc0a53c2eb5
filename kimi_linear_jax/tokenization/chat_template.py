"""Chat templates: Kimi's own, the messages a template accepts (`validate_messages`), and the
sandboxed Jinja environment that compiles a template with HF's settings."""

from __future__ import annotations

import functools
import json
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

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

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


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
