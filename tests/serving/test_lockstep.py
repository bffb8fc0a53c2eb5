"""The server's lockstep across processes (`serving/lockstep.py`), in one process: messages
survive the framing whatever their length, and a follower `LLM` that replays what the
leader's engine loop broadcast (adds, an abort, a rejected add, steps, idle messages, the
stop) produces the leader's tokens, sampled ones included (seeds drawn by the engine), with
synchronous and async scheduling.
The same over two real processes and HTTP: tests/parallel/test_multiprocess.py.
"""

from __future__ import annotations

import json
import queue
import time

import numpy as np
import pytest

from kimi_linear_jax.presets import preset
from kimi_linear_jax.testing import random_model
from kimi_linear_jax.tokenizer import ByteTokenizer
from serving import lockstep
from serving.core.sampling import SamplingParams
from serving.engine import LLM
from serving.engine_loop import ACCEPTED, EngineLoop

SHAPES = dict(
    num_pages=32,
    page_size=4,
    max_num_seqs=4,
    batch_buckets=(4,),
    token_buckets=(16,),
    max_num_batched_tokens=16,
    chunk_size=16,
)
TIMEOUT_S = 300


class Wire:
    """A broadcast stand-in: the leader's arrays are kept in order; a follower's calls get
    them back (and must ask with the same shapes, as a collective would need)."""

    def __init__(self) -> None:
        self.sent: list[np.ndarray] = []

    def leader(self, array: np.ndarray) -> np.ndarray:
        self.sent.append(array.copy())
        return array

    def follower(self, array: np.ndarray) -> np.ndarray:
        sent = self.sent.pop(0)
        assert sent.shape == array.shape and sent.dtype == array.dtype
        assert not array.any()  # a follower contributes nothing
        return sent


def _roundtrip(message: list) -> tuple[list, list[int]]:
    wire = Wire()
    lockstep.Channel(True, wire.leader).send(message)
    sizes = [a.size for a in wire.sent]
    got = lockstep.Channel(False, wire.follower).receive()
    assert not wire.sent
    return got, sizes


def _message(kind: str) -> list:
    """Messages around the header's capacity (a 4-byte length + 4092 bytes of JSON)."""
    if kind == "empty":
        return []
    if kind == "long prompt":
        return [lockstep.add_command("r", list(range(20_000)), SamplingParams()), lockstep.STEP]
    size = {"fills the header": 4092, "one byte over": 4093}.get(kind, 20)
    pad = size - len(lockstep.encode([lockstep.abort_command("é")]))
    return [lockstep.abort_command("é" + "x" * pad)]


@pytest.mark.parametrize(
    "kind", ["empty", "small", "fills the header", "one byte over", "long prompt"]
)
def test_a_message_survives_the_framing(kind):
    """Up to a header's worth in one broadcast; longer, a second one padded to a power of two."""
    message = json.loads(json.dumps(_message(kind)))  # tuples arrive as lists
    got, sizes = _roundtrip(message)
    assert got == message
    framed = 4 + len(lockstep.encode(message))
    if kind == "fills the header":
        assert framed == lockstep.HEADER_BYTES
    if framed <= lockstep.HEADER_BYTES:
        assert sizes == [lockstep.HEADER_BYTES]
    else:
        rest = framed - lockstep.HEADER_BYTES
        assert sizes[0] == lockstep.HEADER_BYTES and len(sizes) == 2
        assert sizes[1] >= rest and sizes[1] & (sizes[1] - 1) == 0


def test_sampling_params_cross_unchanged():
    params = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=5, seed=2**64 - 1, stop=("\ud800x", "é"),
        stop_token_ids=(3, 4), logprobs=2, ignore_eos=True, max_tokens=7,
    )  # fmt: skip
    ((_, _, _, fields),), _ = _roundtrip([lockstep.add_command("r", [1, 2], params)])
    assert SamplingParams(**fields) == params


class _Stream:
    def __init__(self) -> None:
        self.items: queue.Queue = queue.Queue()

    def push(self, item) -> None:
        self.items.put(item)

    def final(self):
        """The last output (or the error), waiting for the request to end."""
        while True:
            item = self.items.get(timeout=TIMEOUT_S)
            if isinstance(item, Exception) or (item is not ACCEPTED and item.finished):
                return item


@pytest.fixture(scope="module")
def model():
    return random_model(preset("tiny"))


@pytest.fixture(scope="module", params=["sync", "async"])
def engines(model, request):
    """(leader's, follower's) engines; async scheduling keeps a step in flight between calls."""
    tokenizer = ByteTokenizer(model.config.vocab_size)
    options = dict(SHAPES, async_scheduling=request.param == "async")
    return [LLM(model, tokenizer=tokenizer, **options) for _ in range(2)]


def test_a_follower_replays_the_leaders_engine_loop(engines):
    leader_llm, follower_llm = engines
    wire = Wire()
    loop = EngineLoop(leader_llm, channel=lockstep.Channel(True, wire.leader))
    loop.start()
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)  # engine's seed
    streams = {rid: _Stream() for rid in ("a", "b", "c", "bad", "long")}
    loop.add("a", [5, 6, 7, 8, 9], greedy, streams["a"])
    loop.add("bad", [10**6], greedy, streams["bad"])  # outside the vocabulary: rejected
    loop.add("long", [1, 2, 3], SamplingParams(max_tokens=100, ignore_eos=True), streams["long"])
    time.sleep(2 * lockstep.IDLE_INTERVAL_S)
    loop.add("b", [40, 41, 42, 43, 44, 45, 46], sampled, streams["b"])
    loop.add("c", [9, 8], greedy, streams["c"])
    finals = {rid: streams[rid].final() for rid in ("a", "b", "c", "bad")}
    loop.abort("long")
    time.sleep(2 * lockstep.IDLE_INTERVAL_S)  # idle: empty messages
    loop.stop()
    assert not loop.alive
    assert isinstance(finals.pop("bad"), ValueError)

    replayed = {}
    step = follower_llm.step

    def recording_step():
        outputs = step()
        replayed.update({o.request_id: o for o in outputs})
        return outputs

    follower_llm.step = recording_step
    try:
        lockstep.follow(follower_llm, lockstep.Channel(False, wire.follower))
    finally:
        del follower_llm.step
    assert not wire.sent  # the stop was the last message
    assert {rid: replayed[rid].token_ids for rid in finals} == {
        rid: out.token_ids for rid, out in finals.items()
    }
    assert not replayed["long"].finished  # aborted while running, here as there
    assert not follower_llm.has_unfinished_requests()


def test_follow_ends_with_the_leaders_error(engines):
    wire = Wire()
    lockstep.Channel(True, wire.leader).send([lockstep.stop_command("engine step failed: x")])
    with pytest.raises(RuntimeError, match="process 0 stopped the engine: engine step failed"):
        lockstep.follow(engines[1], lockstep.Channel(False, wire.follower))
