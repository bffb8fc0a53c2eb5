"""OpenAI-compatible HTTP server (FastAPI) over one `LLM`: the app, its metrics and its
requests' lifecycle; `serving/launcher.py` runs it under uvicorn. The request and response
bodies are in `serving/protocol.py`; the thread that owns the engine is
`serving/engine_loop.py`; the ASGI middleware, the SSE response and the background server of
tests and benchmarks are in `serving/asgi.py`.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream`), GET /v1/models,
GET /health, GET /metrics (Prometheus, one registry per server), and vLLM's POST /tokenize,
POST /detokenize, GET /tokenizer_info (`serving/tokenizer_routes.py`). Errors use OpenAI's body
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from kimi_linear_jax.tokenizer import validate_messages
from serving.asgi import BackgroundServer, BodyTimeout, _EventStream  # noqa: F401  (re-exported)
from serving.core.sampling import SamplingParams
from serving.echo import Echo
from serving.engine import LLM, RequestOutput
from serving.engine_loop import ACCEPTED, EngineLoop, Stream
from serving.metrics import ServerMetrics
from serving.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    TextDelta,
    bad_request,
    flatten_content,
    full_response,
    openai_logprobs,
    param_of,
    refuse_unsupported,
    sampling_params,
    sse_event,
    stream_chunk,
    usage_body,
)
from serving.status_routes import add_status_routes
from serving.tokenizer_routes import add_tokenizer_routes

DEFAULT_MODEL_NAME = "kimi-linear-default"
log = logging.getLogger("kimi_linear_jax.server")


# nginx's "client closed request": logged for a non-streaming client that went away.
CLIENT_CLOSED = 499
# How often a non-streaming handler checks that its client is still there.
DISCONNECT_POLL_S = 0.25
DRAIN = object()  # pushed to a running request's stream when the drain time is over
# Requests get this long to finish once SIGTERM / SIGINT came (`serving/launcher.py`); a
# stream still running then ends with an OpenAI error event and [DONE], a non-streaming
# request with a JSON 503.
DRAIN_S = 3.5
# The request the server runs before /health says ok (its first compile).
WARM_UP_ID = "warm-up"
# A request body must arrive within this long (a slowloris client must not hold a connection).
BODY_TIMEOUT_S = 30.0
# and be at most this long: 32 MiB holds a 1M-token prompt as token ids, far more as text.
MAX_REQUEST_BYTES = 32 << 20
# Characters of a text prompt tokenized first: past max_model_len tokens already, the prompt
# is refused without tokenizing the rest (a token covers at least one character).
PROMPT_PROBE_CHARS_PER_TOKEN = 8


# ---- the server --------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)  # hashed by identity: the server keeps a set of them
class _Ticket:
    """One admitted request, as the handler sees it."""

    request_id: str
    stream: Stream
    arrival: float
    deadline: float
    done: bool = False
    released: bool = False


class OpenAIServer:
    """Owns the engine loop, the metrics and the FastAPI app (`self.app`)."""

    def __init__(
        self,
        llm: LLM,
        *,
        model_name: str = DEFAULT_MODEL_NAME,
        max_queue: int = 256,
        request_timeout: float = 600.0,
        enable_docs: bool = False,
        body_timeout: float = BODY_TIMEOUT_S,
        max_request_bytes: int = MAX_REQUEST_BYTES,
    ) -> None:
        self.llm = llm
        self.enable_docs = enable_docs
        self.body_timeout = body_timeout
        self.max_request_bytes = max_request_bytes
        self.tokenizer = llm.tokenizer
        self.model_name = model_name
        self.max_queue = max_queue
        self.request_timeout = request_timeout
        self.in_flight = 0  # touched on the event loop only
        self.ready = False  # /health: the warm-up request has run
        self._tickets: set[_Ticket] = set()  # admitted, not released (a drain wakes them)
        self.draining = False  # a shutdown began: no new requests
        self._loop: asyncio.AbstractEventLoop | None = None
        self.engine = EngineLoop(llm)
        self.metrics = ServerMetrics(self.engine, self)
        self.app = self._build_app()

    # ---- app wiring ----

    def _build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            self.engine.start()
            self._loop = asyncio.get_running_loop()
            warm = asyncio.ensure_future(self._warm_up())
            yield
            warm.cancel()
            self.engine.stop()

        # /docs, /redoc and /openapi.json describe the whole API: off unless asked for.
        docs = {} if self.enable_docs else dict(docs_url=None, redoc_url=None, openapi_url=None)
        app = FastAPI(title="kimi-linear-jax", lifespan=lifespan, **docs)
        app.add_middleware(BodyTimeout, timeout=self.body_timeout, max_bytes=self.max_request_bytes)
        app.add_exception_handler(ApiError, self._api_error)
        app.add_exception_handler(RequestValidationError, self._validation_error)
        app.add_exception_handler(HTTPException, self._http_error)
        app.add_exception_handler(Exception, self._internal_error)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)
        add_status_routes(app, self)
        add_tokenizer_routes(app, self)
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

    async def _warm_up(self) -> None:
        """One token through the engine loop (so that every process of a group runs it), to
        compile the first prefill and decode steps; /health is ready once it is done.
        Requests that arrive meanwhile queue as usual."""
        stream = Stream()
        params = SamplingParams(temperature=0, max_tokens=1)
        self.engine.add(WARM_UP_ID, [0], params, stream)
        while True:
            item = await stream.queue.get()
            if item is ACCEPTED:
                continue
            if not isinstance(item, RequestOutput) or item.finished:
                break
        self.ready = True

    # ---- generation endpoints ----

    async def completions(self, body: CompletionRequest, request: Request):
        self._check_model(body.model)
        refuse_unsupported(body)
        prompt = await self._completion_prompt(body.prompt)
        max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = 16 if body.max_tokens is None else body.max_tokens
        if body.prompt_logprobs is not None and body.stream:
            # vLLM's rule too: a stream's chunks have no place for them.
            raise bad_request("prompt_logprobs are not available with stream", "prompt_logprobs")
        if not body.echo:
            params = sampling_params(body, max_tokens, body.logprobs)
            return await self._respond(request, body, prompt, params, chat=False)
        if body.stream:
            raise bad_request("echo is not available with stream", "echo")
        echo = Echo(body.logprobs, max_tokens > 0, body.prompt_logprobs is not None)
        # The prompt's logprobs at least as wide as the completion's; max_tokens 0 runs one
        # token (the engine always generates) and returns none of it.
        asked = [n for n in (body.prompt_logprobs, body.logprobs) if n is not None]
        wide = max(asked) if asked else None
        params = sampling_params(body, max(max_tokens, 1), body.logprobs, prompt_logprobs=wide)
        return await self._respond(request, body, prompt, params, chat=False, echo=echo)

    async def chat_completions(self, body: ChatRequest, request: Request):
        self._check_model(body.model)
        refuse_unsupported(body)
        prompt = await asyncio.to_thread(self._chat_prompt, body.messages)
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

    async def _completion_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request("only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, list):
            return prompt
        if self.tokenizer is None:
            raise bad_request("a text prompt needs a tokenizer; pass token ids", "prompt")
        try:  # off the event loop: a long prompt must not stall the other clients
            return await asyncio.to_thread(self._encode_bounded, prompt)
        except ValueError as e:  # a lone surrogate is not text
            raise bad_request(f"prompt is not valid text: {e}", "prompt") from e

    def _encode_bounded(self, text: str) -> list[int]:
        """The prompt's ids; a prompt whose first characters are already more tokens than
        the model's context is refused before the rest is tokenized."""
        limit = self.llm.max_model_len
        probe = limit * PROMPT_PROBE_CHARS_PER_TOKEN
        if len(text) > probe and len(self.tokenizer.encode(text[:probe])) > limit:
            raise ApiError(
                400,
                f"prompt length exceeds max_model_len {limit} (more than {limit} tokens in "
                f"its first {probe} characters)",
                "invalid_request_error",
                "prompt",
            )
        return self.tokenizer.encode(text)

    def _chat_prompt(self, messages: list) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("chat needs a tokenizer; this model has none", "messages")
        messages = [flatten_content(m) for m in messages]
        try:
            validate_messages(messages)
            return self.tokenizer.encode_chat(messages)  # content never yields special ids
        except ValueError as e:
            raise bad_request(str(e), "messages") from e

    async def _respond(
        self, request, body, prompt: list[int], params: SamplingParams, chat, echo=None
    ):
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
        return full_response(self, ticket, final, chat, echo)

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
        if not self.engine.alive:  # nothing would ever take the request
            raise ApiError(503, "the engine loop has stopped", "server_error")
        if self.draining:
            raise ApiError(503, "the server is shutting down", "server_error")
        now = time.perf_counter()
        ticket = _Ticket(f"cmpl-{uuid.uuid4().hex}", Stream(), now, now + self.request_timeout)
        self.in_flight += 1
        self._tickets.add(ticket)
        self.engine.add(ticket.request_id, prompt, params, ticket.stream)
        try:
            first = await self._next(ticket)
        except BaseException:
            self._release(ticket)
            raise
        if isinstance(first, ValueError):
            self._release(ticket)
            raise bad_request(str(first), param_of(str(first)))
        return ticket

    def begin_drain(self) -> None:
        """A shutdown began (call from any thread): each running request gets DRAIN_S more
        to finish, then its handler is woken with DRAIN (a 503, or a stream's error event)."""
        if self._loop is None:
            return

        def drain() -> None:
            self.draining = True
            for ticket in list(self._tickets):
                self._loop.call_later(DRAIN_S, ticket.stream.queue.put_nowait, DRAIN)

        self._loop.call_soon_threadsafe(drain)

    async def _next(self, ticket: _Ticket):
        """The next item from the engine; on the deadline abort and raise 504, and when a
        shutdown's drain time is over, 503."""
        try:
            item = await asyncio.wait_for(
                ticket.stream.queue.get(), timeout=max(ticket.deadline - time.perf_counter(), 0)
            )
        except TimeoutError:
            self._release(ticket)
            raise ApiError(
                504, f"request timed out after {self.request_timeout:g} s", "timeout_error"
            ) from None
        if item is DRAIN:
            self._release(ticket)
            raise ApiError(503, "the server is shutting down", "server_error")
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
        self._tickets.discard(ticket)
        if not ticket.done:
            self.engine.abort(ticket.request_id)

    async def _sse(self, outputs, ticket, params, chat: bool, usage: bool):
        """OpenAI stream chunks as server-sent events, ending with `data: [DONE]`."""
        delta, final, sent_tokens = TextDelta(params), None, 0
        try:
            if chat:
                yield sse_event(
                    stream_chunk(self, ticket, {"role": "assistant", "content": ""}, None, chat)
                )
            async for out in outputs:
                final = out
                text = delta(out)
                if text or out.finished:
                    # A chunk held back (a partial UTF-8 character, a possible stop string)
                    # keeps its tokens' logprobs for the chunk that carries their text.
                    logprobs = openai_logprobs(self.tokenizer, out, sent_tokens, chat)
                    sent_tokens = len(out.token_ids)
                    piece = {"content": text} if chat else text
                    chunk = stream_chunk(self, ticket, piece, out.finish_reason, chat, logprobs)
                    yield sse_event(chunk)
            if usage:
                yield sse_event(
                    {**stream_chunk(self, ticket, None, None, chat), **usage_body(final)}
                )
        except ApiError as e:
            yield sse_event(e.body())
        finally:
            self._release(ticket)
        yield "data: [DONE]\n\n"


# ---- the app ----------------------------------------------------------------------------------


def build_app(llm: LLM, **kwargs) -> FastAPI:
    """The FastAPI app over an existing `LLM` (kwargs as `OpenAIServer`). The server object is
    `app.state.server`."""
    server = OpenAIServer(llm, **kwargs)
    server.app.state.server = server
    return server.app
