"""Property tests of hostile or careless input (issue 12): random JSON bodies against a live
server on loopback, and random prompt / parameter mixes through the offline API.

Properties: the server never answers 5xx to client input and ends with nothing running, no
slot held and nothing in flight; in one `generate`, each bad item fails alone and the good
ones equal a run without the bad ones, and the pools drain.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.core.sampling import SamplingParams
from serving.engine import LLM
from serving.server import BackgroundServer, build_app
from tests.serving.test_server import SHAPES, TIMEOUT, metric

SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
)
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(-5, 400), max_size=4),
    st.lists(st.text(max_size=3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
SMALL_TOKENS = st.integers(1, 3)


def _field(valid):
    return st.one_of(valid, JUNK)


MESSAGE = st.fixed_dictionaries(
    {"role": _field(st.sampled_from(["user", "system", "assistant"])), "content": JUNK}
)
COMMON = {
    "max_tokens": _field(SMALL_TOKENS),
    "temperature": _field(st.floats(0, 2)),
    "top_p": _field(st.floats(0.1, 1)),
    "top_k": _field(st.integers(-1, 50)),
    "min_p": _field(st.floats(0, 1)),
    "repetition_penalty": _field(st.floats(0.5, 2)),
    "presence_penalty": _field(st.floats(-2, 2)),
    "seed": _field(st.integers(0, 2**32)),
    "stop": _field(st.lists(st.text(min_size=1, max_size=2), max_size=2)),
    "stop_token_ids": _field(st.lists(st.integers(0, 319), max_size=2)),
    "ignore_eos": JUNK,
    "logprobs": JUNK,
    "stream": st.booleans(),
}
COMPLETION = st.fixed_dictionaries(
    {"prompt": _field(st.text(min_size=1, max_size=10))}, optional=COMMON
)
CHAT = st.fixed_dictionaries({"messages": st.lists(MESSAGE, max_size=2)}, optional=COMMON)


@pytest.fixture(scope="module")
def fuzz_server():
    from kimi_linear_jax.presets import preset
    from kimi_linear_jax.testing import random_model
    from kimi_linear_jax.tokenizer import ByteTokenizer

    model = random_model(preset("tiny"))
    llm = LLM(model, tokenizer=ByteTokenizer(model.config.vocab_size), **SHAPES)
    with BackgroundServer(build_app(llm, model_name="fuzz", request_timeout=60)) as server:
        yield server.url


def _post(url, path, body):
    # allow_nan: the JSON may carry NaN / Infinity (Python's json reads them back).
    content = json.dumps(body, allow_nan=True)
    headers = {"content-type": "application/json"}
    if body.get("stream") is True and isinstance(body, dict):
        with httpx.stream(
            "POST", url + path, content=content, headers=headers, timeout=TIMEOUT
        ) as r:
            r.read()
            return r.status_code
    return httpx.post(url + path, content=content, headers=headers, timeout=TIMEOUT).status_code


@SETTINGS
@given(
    body=st.one_of(
        COMPLETION.map(lambda b: ("/v1/completions", b)),
        CHAT.map(lambda b: ("/v1/chat/completions", b)),
    )
)
def test_random_bodies_never_get_a_5xx(fuzz_server, body):
    path, payload = body
    status = _post(fuzz_server, path, payload)
    assert status < 500, (path, payload, status)


def test_after_the_fuzz_nothing_is_held(fuzz_server):
    """Runs after the property above (file order): every request has ended."""
    for name in (
        "kimi_linear_engine_running",
        "kimi_linear_engine_slots_used",
        "kimi_linear_server_in_flight",
    ):
        assert metric(fuzz_server, name) == 0, name


# ---- the offline API ---------------------------------------------------------------------------

GOOD = st.tuples(
    st.lists(st.integers(1, 300), min_size=1, max_size=6),
    st.builds(SamplingParams, temperature=st.just(0.0), max_tokens=SMALL_TOKENS),
)
BAD = st.tuples(
    st.one_of(
        st.lists(st.integers(1, 300), min_size=1, max_size=3),
        st.just([]),
        st.lists(st.floats(allow_nan=True), min_size=1, max_size=2),
        st.lists(st.text(max_size=2), min_size=1, max_size=2),
        st.lists(st.booleans(), min_size=1, max_size=2),
        st.integers(),
    ),
    st.one_of(
        st.builds(SamplingParams, temperature=JUNK.filter(lambda v: not _ok_float(v, 0))),
        st.builds(SamplingParams, max_tokens=JUNK.filter(lambda v: not _ok_int(v, 1))),
        st.builds(SamplingParams, stop=st.just(("",))),
        st.builds(SamplingParams, top_p=st.floats(1.01, 5)),
        st.builds(SamplingParams, stop_token_ids=st.lists(st.integers(320, 999), min_size=1)),
    ),
)


def _ok_float(v, low):
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= low


def _ok_int(v, low):
    # >= 300 is bad too: past max_model_len (252) with any prompt.
    return isinstance(v, int) and not isinstance(v, bool) and v >= low and v < 300


@pytest.fixture(scope="module")
def offline_llm():
    from kimi_linear_jax.presets import preset
    from kimi_linear_jax.testing import random_model

    return LLM(random_model(preset("tiny")), **SHAPES)


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(items=st.lists(st.tuples(st.booleans(), GOOD, BAD), min_size=1, max_size=5))
def test_bad_items_fail_alone_in_one_generate(offline_llm, items):
    llm = offline_llm
    mixed = [good if is_good else bad for is_good, good, bad in items]
    outs = llm.generate([p for p, _ in mixed], [s for _, s in mixed], use_tqdm=False)
    goods = [(p, s) for (is_good, _, _), (p, s) in zip(items, mixed) if is_good]
    alone = llm.generate([p for p, _ in goods], [s for _, s in goods], use_tqdm=False)
    good_outs = [o for (is_good, _, _), o in zip(items, outs) if is_good]
    assert [o.token_ids for o in good_outs] == [o.token_ids for o in alone]
    for (is_good, _, _), out in zip(items, outs):
        if not is_good:
            assert out.finish_reason == "error" and out.error, out
    assert (
        llm.cache.allocator.num_free + llm.cache.allocator.num_tree_pages
        == llm.cache.allocator.capacity
    )
    assert llm.cache.state_pool.num_free == llm.cache.state_pool.num_slots - 1
    assert not llm.has_unfinished_requests()
