"""The OpenAI protocol of the server: request bodies (strict pydantic models), the error body,
and the response bodies and stream chunks built from `RequestOutput`s. No engine, no app."""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from typing import Any

from pydantic import BaseModel, ConfigDict

from serving.core.sampling import SamplingParams, logit_bias_from_json
from serving.echo import echo_logprobs, echo_text
from serving.output import RequestOutput


class ApiError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, type_: str, param=None, code=None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type_
        self.param, self.code = param, code

    def body(self) -> dict:
        fields = {"message": self.message, "type": self.type, "param": self.param}
        return {"error": {**fields, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


def param_of(message: str) -> str | None:
    """The field a SamplingParams / engine ValueError names first ("top_p must be ...")."""
    word = message.split(" ", 1)[0].rstrip(":")
    fields = {f.name for f in dataclasses.fields(SamplingParams)} | {"prompt", "messages"}
    if word in fields:
        return word
    # The engine's prompt checks ("token id 999 is outside ...", "prompt length ... exceeds").
    return "prompt" if word in ("token", "prompt") else None


# ---- request bodies ----------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields both endpoints share: OpenAI's plus vLLM's extras (top_k, min_p, ...)."""

    # Strict: a string where a number belongs is a 400, not a silent conversion.
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict | None = None  # {"token id": bias}, OpenAI's form
    # Accepted by OpenAI, not served here: named so that a request using them gets a 400
    # (`refuse_unsupported`) instead of being answered as if they were not there.
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: Any = None


def refuse_unsupported(body: _SamplingFields) -> None:
    """400 naming the first field the server cannot honour; their no-op values pass."""
    noop = {
        "response_format": lambda v: v.get("type") == "text",
        "tools": lambda v: not v,
        "tool_choice": lambda v: v == "none",
        "best_of": lambda v: v == 1,
        "suffix": lambda v: v == "",
    }
    for name, harmless in noop.items():
        value = getattr(body, name, None)
        if value is not None and not harmless(value):
            raise bad_request(f"{name} is not supported by this server", name)


class CompletionRequest(_SamplingFields):
    # Token ids may come as one list or, as lm-eval's `tokenized_requests` sends them, a list
    # of one list.
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    max_completion_tokens: int | None = None  # the chat name, taken here too (as vLLM does)
    best_of: int | None = None
    suffix: str | None = None
    prompt_logprobs: int | None = None  # vLLM's extra: each choice gets "prompt_logprobs"


class ChatRequest(_SamplingFields):
    messages: list
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def sampling_params(
    body: _SamplingFields, max_tokens: int, logprobs: int | None, prompt_logprobs=None
):
    """SamplingParams from a request body; raises ApiError(400) naming a bad field.
    `prompt_logprobs`: the body's, unless given."""
    if body.n != 1:
        raise bad_request("only n=1 is supported", "n")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    fields = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    fields += ("presence_penalty", "frequency_penalty", "seed", "ignore_eos")
    try:
        return SamplingParams(
            **{name: getattr(body, name) for name in fields},
            logit_bias=logit_bias_from_json(body.logit_bias or {}),
            max_tokens=max_tokens,
            stop=stop,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs
            if prompt_logprobs is not None
            else getattr(body, "prompt_logprobs", None),
        )
    except (TypeError, ValueError) as e:
        raise bad_request(str(e), param_of(str(e))) from e


class TextDelta:
    """New text of a cumulative output. While running it holds back a trailing U+FFFD (a
    partial UTF-8 character may still complete) and the last len(stop)-1 characters (they may
    start a stop string, which the final text excludes)."""

    def __init__(self, params: SamplingParams) -> None:
        self.sent = ""
        self.hold = max((len(s) for s in params.stop), default=1) - 1

    def __call__(self, out: RequestOutput) -> str:
        text = out.text or ""
        if not out.finished:
            text = text.rstrip("\ufffd")
            text = text[: max(len(text) - self.hold, 0)]
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta


# ---- response bodies ---------------------------------------------------------------------------


def flatten_content(message):
    """OpenAI content parts ([{"type": "text", "text": ...}]) joined into one string."""
    if isinstance(message, dict) and isinstance(message.get("content"), list):
        parts = message["content"]
        texts = [p.get("text") for p in parts if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) == len(parts) and all(isinstance(t, str) for t in texts):
            return {**message, "content": "".join(texts)}
        # Anything else stays a list: validate_messages names the field (a 400).
    return message


def sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage_body(out: RequestOutput | None) -> dict:
    prompt = len(out.prompt_token_ids) if out else 0
    completion = len(out.token_ids) if out else 0
    usage = {"prompt_tokens": prompt, "completion_tokens": completion}
    return {"usage": {**usage, "total_tokens": prompt + completion}}


def stream_chunk(server, ticket, piece, finish_reason, chat: bool, logprobs=None) -> dict:
    head = {"id": ticket.request_id, "created": int(time.time()), "model": server.model_name}
    if piece is None:  # the usage chunk: no choices
        return {**head, "object": _object(chat, True), "choices": []}
    key = "delta" if chat else "text"
    choice = {"index": 0, key: piece, "logprobs": logprobs, "finish_reason": finish_reason}
    return {**head, "object": _object(chat, True), "choices": [choice]}


def _object(chat: bool, stream: bool) -> str:
    if chat:
        return "chat.completion.chunk" if stream else "chat.completion"
    return "text_completion"


def full_response(server, ticket, out: RequestOutput, chat: bool, echo=None) -> dict:
    """The whole response; `echo` (a `serving.echo.Echo`, completions only): the prompt's text
    and logprobs in front of the completion's, and vLLM's `prompt_logprobs` only if asked."""
    text = out.text or ""
    logprobs = openai_logprobs(server.tokenizer, out, 0, chat)
    if echo is not None:
        piece = functools.partial(_token_text, server.tokenizer)
        text = echo_text(server.tokenizer, out, echo)
        logprobs = echo_logprobs(server.tokenizer, out, echo, piece, logprobs)
    choice = {
        "index": 0,
        "message" if chat else "text": {"role": "assistant", "content": text} if chat else text,
        "logprobs": logprobs,
        "finish_reason": out.finish_reason,
    }
    if out.prompt_logprobs is not None and (echo is None or echo.prompt_logprobs):
        choice["prompt_logprobs"] = vllm_prompt_logprobs(server.tokenizer, out.prompt_logprobs)
    usage = usage_body(out)
    if echo is not None and not echo.completion:  # max_tokens 0: the one token run is not sent
        usage["usage"].update(completion_tokens=0, total_tokens=len(out.prompt_token_ids))
    head = {"id": ticket.request_id, "object": _object(chat, False), "created": int(time.time())}
    return {**head, "model": server.model_name, "choices": [choice], **usage}


def _token_text(tokenizer, token: int) -> str:
    """A token's text, distinct per id: a token that is not valid UTF-8 on its own (a byte of
    a multi-byte character decodes to U+FFFD) is named `token_id:N` (vLLM's form), so the
    completions API's `top_logprobs`, keyed by text, keeps one entry per token."""
    text = tokenizer.decode([token]) if tokenizer is not None else None
    return f"token_id:{token}" if not text or "\ufffd" in text else text


def vllm_prompt_logprobs(tokenizer, entries: list) -> list:
    """vLLM's `prompt_logprobs` of a choice: per prompt token None (the first) or
    {"token id": {"logprob", "decoded_token"}}. vLLM's "rank" is left out: the engine keeps
    the top N's order, not the prompt token's rank among all."""

    def one(token: int, logprob: float) -> dict:
        text = tokenizer.decode([token]) if tokenizer is not None else None
        return {"logprob": logprob, "decoded_token": text}

    return [None if e is None else {str(t): one(t, lp) for t, lp in e.items()} for e in entries]


def _ranked(entry: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])


def openai_logprobs(tokenizer, out: RequestOutput, start: int, chat: bool):
    """OpenAI logprobs of tokens[start:] (None unless the request asked for them)."""
    if out.logprobs is None:
        return None
    if chat:  # chat entries carry their bytes, so keys never collide there
        piece = (lambda t: tokenizer.decode([t])) if tokenizer is not None else str
    else:
        piece = functools.partial(_token_text, tokenizer)
    pairs = list(zip(out.token_ids[start:], out.logprobs[start:], strict=False))
    if chat:
        # `bytes`: the token's own bytes (a part of a UTF-8 character stays that part, where
        # its text alone is U+FFFD), so that a client can join them into the text.
        raw = tokenizer.token_bytes if tokenizer is not None else lambda t: str(t).encode()

        def one(t: int, lp: float) -> dict:
            return {"token": piece(t), "logprob": lp, "bytes": list(raw(t))}

        content = [
            {**one(token, entry[token]), "top_logprobs": [one(t, v) for t, v in _ranked(entry)]}
            for token, entry in pairs
        ]
        return {"content": content}
    rows = []
    for token, entry in pairs:
        rows.append((piece(token), entry[token], [(piece(t), lp) for t, lp in _ranked(entry)]))
    return {
        "tokens": [r[0] for r in rows],
        "token_logprobs": [r[1] for r in rows],
        "top_logprobs": [dict(r[2]) for r in rows],
    }
