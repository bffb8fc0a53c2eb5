"""What `LLM` hands back: `RequestOutput` (vLLM's names), the engine's bookkeeping of a
request beside the scheduler's `Request` (`_Tracked`), and how a step's tokens become outputs:
logprobs kept, stop strings cut on the host, outputs assembled (`OutputsMixin`)."""

from __future__ import annotations

import dataclasses

from serving.request import Request


@dataclasses.dataclass
class RequestOutput:
    """A request's result (vLLM's names). `logprobs`, when asked for, has one dict per generated
    token mapping token id -> logprob: the sampled token and the top `logprobs` tokens.
    `prompt_logprobs`, when asked for, has one entry per prompt token: None for the first (it
    has no context), then a dict of the same form for prompt token i given tokens [:i] (the
    token and the top `prompt_logprobs` tokens; `serving/prompt_logprobs.py`). Both are raw
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


class OutputsMixin:
    """`LLM`'s output side: a step's samples recorded (logprobs, stop strings) and a tracked
    request made a `RequestOutput`. Mixed into `LLM`; it uses `self._tracked`,
    `self._counters`, `self.scheduler` and `self.tokenizer`."""

    def _record(self, rid: str, samples: list, before: int) -> None:
        """Keep the logprobs of the tokens the scheduler appended; cut at a stop string."""
        tracked = self._tracked[rid]
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

    def _record_prompt(self, found: dict) -> None:
        """Place a step's prompt logprobs by position: a prefill again after a preemption
        overwrites what it recomputes."""
        for rid, (first, entries) in found.items():
            tracked = self._tracked.get(rid)
            if tracked is not None and tracked.prompt_logprobs is not None:
                tracked.prompt_logprobs[first : first + len(entries)] = entries

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
            self.scheduler.stop(request, n)
            if tracked.logprobs is not None:
                del tracked.logprobs[n:]
                tracked.cumulative_logprob = sum(d[t] for d, t in zip(tracked.logprobs, ids))
            tracked.text, tracked.stop_reason = text[:pos], stop
            return

    def _error_output(self, prompt, message: str) -> RequestOutput:
        ids = list(prompt) if isinstance(prompt, list | tuple) else []
        return RequestOutput(
            request_id="",
            prompt_token_ids=ids,
            text=None,
            token_ids=[],
            finish_reason="error",
            error=message,
        )

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
