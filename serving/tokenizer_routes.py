"""vLLM's tokenizer endpoints on the server: POST /tokenize, POST /detokenize, GET
/tokenizer_info.

lm-eval's `local-completions` probes /tokenizer_info and /tokenize (its "remote" tokenizer
backend) and, when they are missing, loads a Hugging Face tokenizer by the model's name, which
needs the hub. With them it tokenizes context and continuation here and sends token ids, so its
context lengths are the server's own.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from kimi_linear_jax.tokenizer import validate_messages
from serving.protocol import bad_request, flatten_content


class TokenizeRequest(BaseModel):
    """vLLM's body: a `prompt`, or chat `messages` rendered with the template."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list | None = None
    # The completions endpoint encodes prompts without a BOS, so the default here is the ids
    # a completion of this prompt would run.
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[int]


def add_tokenizer_routes(app: FastAPI, server) -> None:
    """Register the three endpoints on `app`, over `server`'s tokenizer and model name."""

    def tokenizer():
        if server.tokenizer is None:
            raise bad_request("this model has no tokenizer; send token ids", "prompt")
        return server.tokenizer

    async def tokenize(body: TokenizeRequest) -> dict:
        server._check_model(body.model)
        tok = tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        try:  # off the event loop, as the completions' prompts
            ids = await asyncio.to_thread(_encode, tok, body)
        except ValueError as e:
            raise bad_request(str(e), "messages" if body.messages else "prompt") from e
        strs = None
        if body.return_token_strs:  # a decode per token: only when asked
            strs = [tok.decode([t], skip_special_tokens=False) for t in ids]
        return {
            "count": len(ids),
            "max_model_len": server.llm.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    async def detokenize(body: DetokenizeRequest) -> dict:
        server._check_model(body.model)
        tok = tokenizer()
        vocab = server.llm.config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": tok.decode(body.tokens)}

    async def tokenizer_info() -> dict:
        tok = tokenizer()
        return {
            "tokenizer_class": type(tok).__name__,
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "pad_token": None,
            "chat_template": tok.chat_template,
            "model_max_length": server.llm.max_model_len,
            "vocab_size": tok.vocab_size,
        }

    app.post("/tokenize")(tokenize)
    app.post("/detokenize")(detokenize)
    app.get("/tokenizer_info")(tokenizer_info)


def _encode(tok, body: TokenizeRequest) -> list[int]:
    if body.prompt is not None:
        return tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    messages = [flatten_content(m) for m in body.messages]
    validate_messages(messages)
    return tok.encode_chat(messages, add_generation_prompt=body.add_generation_prompt)
