"""The ASGI plumbing around the server's FastAPI app (`serving/server.py`): the middleware that
bounds how long a request body may take, the server-sent-events response that always releases
its request, and uvicorn in a background thread (tests, benchmarks)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

from serving.connections import TimedH11Protocol
from serving.protocol import ApiError


class BodyTimeout:
    """ASGI middleware bounding a request body: it must arrive within `timeout` seconds (a
    slow client that never finishes would otherwise hold a connection forever: 408), and be
    at most `max_bytes` long (413, before it is parsed: a huge body would otherwise be
    decoded and tokenized on the event loop while every other client waits). The connection
    is closed after either. The body is read here and replayed."""

    def __init__(self, app, timeout: float, max_bytes: int | None = None) -> None:
        self.app, self.timeout, self.max_bytes = app, timeout, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self._declared_too_long(scope):
            return await self._refuse(scope, receive, send, 413, self._too_long())
        messages, size = [], 0
        try:
            async with asyncio.timeout(self.timeout):
                while True:
                    message = await receive()
                    messages.append(message)
                    size += len(message.get("body", b""))
                    if self.max_bytes is not None and size > self.max_bytes:
                        return await self._refuse(scope, receive, send, 413, self._too_long())
                    if message["type"] != "http.request" or not message.get("more_body"):
                        break
        except TimeoutError:
            message = f"request body not received within {self.timeout:g} s"
            return await self._refuse(scope, receive, send, 408, message)
        pending = iter(messages)

        async def replay():
            message = next(pending, None)
            return message if message is not None else await receive()

        await self.app(scope, replay, send)

    def _declared_too_long(self, scope) -> bool:
        if self.max_bytes is None:
            return False
        length = dict(scope.get("headers") or ()).get(b"content-length", b"")
        return length.isdigit() and int(length) > self.max_bytes

    def _too_long(self) -> str:
        return f"request body exceeds {self.max_bytes} bytes (serve --max-request-bytes)"

    @staticmethod
    async def _refuse(scope, receive, send, status: int, message: str) -> None:
        error = ApiError(status, message, "invalid_request_error")
        response = JSONResponse(error.body(), status_code=status, headers={"connection": "close"})
        await response(scope, receive, send)


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


class BackgroundServer:
    """uvicorn in a daemon thread on a free port (tests, benchmarks). Use as a context
    manager; `url` is the base URL."""

    def __init__(
        self,
        app: FastAPI,
        host: str = "127.0.0.1",
        timeout_keep_alive: float = 600,
        wait_ready: bool = True,
    ) -> None:
        # wait_ready: enter once the server's warm-up request has run (`OpenAIServer.ready`),
        # so that a test's first request or injected fault never meets the warm-up.
        self._wait_ready = wait_ready
        self._app = app
        # Bind here, before the thread starts, so the port is known and cannot be taken.
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, 0))
        self.url = f"http://{host}:{self._socket.getsockname()[1]}"
        # uvicorn closes an idle connection after 5 s by default. A client that reuses it just as
        # it closes gets a reset, never a response (CI saw it when a test's offline reference
        # compiled for about 5 s between two requests), so tests keep connections far longer.
        config = uvicorn.Config(
            app,
            http=TimedH11Protocol,
            log_level="warning",
            timeout_graceful_shutdown=5,
            timeout_keep_alive=timeout_keep_alive,
        )
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
        server = getattr(self._app.state, "server", None)
        deadline = time.monotonic() + 600  # the warm-up compiles on a busy machine
        while self._wait_ready and server is not None and not server.ready:
            if not server.engine.alive or time.monotonic() > deadline:
                break  # the tests of a stopped engine see it through /health
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        server = getattr(self._app.state, "server", None)
        if server is not None:  # as `serve`'s signal handler does (DrainingServer)
            server.begin_drain()
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()
