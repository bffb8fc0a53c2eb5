"""`echo` on /v1/completions: the prompt comes back in front of the completion, and with
`logprobs` its tokens' logprobs too (the first token has none: null), with `text_offset`.

This is how lm-eval's `local-completions` scores a continuation: it sends context +
continuation with `echo: true, max_tokens: 1, logprobs: 1` and sums `token_logprobs` over the
continuation's tokens (dropping the last, the generated one); `max_tokens: 0` with echo asks
for the prompt alone. The prompt logprobs are the engine's `prompt_logprobs`
(`serving/core/prompt_logprobs.py`), asked for at least `logprobs` wide.
"""

from __future__ import annotations

import dataclasses

from serving.output import RequestOutput

# Tokens of context each token's text is decoded with: enough for any UTF-8 character split
# over byte tokens (4 bytes) and for tokenizers whose first token drops a leading space.
_CONTEXT = 4


@dataclasses.dataclass(frozen=True)
class Echo:
    """What an echo request returns: `logprobs` (None: no logprobs), and whether the
    completion is part of it (`max_tokens: 0` runs one token and returns none)."""

    logprobs: int | None
    completion: bool
    prompt_logprobs: bool  # the body asked for vLLM's `prompt_logprobs` as well


def echo_text(tokenizer, out: RequestOutput, echo: Echo) -> str:
    prompt = tokenizer.decode(out.prompt_token_ids) if tokenizer is not None else ""
    return prompt + (out.text or "" if echo.completion else "")


def echo_logprobs(tokenizer, out: RequestOutput, echo: Echo, piece, generated) -> dict | None:
    """OpenAI completions logprobs over prompt + completion. `piece(token)` names a token;
    `generated` is the completion's own logprobs dict (or None)."""
    if echo.logprobs is None:
        return None
    ids = list(out.prompt_token_ids)
    entries = out.prompt_logprobs or [None] * len(ids)
    tokens = [piece(t) for t in ids]
    token_logprobs = [None if e is None else e[t] for t, e in zip(ids, entries, strict=True)]
    top = [None if e is None else _top(e, t, echo.logprobs, piece) for t, e in zip(ids, entries)]
    if echo.completion and generated is not None:
        tokens += generated["tokens"]
        token_logprobs += generated["token_logprobs"]
        top += generated["top_logprobs"]
        ids += list(out.token_ids)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": text_offsets(tokenizer, ids),
    }


def _top(entry: dict[int, float], token: int, n: int, piece) -> dict[str, float]:
    """The `n` likeliest of a position, and the prompt's own token (OpenAI and vLLM add it)."""
    best = sorted(entry.items(), key=lambda kv: -kv[1])[:n]
    if token not in dict(best):
        best.append((token, entry[token]))
    return {piece(t): lp for t, lp in best}


def text_offsets(tokenizer, ids: list[int]) -> list[int]:
    """Where each token's text starts in the decoded text of `ids`: each token decoded after
    a few tokens of context, its new characters added up (O(n), where decoding every prefix
    would be O(n^2) on a long prompt)."""
    if tokenizer is None:
        return list(range(len(ids)))
    offsets, at = [], 0
    for i in range(len(ids)):
        offsets.append(at)
        lo = max(0, i - _CONTEXT)
        before = tokenizer.decode(ids[lo:i]) if i > lo else ""
        at += max(0, len(tokenizer.decode(ids[lo : i + 1])) - len(before))
    return offsets
