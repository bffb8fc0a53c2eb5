"""The one thread that owns the `LLM` for the server.

The engine is not thread-safe, so HTTP handlers never touch it: they put add / abort commands
on a thread-safe queue that the loop drains before each step, and the loop hands each
request's outputs back to the asyncio side through a per-request `asyncio.Queue`
(`loop.call_soon_threadsafe`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading

from serving.engine import LLM
from serving.sampling import SamplingParams

log = logging.getLogger("kimi_linear_jax.server")


# ---- the engine thread -------------------------------------------------------------------------

ACCEPTED = object()  # pushed once the engine queued a request


class Stream:
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
        self._streams: dict[str, Stream] = {}
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
