"""What `LLM` hands back: `RequestOutput` (vLLM's names), the engine's bookkeeping of a
request beside the scheduler's `Request` (`_Tracked`), and how a step's tokens become outputs
(`OutputProcessor`: logprobs kept, stop strings cut on the host, outputs assembled)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from serving.core.request import Request


@dataclasses.dataclass
class RequestOutput:
    """A request's result (vLLM's names). `logprobs`, when asked for, has one dict per generated
    token mapping token id -> logprob: the sampled token and the top `logprobs` tokens.
    `prompt_logprobs`, when asked for, has one entry per prompt token: None for the first (it
    has no context), then a dict of the same form for prompt token i given tokens [:i] (the
    token and the top `prompt_logprobs` tokens; `serving/core/prompt_logprobs.py`). Both are raw
    model logprobs (before penalties, temperature and truncation). Such a request takes no
    prefix-cache hit (the skipped positions would have no logits); it still fills the cache.
    Entries of positions not computed (a request that ended in its prefill) stay None.
    `finish_reason` is "stop", "length", "abort", "error" (then `error` says why) or None while
    the request runs; `stop_reason` is the stop string or stop token id that ended it."""

    request_id: str
    prompt_token_ids: list[int]
    text: str | None
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0
    stop_reason: str | int | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class _Tracked:
    """Engine-side bookkeeping of one request beside the scheduler's `Request`."""

    request: Request
    logprobs: list[dict[int, float]] | None
    cumulative_logprob: float | None
    text: str | None = None  # set when a stop string cut the text
    stop_reason: str | int | None = None
    error: str | None = None  # why the request failed (finish_reason "error")
    prompt_logprobs: list[dict[int, float] | None] | None = None  # filled by position


class OutputProcessor:
    """The requests' outputs beside the scheduler. Reads the requests, never changes one: a
    stop string found in the text is handed to `stop(request, num_output_tokens)` (the
    scheduler's), which cuts the tokens and finishes the request."""

    def __init__(self, tokenizer, stop: Callable[[Request, int], None], counters: dict) -> None:
        self.tokenizer = tokenizer
        self._stop = stop
        self._counters = counters
        self.tracked: dict[str, _Tracked] = {}

    def track(self, request: Request) -> None:
        wants = request.params.logprobs is not None
        tracked = _Tracked(request, [] if wants else None, 0.0 if wants else None)
        if request.params.prompt_logprobs is not None:
            tracked.prompt_logprobs = [None] * len(request.prompt_token_ids)
        self.tracked[request.request_id] = tracked

    def finished_ids(self) -> list[str]:
        """Tracked requests already finished (an abort since the last step)."""
        return [rid for rid, t in self.tracked.items() if t.request.is_finished]

    def record(self, rid: str, samples: list, before: int) -> None:
        """Keep the logprobs of the tokens the scheduler appended; cut at a stop string."""
        tracked = self.tracked[rid]
        request = tracked.request
        appended = len(request.output_token_ids) - before
        self._counters["generation_tokens"] += appended
        if tracked.logprobs is not None:
            for s in samples[:appended]:
                tracked.logprobs.append({s.token: s.logprob, **dict(s.top)})
                tracked.cumulative_logprob += s.logprob
        token = request.output_token_ids[-1] if appended else None
        if request.finish_reason == "stop" and token in request.params.stop_token_ids:
            tracked.stop_reason = token
        if request.params.stop and self.tokenizer is not None and appended:
            self._check_stop_strings(tracked, before)

    def record_prompt(self, found: dict) -> None:
        """Place a step's prompt logprobs by position: a prefill again after a preemption
        overwrites what it recomputes."""
        for rid, (first, entries) in found.items():
            tracked = self.tracked.get(rid)
            if tracked is not None and tracked.prompt_logprobs is not None:
                tracked.prompt_logprobs[first : first + len(entries)] = entries

    def fail(self, rid: str, message: str) -> None:
        tracked = self.tracked.get(rid)
        if tracked is not None:
            tracked.error = message

    def _check_stop_strings(self, tracked: _Tracked, before: int) -> None:
        """Host-side stop strings (vLLM: the text excludes the stop string; the token ids end
        with the token that completed it)."""
        request = tracked.request
        ids = request.output_token_ids
        for n in range(before + 1, len(ids) + 1):
            text = self.tokenizer.decode(ids[:n])
            hits = [(text.find(s), s) for s in request.params.stop if s in text]
            if not hits:
                continue
            pos, stop = min(hits)
            self._stop(request, n)
            if tracked.logprobs is not None:
                del tracked.logprobs[n:]
                tracked.cumulative_logprob = sum(d[t] for d, t in zip(tracked.logprobs, ids))
            tracked.text, tracked.stop_reason = text[:pos], stop
            return

    def outputs(self, rids: list[str]) -> list[RequestOutput]:
        """The current output of each of `rids`; finished ones are forgotten after this."""
        outputs = [self._output(self.tracked[rid]) for rid in rids]
        for out in outputs:
            if out.finished:
                del self.tracked[out.request_id]
                self._counters["finished"] += 1
        return outputs

    def _output(self, tracked: _Tracked) -> RequestOutput:
        request, prompt = tracked.request, tracked.prompt_logprobs
        text = tracked.text
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(request.output_token_ids)
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            text=text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.finish_reason,
            logprobs=None if tracked.logprobs is None else list(tracked.logprobs),
            cumulative_logprob=tracked.cumulative_logprob,
            prompt_logprobs=None if prompt is None else list(prompt),
            stop_reason=tracked.stop_reason,
            num_cached_tokens=request.num_cached_tokens,
            error=tracked.error,
        )


def error_output(prompt, message: str) -> RequestOutput:
    """The output of a prompt that failed before it was queued."""
    ids = list(prompt) if isinstance(prompt, list | tuple) else []
    return RequestOutput("", ids, None, [], "error", error=message)
