"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over one `LLM`.

The engine is not thread-safe, so one background thread (`EngineLoop`) owns the `LLM`: HTTP
handlers never touch it, they put add / abort commands on a thread-safe queue that the loop
drains before each step, and the loop hands each request's outputs back to the asyncio side
through a per-request `asyncio.Queue` (`loop.call_soon_threadsafe`).

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream`), GET /v1/models,
GET /health, GET /metrics (Prometheus, one registry per server). Errors use OpenAI's body
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import queue
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException

from kimi_linear_jax.tokenizer import validate_messages
from serving.engine import COUNTERS, LLM, RequestOutput
from serving.sampling import SamplingParams

DEFAULT_MODEL_NAME = "kimi-linear-default"
METRIC_PREFIX = "kimi_linear"
# Latency buckets in seconds: CPU runs of the small model reach seconds, GPU decode is ms.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
log = logging.getLogger("kimi_linear_jax.server")


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


# nginx's "client closed request": logged for a non-streaming client that went away.
CLIENT_CLOSED = 499
# How often a non-streaming handler checks that its client is still there.
DISCONNECT_POLL_S = 0.25
# Bound on a graceful shutdown: running requests get this long, then are cancelled.
SHUTDOWN_GRACE_S = 5


def _param_of(message: str) -> str | None:
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


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str]
    logprobs: int | None = None


class ChatRequest(_SamplingFields):
    messages: list
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def sampling_params(body: _SamplingFields, max_tokens: int, logprobs: int | None):
    """SamplingParams from a request body; raises ApiError(400) naming a bad field."""
    if body.n != 1:
        raise bad_request("only n=1 is supported", "n")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    fields = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    fields += ("presence_penalty", "frequency_penalty", "seed", "ignore_eos")
    try:
        return SamplingParams(
            **{name: getattr(body, name) for name in fields},
            max_tokens=max_tokens,
            stop=stop,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            logprobs=logprobs,
        )
    except (TypeError, ValueError) as e:
        raise bad_request(str(e)) from e


# ---- the engine thread -------------------------------------------------------------------------

ACCEPTED = object()  # pushed once the engine queued a request


class _Stream:
    """The asyncio side of one request: the engine thread pushes into it thread-safely."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def push(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class EngineLoop:
    """The one thread that owns the `LLM`: drains commands, steps, routes outputs."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.snapshot = llm.metrics()  # read by /metrics; replaced (not mutated) by the loop
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._stop = threading.Event()
        self._resumed = threading.Event()
        self._resumed.set()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.broken: str | None = None  # set when a step raised out of the engine itself

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop stepping; requests still running end with an error (bounded shutdown)."""
        self._stop.set()
        self._resumed.set()
        self._thread.join(timeout=30)
        for rid, stream in self._streams.items():
            stream.push(RuntimeError("server shutting down"))
            self.llm.abort_request(rid)
        self._streams.clear()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def pause(self) -> None:
        """Hold the loop between steps (commands wait in the queue); tests use it to fill the
        queue or run out a timeout deterministically."""
        self._resumed.clear()

    def resume(self) -> None:
        self._resumed.set()

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, stream) -> None:
        self._commands.put(("add", request_id, prompt, params, stream))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._resumed.wait(timeout=0.1):
                continue
            self._drain(block=not self.llm.has_unfinished_requests())
            if self.llm.has_unfinished_requests():
                self._step()
            self.snapshot = self.llm.metrics()

    def _drain(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
            while True:
                self._apply(command)
                command = self._commands.get_nowait()
        except queue.Empty:
            return

    def _apply(self, command: tuple) -> None:
        if command[0] == "abort":
            self._streams.pop(command[1], None)
            self.llm.abort_request(command[1])
            return
        _, rid, prompt, params, stream = command
        try:
            self.llm.add_request(prompt, params, rid)
        except ValueError as e:
            stream.push(e)
            return
        self._streams[rid] = stream
        stream.push(ACCEPTED)

    def _step(self) -> None:
        try:
            outputs = self.llm.step()
        except Exception as e:  # the engine broke: fail every request rather than hang them
            log.exception("engine step failed")
            self.broken = f"{type(e).__name__}: {e}"
            for rid, stream in self._streams.items():
                stream.push(RuntimeError(f"engine step failed: {e}"))
                self.llm.abort_request(rid)
            self._streams.clear()
            return
        self.broken = None
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted by its client
            stream.push(out)
            if out.finished:
                del self._streams[out.request_id]


# ---- metrics -----------------------------------------------------------------------------------


class _EngineCollector:
    """Exports `LLM.metrics()` (the loop's latest snapshot) at scrape time: counters as
    counters, the rest (running, waiting, pages_*, slots_*, and any spec_* / prefix_cache_*
    keys an engine adds) as gauges."""

    def __init__(self, engine: EngineLoop) -> None:
        self.engine = engine

    def collect(self):
        for key, value in sorted(self.engine.snapshot.items()):
            if not isinstance(value, int | float):
                continue
            name = f"{METRIC_PREFIX}_engine_{key}"
            if key in COUNTERS or key == "step_seconds":
                family = CounterMetricFamily(name, f"engine counter {key}", value=value)
            else:
                family = GaugeMetricFamily(name, f"engine gauge {key}", value=value)
            yield family


class ServerMetrics:
    """The server's Prometheus metrics in their own registry (several servers per process)."""

    def __init__(self, engine: EngineLoop, server: OpenAIServer) -> None:
        self.registry = CollectorRegistry()
        p, r = METRIC_PREFIX, self.registry
        self.requests = Counter(f"{p}_requests", "requests by HTTP status", ["status"], registry=r)
        self.ttft = Histogram(
            f"{p}_time_to_first_token_seconds",
            "time to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            f"{p}_inter_token_latency_seconds",
            "time between tokens",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(f"{p}_generation_tokens", "tokens sent to clients", registry=r)
        in_flight = Gauge(f"{p}_server_in_flight", "requests admitted, not done", registry=r)
        in_flight.set_function(lambda: server.in_flight)
        r.register(_EngineCollector(engine))


# ---- the server --------------------------------------------------------------------------------


@dataclasses.dataclass
class _Ticket:
    """One admitted request, as the handler sees it."""

    request_id: str
    stream: _Stream
    arrival: float
    deadline: float
    done: bool = False
    released: bool = False


class _TextDelta:
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


class OpenAIServer:
    """Owns the engine loop, the metrics and the FastAPI app (`self.app`)."""

    def __init__(
        self,
        llm: LLM,
        *,
        model_name: str = DEFAULT_MODEL_NAME,
        max_queue: int = 256,
        request_timeout: float = 600.0,
    ) -> None:
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.model_name = model_name
        self.max_queue = max_queue
        self.request_timeout = request_timeout
        self.in_flight = 0  # touched on the event loop only
        self.engine = EngineLoop(llm)
        self.metrics = ServerMetrics(self.engine, self)
        self.app = self._build_app()

    # ---- app wiring ----

    def _build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            self.engine.start()
            yield
            self.engine.stop()

        app = FastAPI(title="kimi-linear-jax", lifespan=lifespan)
        app.add_exception_handler(ApiError, self._api_error)
        app.add_exception_handler(RequestValidationError, self._validation_error)
        app.add_exception_handler(HTTPException, self._http_error)
        app.add_exception_handler(Exception, self._internal_error)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)
        app.get("/v1/models")(self.models)
        app.get("/health")(self.health)
        app.get("/metrics")(self.prometheus)
        return app

    def _error_response(self, error: ApiError) -> JSONResponse:
        self.metrics.requests.labels(str(error.status)).inc()
        return JSONResponse(error.body(), status_code=error.status)

    async def _api_error(self, request: Request, exc: ApiError) -> JSONResponse:
        return self._error_response(exc)

    async def _validation_error(self, request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return self._error_response(bad_request(f"malformed JSON body: {first['msg']}"))
        where = ".".join(loc) or "body"
        return self._error_response(bad_request(f"{where}: {first['msg']}", where))

    async def _http_error(self, request: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return self._error_response(ApiError(exc.status_code, str(exc.detail), kind))

    async def _internal_error(self, request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return self._error_response(ApiError(500, f"internal error: {exc}", "server_error"))

    # ---- plain endpoints ----

    async def models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": 0}
        card.update(owned_by="kimi-linear-jax", max_model_len=self.llm.max_model_len)
        return {"object": "list", "data": [card]}

    async def health(self) -> Response:
        """503 when the engine cannot step: its thread stopped, or a step fault it could not
        recover from. A fault it recovered from (the step's requests failed alone) is shown
        as `last_error` with status ok."""
        if not self.engine.alive:
            return JSONResponse({"status": "engine loop stopped"}, status_code=503)
        if self.engine.broken is not None:
            body = {"status": "engine cannot step", "error": self.engine.broken}
            return JSONResponse(body, status_code=503)
        body = {"status": "ok"}
        if self.llm.last_error is not None:
            body["last_error"] = self.llm.last_error
        return JSONResponse(body)

    async def prometheus(self) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type="text/plain")

    # ---- generation endpoints ----

    async def completions(self, body: CompletionRequest, request: Request):
        self._check_model(body.model)
        prompt = self._completion_prompt(body.prompt)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        params = sampling_params(body, max_tokens, body.logprobs)
        return await self._respond(request, body, prompt, params, chat=False)

    async def chat_completions(self, body: ChatRequest, request: Request):
        self._check_model(body.model)
        prompt = self._chat_prompt(body.messages)
        max_tokens = body.max_completion_tokens
        if max_tokens is None:  # 0 is a value (and is refused), not a missing field
            max_tokens = body.max_tokens
        if max_tokens is None:  # OpenAI's default: whatever the context has left
            max_tokens = max(self.llm.max_model_len - len(prompt), 1)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling_params(body, max_tokens, logprobs)
        return await self._respond(request, body, prompt, params, chat=True)

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            message = f"the model {name!r} does not exist; this server has {self.model_name!r}"
            raise ApiError(404, message, "not_found_error", "model", "model_not_found")

    def _completion_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise bad_request("only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, list):
            return prompt
        if self.tokenizer is None:
            raise bad_request("a text prompt needs a tokenizer; pass token ids", "prompt")
        try:
            return self.tokenizer.encode(prompt)
        except ValueError as e:  # UnicodeEncodeError: a lone surrogate is not text
            raise bad_request(f"prompt is not valid text: {e}", "prompt") from e

    def _chat_prompt(self, messages: list) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("chat needs a tokenizer; this model has none", "messages")
        messages = [_flatten_content(m) for m in messages]
        try:
            validate_messages(messages)
            return self.tokenizer.encode_chat(messages)  # content never yields special ids
        except ValueError as e:
            raise bad_request(str(e), "messages") from e

    async def _respond(self, request, body, prompt: list[int], params: SamplingParams, chat):
        ticket = await self._admit(prompt, params)
        outputs = self._outputs(ticket)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            events = self._sse(outputs, ticket, params, chat, usage)
            self.metrics.requests.labels("200").inc()
            return _EventStream(events, on_close=lambda: self._release(ticket))
        try:
            final = await self._final_or_disconnect(outputs, request)
        finally:
            self._release(ticket)  # a client gone: the request is aborted here
        if final is None:
            self.metrics.requests.labels(str(CLIENT_CLOSED)).inc()
            return Response(status_code=CLIENT_CLOSED)
        self.metrics.requests.labels("200").inc()
        return _full_response(self, ticket, final, chat)

    async def _final_or_disconnect(self, outputs, request) -> RequestOutput | None:
        """The final output, or None as soon as the client has gone (polled while waiting:
        a non-streaming client that gives up must not keep its request running)."""

        async def last():
            final = None
            async for out in outputs:
                final = out
            return final

        task = asyncio.ensure_future(last())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    return None
        finally:
            task.cancel()

    # ---- request lifecycle ----

    async def _admit(self, prompt: list[int], params: SamplingParams) -> _Ticket:
        """Queue the request on the engine; raise 503 when the queue is full and 400 for
        what the engine rejects (its ValueError message)."""
        if self.in_flight >= self.llm.max_num_seqs + self.max_queue:
            raise ApiError(503, "server busy: the request queue is full", "server_busy")
        now = time.perf_counter()
        ticket = _Ticket(f"cmpl-{uuid.uuid4().hex}", _Stream(), now, now + self.request_timeout)
        self.in_flight += 1
        self.engine.add(ticket.request_id, prompt, params, ticket.stream)
        try:
            first = await self._next(ticket)
        except BaseException:
            self._release(ticket)
            raise
        if isinstance(first, ValueError):
            self._release(ticket)
            raise bad_request(str(first), _param_of(str(first)))
        return ticket

    async def _next(self, ticket: _Ticket):
        """The next item from the engine; on the deadline abort and raise 504."""
        try:
            item = await asyncio.wait_for(
                ticket.stream.queue.get(), timeout=max(ticket.deadline - time.perf_counter(), 0)
            )
        except TimeoutError:
            self._release(ticket)
            raise ApiError(
                504, f"request timed out after {self.request_timeout:g} s", "timeout_error"
            ) from None
        if isinstance(item, RuntimeError):
            raise ApiError(500, str(item), "server_error")
        return item

    async def _outputs(self, ticket: _Ticket) -> AsyncIterator[RequestOutput]:
        """The request's cumulative outputs until it finishes; records latency metrics."""
        last, count = None, 0
        while True:
            out = await self._next(ticket)
            now, new = time.perf_counter(), len(out.token_ids) - count
            if new > 0:
                if last is None:
                    self.metrics.ttft.observe(now - ticket.arrival)
                else:
                    for _ in range(new):
                        self.metrics.itl.observe((now - last) / new)
                self.metrics.tokens.inc(new)
                last, count = now, len(out.token_ids)
            if out.finished:
                ticket.done = True
            if out.finish_reason == "error":  # the engine failed this request's step
                raise ApiError(500, out.error or "engine error", "server_error")
            yield out
            if out.finished:
                return

    def _release(self, ticket: _Ticket) -> None:
        """Once per request: abort it in the engine unless it finished (client gone, timeout,
        error) and give back its place in the queue."""
        if ticket.released:
            return
        ticket.released = True
        self.in_flight -= 1
        if not ticket.done:
            self.engine.abort(ticket.request_id)

    async def _sse(self, outputs, ticket, params, chat: bool, usage: bool):
        """OpenAI stream chunks as server-sent events, ending with `data: [DONE]`."""
        delta, final, sent_tokens = _TextDelta(params), None, 0
        try:
            if chat:
                yield _event(_chunk(self, ticket, {"role": "assistant", "content": ""}, None, chat))
            async for out in outputs:
                final = out
                text = delta(out)
                if text or out.finished:
                    # A chunk held back (a partial UTF-8 character, a possible stop string)
                    # keeps its tokens' logprobs for the chunk that carries their text.
                    logprobs = _logprobs(self.tokenizer, out, sent_tokens, chat)
                    sent_tokens = len(out.token_ids)
                    piece = {"content": text} if chat else text
                    chunk = _chunk(self, ticket, piece, out.finish_reason, chat, logprobs)
                    yield _event(chunk)
            if usage:
                yield _event({**_chunk(self, ticket, None, None, chat), **_usage(final)})
        except ApiError as e:
            yield _event(e.body())
        finally:
            self._release(ticket)
        yield "data: [DONE]\n\n"


class _EventStream(StreamingResponse):
    """An SSE response that runs `on_close` however it ends: done, error, or the client gone
    (starlette cancels the body then, and the generator may never reach its `finally`)."""

    def __init__(self, events, on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


# ---- response bodies ---------------------------------------------------------------------------


def _flatten_content(message):
    """OpenAI content parts ([{"type": "text", "text": ...}]) joined into one string."""
    if isinstance(message, dict) and isinstance(message.get("content"), list):
        parts = message["content"]
        texts = [p.get("text") for p in parts if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) == len(parts) and all(isinstance(t, str) for t in texts):
            return {**message, "content": "".join(texts)}
        # Anything else stays a list: validate_messages names the field (a 400).
    return message


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _usage(out: RequestOutput | None) -> dict:
    prompt = len(out.prompt_token_ids) if out else 0
    completion = len(out.token_ids) if out else 0
    usage = {"prompt_tokens": prompt, "completion_tokens": completion}
    return {"usage": {**usage, "total_tokens": prompt + completion}}


def _chunk(server, ticket, piece, finish_reason, chat: bool, logprobs=None) -> dict:
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


def _full_response(server, ticket, out: RequestOutput, chat: bool) -> dict:
    text = out.text or ""
    piece = {"role": "assistant", "content": text} if chat else text
    choice = {
        "index": 0,
        "message" if chat else "text": piece,
        "logprobs": _logprobs(server.tokenizer, out, 0, chat),
        "finish_reason": out.finish_reason,
    }
    head = {"id": ticket.request_id, "object": _object(chat, False), "created": int(time.time())}
    return {**head, "model": server.model_name, "choices": [choice], **_usage(out)}


def _token_text(tokenizer, token: int) -> str:
    """A token's text, distinct per id: a token that is not valid UTF-8 on its own (a byte of
    a multi-byte character decodes to U+FFFD) is named `token_id:N` (vLLM's form), so the
    completions API's `top_logprobs`, keyed by text, keeps one entry per token."""
    text = tokenizer.decode([token]) if tokenizer is not None else None
    return f"token_id:{token}" if not text or "\ufffd" in text else text


def _logprobs(tokenizer, out: RequestOutput, start: int, chat: bool):
    """OpenAI logprobs of tokens[start:] (None unless the request asked for them)."""
    if out.logprobs is None:
        return None
    if chat:  # chat entries carry their bytes, so keys never collide there
        piece = (lambda t: tokenizer.decode([t])) if tokenizer is not None else str
    else:
        piece = functools.partial(_token_text, tokenizer)
    rows = []
    for token, entry in zip(out.token_ids[start:], out.logprobs[start:], strict=False):
        top = sorted(entry.items(), key=lambda kv: -kv[1])
        rows.append((piece(token), entry[token], [(piece(t), lp) for t, lp in top]))
    if chat:
        content = [
            {
                "token": tok,
                "logprob": lp,
                "bytes": list(tok.encode()),
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in top
                ],
            }
            for tok, lp, top in rows
        ]
        return {"content": content}
    return {
        "tokens": [r[0] for r in rows],
        "token_logprobs": [r[1] for r in rows],
        "top_logprobs": [dict(r[2]) for r in rows],
    }


# ---- running it --------------------------------------------------------------------------------


def model_name_for(path: str | None, served_name: str | None = None) -> str:
    """--served-model-name, else the checkpoint's directory name, else the default's name."""
    if served_name:
        return served_name
    if path:
        return os.path.basename(os.path.normpath(path))
    return DEFAULT_MODEL_NAME


def build_app(llm: LLM, **kwargs) -> FastAPI:
    """The FastAPI app over an existing `LLM` (kwargs as `OpenAIServer`). The server object is
    `app.state.server`."""
    server = OpenAIServer(llm, **kwargs)
    server.app.state.server = server
    return server.app


def serve(llm: LLM, host: str = "127.0.0.1", port: int = 8000, **kwargs) -> None:
    """Serve until interrupted (the `kimi-linear-jax serve` command)."""
    uvicorn.run(
        build_app(llm, **kwargs),
        host=host,
        port=port,
        log_level="info",
        # SIGINT / SIGTERM: stop accepting, give running requests this long, then cancel them
        # (their handlers abort them in the engine) and stop the engine loop.
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )


class BackgroundServer:
    """uvicorn in a daemon thread on a free port (tests, benchmarks). Use as a context
    manager; `url` is the base URL."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1") -> None:
        # Bind here, before the thread starts, so the port is known and cannot be taken.
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, 0))
        self.url = f"http://{host}:{self._socket.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()
