"""One server over several processes (issue 14): requests reach process 0 (the leader) only,
so every iteration of its engine loop broadcasts what that iteration does, and every other
process (a follower) does the same to its own `LLM`, in the same order.

A message is the list of an iteration's commands, as JSON:
`["add", request_id, prompt token ids, SamplingParams fields]`, `["abort", request_id]`,
`["step"]` (run one engine step), `["stop", error or null]` (the last message).

What is broadcast and what is derived: the requests (and when each arrives, is aborted, and
whether an iteration steps) exist only on the leader, so they are broadcast; everything a
step computes from them (the schedule, the batch, seeds drawn for requests without one, stop
strings) is derived on every process by the same deterministic engine, as in `generate`
(`kimi_linear_jax/parallel/distributed.py`). Rejected adds are broadcast too: every process
sees the same calls.

On the wire each message costs one broadcast of `HEADER_BYTES` (a 4-byte length and the first
bytes of the JSON); a longer message sends its rest in a second broadcast padded to a power of
two, so the compiled broadcast shapes stay few. An idle leader still broadcasts an empty
message every `IDLE_INTERVAL_S`: followers then wait at most that long in one collective, and
a stop reaches them promptly. A process that dies is the coordination service's to notice
(the heartbeat): the others then end with its error instead of waiting forever.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import numpy as np
from jax.experimental import multihost_utils

from serving.core.sampling import SamplingParams
from serving.engine import LLM

HEADER_BYTES = 4096
LENGTH_BYTES = 4
# How often an idle (or paused) leader broadcasts an empty message.
IDLE_INTERVAL_S = 0.25
STEP = ["step"]


def add_command(request_id: str, prompt, params: SamplingParams) -> list:
    return ["add", request_id, list(prompt), dataclasses.asdict(params)]


def abort_command(request_id: str) -> list:
    return ["abort", request_id]


def stop_command(error: str | None = None) -> list:
    return ["stop", error]


def encode(commands: list) -> bytes:
    """A message's bytes (an empty message is no bytes)."""
    return json.dumps(commands, separators=(",", ":")).encode() if commands else b""


def decode(payload: bytes) -> list:
    return json.loads(payload) if payload else []


def _bucket(n: int) -> int:
    """A rest of n bytes is sent padded to the next power of two (at least a header's size)."""
    return max(HEADER_BYTES, 1 << (n - 1).bit_length())


class Channel:
    """One process's end of the per-iteration broadcast: the leader `send`s, a follower
    `receive`s. `broadcast` takes a uint8 array (the same shape on every process) and returns
    the leader's (`multihost_utils.broadcast_one_to_all`; tests pass a stand-in)."""

    def __init__(
        self, leader: bool, broadcast: Callable = multihost_utils.broadcast_one_to_all
    ) -> None:
        self.leader = leader
        self._broadcast = broadcast

    def send(self, commands: list) -> None:
        assert self.leader, "only process 0 sends"
        payload = encode(commands)
        if len(payload) >= 2 ** (8 * LENGTH_BYTES):
            raise ValueError(f"a lockstep message of {len(payload)} bytes is too long")
        self._exchange(payload)

    def receive(self) -> list:
        assert not self.leader, "process 0 sends"
        return decode(self._exchange(b""))

    def _exchange(self, payload: bytes) -> bytes:
        """The leader's payload, on every process (a follower passes b"")."""
        framed = len(payload).to_bytes(LENGTH_BYTES, "little") + payload
        header = np.asarray(self._broadcast(_padded(framed[:HEADER_BYTES], HEADER_BYTES)))
        length = int.from_bytes(header[:LENGTH_BYTES].tobytes(), "little")
        framed_length = LENGTH_BYTES + length
        if framed_length <= HEADER_BYTES:
            return header[LENGTH_BYTES:framed_length].tobytes()
        size = _bucket(framed_length - HEADER_BYTES)
        rest = np.asarray(self._broadcast(_padded(framed[HEADER_BYTES:], size)))
        return header[LENGTH_BYTES:].tobytes() + rest[: framed_length - HEADER_BYTES].tobytes()


def _padded(data: bytes, size: int) -> np.ndarray:
    out = np.zeros(size, np.uint8)
    out[: len(data)] = np.frombuffer(data, np.uint8)
    return out


def apply(llm: LLM, command: list) -> None:
    """A follower's side of one command (never "stop": `follow` ends there). A rejected add
    was rejected on the leader too, which answered its client."""
    kind = command[0]
    if kind == "step":
        llm.step()  # outputs are the leader's to send
    elif kind == "add":
        _, request_id, prompt, fields = command
        try:
            llm.add_request(prompt, SamplingParams(**fields), request_id)
        except ValueError:
            pass
    elif kind == "abort":
        llm.abort_request(command[1])
    else:
        raise RuntimeError(f"unknown lockstep command {kind!r}")


def follow(llm: LLM, channel: Channel | None = None) -> None:
    """A follower's loop (what `kimi-linear-jax serve` runs on every process but 0): apply the
    leader's commands until it stops. Returns on a plain stop; raises RuntimeError when the
    leader stopped for an error (or a step raised here: the processes are out of step)."""
    channel = channel or Channel(leader=False)
    while True:
        for command in channel.receive():
            if command[0] == "stop":
                if command[1] is not None:
                    raise RuntimeError(f"process 0 stopped the engine: {command[1]}")
                return
            apply(llm, command)
