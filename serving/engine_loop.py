"""The one thread that owns the `LLM` for the server.

The engine is not thread-safe, so HTTP handlers never touch it: they put add / abort commands
on a thread-safe queue that the loop drains before each step, and the loop hands each
request's outputs back to the asyncio side through a per-request `asyncio.Queue`
(`loop.call_soon_threadsafe`).

Across several processes (process 0 serves; `serving/lockstep.py`) each iteration first
broadcasts its commands (the adds and aborts it drained, whether it steps, or the stop) and
the other processes replay them; with one process nothing is broadcast.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading

from kimi_linear_jax.parallel import distributed
from serving import lockstep
from serving.core.sampling import SamplingParams
from serving.engine import LLM

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
    """The one thread that owns the `LLM`: drains commands, steps, routes outputs.

    `channel`: the lockstep broadcast to the other processes (`serving/lockstep.py`); by
    default one when several processes run (this must then be process 0), else none."""

    def __init__(self, llm: LLM, channel: lockstep.Channel | None = None) -> None:
        if channel is None and distributed.multi_process():
            if not distributed.is_leader():
                raise ValueError(
                    "the server runs on process 0; the other processes run serving.lockstep.follow"
                )
            channel = lockstep.Channel(leader=True)
        self.llm = llm
        self.snapshot = llm.metrics()  # read by /metrics; replaced (not mutated) by the loop
        self._channel = channel
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, Stream] = {}
        self._stop = threading.Event()
        self._resumed = threading.Event()
        self._resumed.set()
        run = self._run if channel is None else self._run_lockstep
        self._thread = threading.Thread(target=run, name="engine-loop", daemon=True)
        self.broken: str | None = None  # set when a step raised out of the engine itself

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop stepping; requests still running end with an error (bounded shutdown)."""
        self._stop.set()
        self._resumed.set()
        self._thread.join(timeout=30)
        self._fail_all("server shutting down")

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
            idle = not self.llm.has_unfinished_requests()
            for command in self._take(0.05 if idle else 0):
                self._apply(command)
            if self.llm.has_unfinished_requests():
                self._step()
            self.snapshot = self.llm.metrics()

    def _run_lockstep(self) -> None:
        """`_run` across processes: each iteration applies what it drained, broadcasts that
        and whether it steps (even an empty message: the followers wait in the broadcast),
        then steps. A fault ends every process (they could no longer stay in step): the
        followers get a stop with the error."""
        error = None
        try:
            while error is None and not self._stop.is_set():
                error = self._lockstep_iteration()
            self._send([lockstep.stop_command(error)])
        except _Lost:
            return

    def _lockstep_iteration(self) -> str | None:
        """One iteration; the error that stops every process, if any."""
        try:
            commands, step = [], False
            if self._resumed.wait(timeout=lockstep.IDLE_INTERVAL_S):
                idle = not self.llm.has_unfinished_requests()
                commands = self._take(lockstep.IDLE_INTERVAL_S if idle else 0)
                for command in commands:
                    self._apply(command)
                step = self.llm.has_unfinished_requests()
            message = [_wire(c) for c in commands] + ([lockstep.STEP] if step else [])
        except Exception as e:  # noqa: BLE001 - a bug here must stop the followers, not hang them
            log.exception("engine loop failed")
            self.broken = f"{type(e).__name__}: {e}"
            self._fail_all(f"engine loop failed: {self.broken}")
            return self.broken
        self._send(message)
        if step:
            self._step()
            if self.broken is not None:
                return self.broken
        self.snapshot = self.llm.metrics()
        return None

    def _send(self, message: list) -> None:
        """Broadcast to the followers; raise _Lost (every request failed) if that fails."""
        try:
            self._channel.send(message)
        except Exception as e:  # a collective failed: no engine left to serve with
            log.exception("lockstep broadcast failed")
            self.broken = f"lost the other processes: {type(e).__name__}: {e}"
            self._fail_all(f"engine stopped: {self.broken}")
            raise _Lost from e

    def _take(self, timeout: float) -> list[tuple]:
        """The queued commands, after waiting up to `timeout` for the first."""
        commands = []
        try:
            first = self._commands.get(timeout=timeout) if timeout else self._commands.get_nowait()
            commands.append(first)
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            return commands

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
            self._fail_all(f"engine step failed: {e}")
            return
        self.broken = None
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted by its client
            stream.push(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail_all(self, message: str) -> None:
        for rid, stream in self._streams.items():
            stream.push(RuntimeError(message))
            self.llm.abort_request(rid)
        self._streams.clear()


class _Lost(Exception):
    """The broadcast to the other processes failed."""


def _wire(command: tuple) -> list:
    """A queued command as the followers get it (the stream stays here)."""
    if command[0] == "abort":
        return lockstep.abort_command(command[1])
    _, rid, prompt, params, _ = command
    return lockstep.add_command(rid, prompt, params)
