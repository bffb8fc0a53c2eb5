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

from serving.protocol import ApiError


class BodyTimeout:
    """ASGI middleware: a request body must arrive within `timeout` seconds, or the client
    gets a 408 and the connection is closed (a slow client that never finishes its body
    would otherwise hold a connection forever). The body is read here and replayed."""

    def __init__(self, app, timeout: float) -> None:
        self.app, self.timeout = app, timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        messages = []
        try:
            async with asyncio.timeout(self.timeout):
                while True:
                    message = await receive()
                    messages.append(message)
                    if message["type"] != "http.request" or not message.get("more_body"):
                        break
        except TimeoutError:
            error = ApiError(
                408, f"request body not received within {self.timeout:g} s", "invalid_request_error"
            )
            response = JSONResponse(error.body(), status_code=408, headers={"connection": "close"})
            return await response(scope, receive, send)
        pending = iter(messages)

        async def replay():
            message = next(pending, None)
            return message if message is not None else await receive()

        await self.app(scope, replay, send)


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
        self, app: FastAPI, host: str = "127.0.0.1", timeout_keep_alive: float = 600
    ) -> None:
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
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()
