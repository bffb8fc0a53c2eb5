"""The OpenAI-compatible server, live on 127.0.0.1, over a tiny random model with the byte
tokenizer (text prompts work; the text is noise).

One module-scoped server; the offline reference `LLM` uses the same shapes, so the jitted steps
compile once for both. Expected outputs are the offline greedy ones for the same prompt.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import threading
import time

import httpx
import openai
import pytest

from kimi_linear_jax.presets import preset
from kimi_linear_jax.testing import random_model
from kimi_linear_jax.tokenizer import ByteTokenizer
from serving.core.sampling import SamplingParams
from serving.engine import LLM
from serving.server import BackgroundServer, build_app

NAME = "tiny-test"
# 63 usable pages of 4 tokens: max_model_len 252. One batch bucket of 8 (the load test runs 8
# at a time) and one token bucket, shared by the server's engine and the offline reference.
SHAPES = dict(
    num_pages=64,
    page_size=4,
    max_num_seqs=8,
    batch_buckets=(8,),
    token_buckets=(64,),
    max_num_batched_tokens=64,
    chunk_size=64,
)
MAX_TOKENS = 5
# httpx waits 5 s by default; a first request may wait for a compile on a busy machine.
TIMEOUT = 300
MESSAGES = [{"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def setup():
    model = random_model(preset("tiny"))
    tokenizer = ByteTokenizer(model.config.vocab_size)
    offline = LLM(model, tokenizer=tokenizer, **SHAPES)
    app = build_app(
        LLM(model, tokenizer=tokenizer, **SHAPES),
        model_name=NAME,
        max_queue=64,
        request_timeout=120,
    )
    with BackgroundServer(app) as server:
        yield server, app.state.server, offline


@pytest.fixture(scope="module")
def url(setup):
    return setup[0].url


@pytest.fixture(scope="module")
def server(setup):
    return setup[1]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


_references: dict = {}


@pytest.fixture(scope="module")
def offline(setup):
    """reference(prompt or messages, max_tokens) -> the offline greedy RequestOutput."""

    def reference(prompt, max_tokens=MAX_TOKENS):
        key = (json.dumps(prompt), max_tokens)
        if key not in _references:
            params = SamplingParams(temperature=0, max_tokens=max_tokens)
            run = setup[2].chat if isinstance(prompt, list) else setup[2].generate
            (_references[key],) = run(prompt, params, use_tqdm=False)
        return _references[key]

    return reference


def metric(url, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def wait_drained(url, timeout=60.0) -> None:
    deadline = time.monotonic() + timeout
    while metric(url, "kimi_linear_engine_slots_used") or metric(
        url, "kimi_linear_engine_pages_used"
    ):
        assert time.monotonic() < deadline, "the engine kept a slot or pages"
        time.sleep(0.05)


def test_models_and_health(url, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME  # GET /v1/models/{id}
    r = httpx.get(f"{url}/v1/models/other", timeout=TIMEOUT)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{url}/health", timeout=TIMEOUT).json() == {"status": "ok"}


def test_completion_equals_offline(client, offline):
    ref = offline("The quick brown fox")
    got = client.completions.create(
        model=NAME, prompt="The quick brown fox", max_tokens=MAX_TOKENS, temperature=0
    )
    assert got.choices[0].text == ref.text
    assert got.choices[0].finish_reason == ref.finish_reason
    assert got.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert got.usage.completion_tokens == len(ref.token_ids)
    assert got.usage.total_tokens == len(ref.prompt_token_ids) + len(ref.token_ids)


def test_chat_completion_equals_offline(client, offline):
    ref = offline(MESSAGES)
    got = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0
    )
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == ref.text
    assert got.usage.completion_tokens == len(ref.token_ids)


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_equals_offline(client, offline, chat):
    prompt = MESSAGES if chat else "Hello"
    ref = offline(prompt)
    common = dict(model=NAME, max_tokens=MAX_TOKENS, temperature=0, stream=True)
    common["stream_options"] = {"include_usage": True}
    if chat:
        stream = client.chat.completions.create(messages=prompt, **common)
    else:
        stream = client.completions.create(prompt=prompt, **common)
    pieces, usage, reasons = [], None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append((choice.delta.content if chat else choice.text) or "")
            reasons.append(choice.finish_reason)
    assert "".join(pieces) == ref.text
    assert usage.completion_tokens == len(ref.token_ids)
    assert reasons[-1] == ref.finish_reason and not any(reasons[:-1])


BAD = [
    ("completions", "{not json", 400, "malformed JSON"),
    ("completions", {"prompt": "x", "temperature": -1}, 400, "temperature must be >= 0"),
    ("completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"prompt": "x", "max_tokens": -5}, 400, "max_tokens must be > 0"),
    ("completions", {"prompt": "x", "max_tokens": 10**9}, 400, "exceeds max_model_len 252"),
    ("completions", {"prompt": "x" * 300, "max_tokens": 4}, 400, "exceeds max_model_len 252"),
    ("completions", {"prompt": [1, 2, 999]}, 400, "token id 999 is outside the vocabulary"),
    ("completions", {"max_tokens": 4}, 400, "prompt"),
    ("completions", {"prompt": "x", "model": "gpt-9"}, 404, "'gpt-9' does not exist"),
    ("chat/completions", {"messages": []}, 400, "messages must be a non-empty list"),
    ("chat/completions", {"messages": [{"role": "x", "content": "y"}]}, 400, "role"),
    ("chat/completions", {"messages": MESSAGES, "top_p": 0}, 400, "top_p must be in"),
    # Issue 12: input that used to be a 500 or silently coerced.
    ("completions", '{"prompt": "\\ud800abc"}', 400, "prompt is not valid text"),  # lone surrogate
    # Issue 36: chat too, and the same message from every tokenizer kind.
    (
        "chat/completions",
        '{"messages": [{"role": "user", "content": "ab\\ud800"}]}',
        400,
        "a lone surrogate U+D800 at character 2",
    ),
    ("chat/completions", {"messages": [{"role": ["user"], "content": "y"}]}, 400, "role"),
    ("chat/completions", {"messages": [{"role": {"a": 1}, "content": "y"}]}, 400, "role"),
    ("chat/completions", {"messages": MESSAGES, "max_completion_tokens": 0}, 400, "max_tokens"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 123}]}]},
        400,
        "content",
    ),
    ("completions", {"prompt": "x", "stop": ""}, 400, "empty stop string"),
    ("completions", {"prompt": "x", "stop": ["a", ""]}, 400, "empty stop string"),
    ("completions", '{"prompt": "x", "temperature": Infinity}', 400, "temperature must be a fin"),
    ("completions", '{"prompt": "x", "repetition_penalty": NaN}', 400, "repetition_penalty"),
    ("completions", {"prompt": [1.5, 2.7]}, 400, "prompt"),
    ("completions", {"prompt": [True, 2]}, 400, "prompt"),
    ("completions", {"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
    # Issue 36: fields that used to be accepted and silently ignored.
    ("completions", {"prompt": "x", "logit_bias": {"5x": 10}}, 400, "key '5x' is not a token"),
    ("completions", {"prompt": "x", "logit_bias": {"9999999": 1}}, 400, "outside the vocab"),
    ("chat/completions", {"messages": MESSAGES, "logit_bias": {"5": 101}}, 400, "in [-100, 1"),
    ("completions", {"prompt": "x", "logit_bias": {"5": "1"}}, 400, "logit_bias must map"),
    ("completions", {"prompt": "x", "logit_bias": [5]}, 400, "logit_bias"),
    (
        "chat/completions",
        {"messages": MESSAGES, "response_format": {"type": "json_object"}},
        400,
        "response_format is not supported",
    ),
    (
        "chat/completions",
        {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "tools is not supported",
    ),
    ("chat/completions", {"messages": MESSAGES, "tool_choice": "auto"}, 400, "tool_choice"),
    ("completions", {"prompt": "x", "best_of": 2}, 400, "best_of is not supported"),
    ("completions", {"prompt": "x", "suffix": "end"}, 400, "suffix is not supported"),
    ("completions", {"prompt": "x", "max_completion_tokens": 0}, 400, "max_tokens must be > 0"),
]


@pytest.mark.parametrize(("path", "body", "status", "match"), BAD)
def test_bad_request_gets_openai_error(url, path, body, status, match):
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    r = httpx.post(
        f"{url}/v1/{path}", headers={"content-type": "application/json"}, timeout=TIMEOUT, **kwargs
    )
    assert r.status_code == status
    error = r.json()["error"]
    assert match in error["message"], error
    assert set(error) == {"message", "type", "param", "code"}


def test_out_of_vocabulary_prompt_names_the_prompt(url):
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2, 999]}, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_server_keeps_serving_after_bad_requests(client, offline, url):
    for path, body, *_ in BAD:  # all of them again, back to back
        kwargs = {"content": body} if isinstance(body, str) else {"json": body}
        httpx.post(
            f"{url}/v1/{path}",
            headers={"content-type": "application/json"},
            timeout=TIMEOUT,
            **kwargs,
        )
    got = client.completions.create(
        model=NAME, prompt="Hello", max_tokens=MAX_TOKENS, temperature=0
    )
    assert got.choices[0].text == offline("Hello").text
    assert metric(url, 'kimi_linear_requests_total{status="400"}') >= len(BAD) - 1
    wait_drained(url)


def test_disconnect_mid_stream_frees_the_request(url):
    aborted = metric(url, "kimi_linear_engine_aborted_total")
    body = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # one chunk, then hang up
    wait_drained(url)
    assert metric(url, "kimi_linear_engine_aborted_total") == aborted + 1


def test_non_streaming_client_gone_aborts_its_request(fresh):
    """Issue 12, defect 1: a non-streaming client that gives up is noticed while its handler
    waits, and its running request is aborted (not run for 200 tokens or until the timeout)."""
    url, server, llm = fresh
    real_step = llm.step

    def slow_step():  # 200 steps take 4 s or more: the client leaves mid-request
        time.sleep(0.02)
        return real_step()

    llm.step = slow_step
    body = {"messages": MESSAGES, "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=1)
    deadline = time.monotonic() + 3  # well before the 200 tokens could have run
    while metric(url, "kimi_linear_engine_aborted_total") < 1:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.05)
    # Its slot is back (pages past 64 tokens may stay in the prefix cache, as they should).
    assert metric(url, "kimi_linear_engine_running") == 0
    assert metric(url, "kimi_linear_engine_generation_tokens_total") < 200
    assert metric(url, "kimi_linear_server_in_flight") == 0


def test_queue_full_is_503_and_timeout_is_504(url, server):
    """The engine loop is held (paused) so the queue fills and a deadline passes for sure."""
    body = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
    server.engine.pause()
    try:
        server.max_queue = 0  # room for max_num_seqs = 8 requests
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            held = [pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=TIMEOUT)]
            held += [
                pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=TIMEOUT)
                for _ in range(7)
            ]
            while server.in_flight < 8:
                time.sleep(0.02)
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)
            assert r.status_code == 503 and "queue is full" in r.json()["error"]["message"]
            server.max_queue = 64
            server.request_timeout = 0.2
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)
            assert r.status_code == 504 and "timed out" in r.json()["error"]["message"]
            server.request_timeout = 120
            server.engine.resume()
            assert [f.result().status_code for f in held] == [200] * 8
    finally:
        server.max_queue, server.request_timeout = 64, 120
        server.engine.resume()
    wait_drained(url)


def test_load_32_streaming_clients(url, offline):
    prompts = ["Hello", "The quick brown fox", "abc", "Kimi Linear"]
    refs = {p: offline(p, 4).text for p in prompts}
    aclient = openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT
    )

    async def one(prompt):
        stream = await aclient.completions.create(
            model=NAME, prompt=prompt, max_tokens=4, temperature=0, stream=True
        )
        return prompt, "".join([c.choices[0].text async for c in stream if c.choices])

    async def user(i):
        return [await one(prompts[(i + k) % len(prompts)]) for k in range(2)]

    async def everyone():
        async with aclient:
            return await asyncio.gather(*(user(i) for i in range(32)))

    results = [r for rs in asyncio.run(everyone()) for r in rs]
    assert len(results) == 64
    assert all(text == refs[prompt] for prompt, text in results)
    wait_drained(url)


def _sse_chunks(url, path, body):
    chunks = []
    with httpx.stream("POST", f"{url}/v1/{path}", json=body, timeout=TIMEOUT) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_logprobs_equal_non_streamed(url, chat):
    """Issue 12, defect 5: chunks held back for a partial UTF-8 character (the byte model's
    text is full of them) must not lose their tokens' logprobs."""
    body = dict(max_tokens=30, temperature=0, ignore_eos=True)
    if chat:
        path, body = "chat/completions", {**body, "messages": MESSAGES, "logprobs": True}
        body["top_logprobs"] = 1
    else:
        path, body = "completions", {**body, "prompt": "Hello", "logprobs": 1}
    full = httpx.post(f"{url}/v1/{path}", json=body, timeout=TIMEOUT).json()["choices"][0]
    streamed = [c["choices"][0] for c in _sse_chunks(url, path, {**body, "stream": True})]
    parts = [c["logprobs"] for c in streamed if c.get("logprobs")]
    if chat:
        got = [e for p in parts for e in p["content"]]
        assert got == full["logprobs"]["content"] and len(got) == 30
        text = "".join(c["delta"].get("content") or "" for c in streamed)
        assert text == full["message"]["content"]
    else:
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            got = [e for p in parts for e in p[key]]
            assert got == full["logprobs"][key] and len(got) == 30, key
        assert "".join(c["text"] for c in streamed) == full["text"]


def test_completion_top_logprobs_keep_one_entry_per_token(url):
    """Issue 12: byte tokens that decode to U+FFFD alone must not collide as keys."""
    body = dict(prompt="Hello", max_tokens=8, temperature=0, logprobs=5, ignore_eos=True)
    got = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT).json()
    tops = got["choices"][0]["logprobs"]["top_logprobs"]
    assert all(len(top) == 5 for top in tops), tops


# ---- faults and shutdown (issue 12, defects 2 and 10) ---------------------------------------


def _engine_like(offline):
    """A new engine of the reference's model and shapes (the compiled steps are shared): a
    server's engine thread must own its `LLM` alone."""
    return LLM(offline.model, tokenizer=offline.tokenizer, **SHAPES)


@pytest.fixture
def fresh(setup):
    """A second server over a new engine of the same shapes."""
    llm = _engine_like(setup[2])
    app = build_app(llm, model_name=NAME, max_queue=64, request_timeout=120)
    with BackgroundServer(app) as server:
        yield server.url, app.state.server, llm


def test_a_step_fault_is_a_500_and_the_server_goes_on(fresh, offline):
    url, server, llm = fresh
    real, calls = llm.runner.run, []

    def fault_once(*args):
        if not calls:
            calls.append(1)
            raise RuntimeError("injected fault")
        return real(*args)

    llm.runner.run = fault_once
    body = {"prompt": "Hello", "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
    health = httpx.get(f"{url}/health", timeout=TIMEOUT)
    assert health.status_code == 200 and "injected fault" in health.json()["last_error"]
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == offline("Hello").text
    wait_drained(url)


def test_a_fault_inside_a_stream_is_an_error_event(fresh):
    url, server, llm = fresh
    real, calls = llm.runner.run, []

    def fault_second(*args):  # the prefill runs, the first decode step faults
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected fault")
        return real(*args)

    llm.runner.run = fault_second
    body = {"prompt": "Hello", "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    chunks = _sse_chunks(url, "completions", body)
    assert "error" in chunks[-1] and "injected fault" in chunks[-1]["error"]["message"]
    wait_drained(url)


def test_an_engine_that_cannot_step_is_unhealthy(fresh):
    url, server, llm = fresh

    def broken():
        raise RuntimeError("device lost")

    llm.step = broken
    body = {"prompt": "Hello", "max_tokens": MAX_TOKENS}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 500
    health = httpx.get(f"{url}/health", timeout=TIMEOUT)
    assert health.status_code == 503 and "device lost" in health.json()["error"]


def test_shutdown_is_bounded_with_a_request_in_flight(setup):
    """Issue 12, defect 10: stopping the server does not wait for a request that cannot end."""
    llm = _engine_like(setup[2])
    app = build_app(llm, model_name=NAME, max_queue=64, request_timeout=600)
    body = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        server = BackgroundServer(app).__enter__()
        app.state.server.engine.pause()  # the request never finishes by itself
        pending = pool.submit(httpx.post, f"{server.url}/v1/completions", json=body, timeout=60)
        time.sleep(0.5)
        t0 = time.monotonic()
        server.__exit__(None, None, None)
        assert time.monotonic() - t0 < 15
        # Issue 36: drained, the request gets OpenAI's error body (not a plain-text 500).
        r = pending.result(timeout=30)
        assert r.status_code == 503
        assert r.json()["error"]["message"] == "the server is shutting down"
    assert not app.state.server.engine.alive


def test_a_shutdown_ends_running_streams_with_an_error_event_and_done(setup):
    """Issue 36, defect 6: SIGTERM (here BackgroundServer's exit, as DrainingServer's signal
    handler) gives a stream that cannot finish an error event and [DONE], not a cut."""
    llm = _engine_like(setup[2])
    app = build_app(llm, model_name=NAME, max_queue=64, request_timeout=600)
    body = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
    real_step = llm.step

    def slow_step():  # 200 tokens take 10 s or more: longer than the drain
        time.sleep(0.05)
        return real_step()

    server = BackgroundServer(app).__enter__()
    llm.step = slow_step
    with concurrent.futures.ThreadPoolExecutor(1) as pool:

        def read_all():
            url = f"{server.url}/v1/completions"
            with httpx.stream("POST", url, json=body, timeout=60) as r:
                return list(r.iter_lines())

        lines = pool.submit(read_all)
        time.sleep(1.0)
        server.__exit__(None, None, None)
        events = [line for line in lines.result(timeout=30) if line.startswith("data:")]
    assert len(events) >= 3 and events[-1] == "data: [DONE]"  # tokens, then the ending
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["message"] == "the server is shutting down" and error["type"] == "server_error"


def test_a_stopped_engine_loop_refuses_requests_at_once(fresh):
    """Across processes a fault ends the loop (the processes are out of step): new requests
    get a 503 at once rather than a 504 when nothing ever takes them."""
    url, server, _ = fresh
    server.engine.stop()
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello"}, timeout=TIMEOUT)
    assert r.status_code == 503 and "engine loop has stopped" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 503


def test_serve_bounds_the_graceful_shutdown(monkeypatch, setup):
    """`kimi-linear-jax serve` hands uvicorn a bound: SIGINT / SIGTERM cancel what still runs
    after it (uvicorn's default is to wait for every request, however long)."""
    import serving.launcher as launcher
    from serving.server import DRAIN_S

    seen = {}
    monkeypatch.setattr(launcher.DrainingServer, "run", lambda self: seen.update(c=self))
    launcher.serve(_engine_like(setup[2]), port=0, timeout_keep_alive=75)
    config = seen["c"].config
    assert 0 < config.timeout_graceful_shutdown <= 10
    assert DRAIN_S < config.timeout_graceful_shutdown  # drained, then cancelled
    assert config.timeout_keep_alive == 75


def test_docs_are_off_unless_enabled(url, setup):
    assert httpx.get(f"{url}/docs", timeout=TIMEOUT).status_code == 404
    assert httpx.get(f"{url}/openapi.json", timeout=TIMEOUT).status_code == 404
    app = build_app(_engine_like(setup[2]), model_name=NAME, enable_docs=True)
    with BackgroundServer(app) as server:
        assert httpx.get(f"{server.url}/openapi.json", timeout=TIMEOUT).status_code == 200


def test_a_body_that_never_arrives_times_out(setup):
    """Issue 12: a client that sends part of its body and stalls gets a 408, and the server
    closes the connection instead of holding it forever."""
    import socket

    app = build_app(_engine_like(setup[2]), model_name=NAME, body_timeout=0.5)
    with BackgroundServer(app) as server:
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            sock.sendall((head + "Content-Length: 100\r\n\r\n" + '{"prompt": "hi"').encode())
            t0 = time.monotonic()
            reply = sock.recv(4096).decode()
            assert reply.startswith("HTTP/1.1 408") and time.monotonic() - t0 < 5
            assert "request body not received within 0.5 s" in reply


# ---- what a mutation audit found untested (issue 12) -----------------------------------------


def test_timeout_inside_a_started_stream_is_an_error_event(setup):
    llm = _engine_like(setup[2])
    real_step = llm.step

    def slow_step():
        time.sleep(0.05)
        return real_step()

    llm.step = slow_step
    app = build_app(llm, model_name=NAME, request_timeout=1)
    with BackgroundServer(app) as server:
        body = {"prompt": "Hello", "max_tokens": 100, "ignore_eos": True, "stream": True}
        lines = []
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = [x for x in r.iter_lines() if x.startswith("data: ")]
    # The 200 and its headers went out before the deadline: the 504 must come as an event.
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert error["type"] == "timeout_error" and "timed out after 1 s" in error["message"]


def test_metrics_export_engine_values_and_latency_histograms(url, client):
    client.completions.create(model=NAME, prompt="Hello", max_tokens=MAX_TOKENS, temperature=0)
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    assert metric(url, "kimi_linear_time_to_first_token_seconds_count") >= 1
    assert metric(url, "kimi_linear_inter_token_latency_seconds_count") >= 1
    assert 'kimi_linear_time_to_first_token_seconds_bucket{le="+Inf"}' in text
    for key in ("prefix_cache_hit_tokens", "prefix_cache_hit_rate", "pages_used", "slots_used"):
        assert re.search(rf"^kimi_linear_engine_{key}(_total)? \S+$", text, re.M), key


def test_speculation_metrics_are_exported(setup):
    offline = setup[2]
    spec = {"method": "ngram", "num_draft_tokens": 2}
    llm = LLM(offline.model, tokenizer=offline.tokenizer, speculative=spec, **SHAPES)
    with BackgroundServer(build_app(llm, model_name=NAME)) as server:
        body = {"prompt": "ab ab ab ab", "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=TIMEOUT).is_success
        text = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
    for key in ("spec_draft_tokens", "spec_accepted_tokens", "spec_mean_accepted_length"):
        assert re.search(rf"^kimi_linear_engine_{key}(_total)? \S+$", text, re.M), key


def test_logprobs_through_the_server_equal_the_offline_api(url, setup):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=2)
    (want,) = _engine_like(setup[2]).generate(["Hello"], params, use_tqdm=False)
    body = {"prompt": "Hello", "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 2}
    got = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT).json()
    logprobs = got["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"] == [e[t] for e, t in zip(want.logprobs, want.token_ids)]
    for top, entry in zip(logprobs["top_logprobs"], want.logprobs, strict=True):
        assert sorted(top.values()) == sorted(entry.values())


def test_async_scheduling_server_streams_the_offline_outputs(setup, offline):
    """An engine with async scheduling behind the server: concurrent streams (stop strings
    included) give the offline outputs, a client that hangs up mid-stream is aborted while
    its next step is in flight, and every slot and page comes back."""
    llm = LLM(setup[2].model, tokenizer=setup[2].tokenizer, async_scheduling=True, **SHAPES)
    app = build_app(llm, model_name=NAME, max_queue=64, request_timeout=120)
    prompts = ["Hello", "The quick brown fox", "abc", "Kimi Linear"]
    refs = {p: offline(p, 12) for p in prompts}
    stop = refs["Hello"].text[5]
    with BackgroundServer(app) as server:
        body = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=TIMEOUT) as r:
            next(line for line in r.iter_lines() if line.startswith("data:"))  # then hang up

        def one(prompt, **extra):
            body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True}
            chunks = _sse_chunks(server.url, "completions", {**body, **extra})
            return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(one, prompts))
            stopped = pool.submit(one, "Hello", stop=[stop]).result()
        assert texts == [refs[p].text for p in prompts]
        assert stopped == refs["Hello"].text.split(stop)[0]
        wait_drained(server.url)
        assert metric(server.url, "kimi_linear_engine_aborted_total") == 1
        assert metric(server.url, "kimi_linear_engine_overlapped_steps") > 0


def test_prompt_logprobs_through_the_server_equal_the_offline_api(url, setup):
    """vLLM's extra field on /v1/completions: each choice gets "prompt_logprobs" (null for the
    first token, then token id -> {logprob, decoded_token}); a stream refuses it."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, prompt_logprobs=2)
    (want,) = _engine_like(setup[2]).generate(["Hello"], params, use_tqdm=False)
    body = {"prompt": "Hello", "max_tokens": MAX_TOKENS, "temperature": 0, "prompt_logprobs": 2}
    choice = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT).json()["choices"][0]
    assert choice["text"] == want.text
    got = choice["prompt_logprobs"]
    assert got[0] is None and len(got) == len(want.prompt_logprobs) == len("Hello")
    for entry, ref in zip(got[1:], want.prompt_logprobs[1:], strict=True):
        assert {int(t): v["logprob"] for t, v in entry.items()} == pytest.approx(ref, abs=1e-6)
        assert all(v["decoded_token"] == chr(int(t)) for t, v in entry.items() if int(t) < 128)
    plain = httpx.post(
        f"{url}/v1/completions", json={**body, "prompt_logprobs": None}, timeout=TIMEOUT
    )
    assert "prompt_logprobs" not in plain.json()["choices"][0]
    for bad, match in [
        ({"stream": True}, "not available with stream"),
        ({"prompt_logprobs": 21}, "in [0, 20]"),
    ]:
        r = httpx.post(f"{url}/v1/completions", json={**body, **bad}, timeout=TIMEOUT)
        error = r.json()["error"]
        assert r.status_code == 400 and match in error["message"]
        assert error["param"] == "prompt_logprobs"


# ---- echo: lm-eval's loglikelihood requests (issue 36, defect 1) --------------------------


def _completion(url, **body):
    r = httpx.post(f"{url}/v1/completions", json={"temperature": 0, **body}, timeout=TIMEOUT)
    return r.status_code, r.json()


def _offline_prompt_logprobs(setup, prompt: str, n: int):
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=n, logprobs=n)
    (want,) = _engine_like(setup[2]).generate([prompt], params, use_tqdm=False)
    return want


def test_echo_scores_a_continuation_as_lm_eval_reads_it(url, setup):
    """lm-eval's local-completions: echo, max_tokens 1, logprobs 1; it sums token_logprobs
    over the continuation's tokens, [ctxlen:-1] (the last entry is the generated token)."""
    context, continuation = "The quick brown", " fox"
    prompt = context + continuation
    want = _offline_prompt_logprobs(setup, prompt, 1)
    status, got = _completion(url, prompt=prompt, echo=True, max_tokens=1, logprobs=1)
    assert status == 200
    choice = got["choices"][0]
    assert choice["text"] == prompt + want.text
    lp = choice["logprobs"]
    n = len(prompt)  # the byte tokenizer: one token a character
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + 1
    assert lp["tokens"][:n] == list(prompt)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ids = want.prompt_token_ids
    expected = [want.prompt_logprobs[i][ids[i]] for i in range(1, n)]
    assert lp["token_logprobs"][1:n] == pytest.approx(expected, abs=1e-6)
    assert lp["token_logprobs"][n] == pytest.approx(want.logprobs[0][want.token_ids[0]], abs=1e-6)
    assert lp["text_offset"] == list(range(n + 1))  # ASCII, one character a token
    # lm-eval's own arithmetic on the response: the continuation's loglikelihood.
    ctxlen = len(context)
    score = sum(lp["token_logprobs"][ctxlen:-1])
    assert score == pytest.approx(sum(expected[ctxlen - 1 :]), abs=1e-5)
    for top, entry, token in zip(lp["top_logprobs"][1:n], want.prompt_logprobs[1:], ids[1:]):
        assert top[chr(token)] == pytest.approx(entry[token], abs=1e-6)
        assert 1 <= len(top) <= 2  # the likeliest, and the prompt's token if it is not
    assert "prompt_logprobs" not in choice  # not asked for
    assert got["usage"]["completion_tokens"] == 1


def test_echo_with_max_tokens_0_returns_the_prompt_alone(url, setup, offline):
    want = _offline_prompt_logprobs(setup, "Hello", 2)
    status, got = _completion(url, prompt="Hello", echo=True, max_tokens=0, logprobs=2)
    assert status == 200
    choice = got["choices"][0]
    assert choice["text"] == "Hello"
    lp = choice["logprobs"]
    assert lp["tokens"] == list("Hello") and lp["text_offset"] == [0, 1, 2, 3, 4]
    ids = want.prompt_token_ids
    assert lp["token_logprobs"][1:] == pytest.approx(
        [want.prompt_logprobs[i][ids[i]] for i in range(1, 5)], abs=1e-6
    )
    assert got["usage"] == {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}
    # Without echo, 0 tokens is still refused; echo without logprobs is text only.
    status, err = _completion(url, prompt="Hello", max_tokens=0)
    assert status == 400 and "max_tokens must be > 0" in err["error"]["message"]
    status, plain = _completion(url, prompt="Hello", echo=True, max_tokens=2)
    assert plain["choices"][0]["text"] == "Hello" + offline("Hello", 2).text
    assert plain["choices"][0]["logprobs"] is None


def test_echo_refuses_a_stream(url):
    status, err = _completion(url, prompt="Hello", echo=True, stream=True, max_tokens=1)
    assert status == 400 and err["error"]["param"] == "echo"
    assert "echo is not available with stream" in err["error"]["message"]


def test_token_ids_as_a_list_of_one_list(url, offline):
    ids = list(b"Hello")
    _, flat = _completion(url, prompt=ids, max_tokens=MAX_TOKENS)
    status, nested = _completion(url, prompt=[ids], max_tokens=MAX_TOKENS)
    assert status == 200 and nested["choices"][0]["text"] == flat["choices"][0]["text"]
    assert flat["choices"][0]["text"] == offline("Hello").text
    status, err = _completion(url, prompt=[ids, ids], max_tokens=MAX_TOKENS)
    assert status == 400 and "only one prompt per request" in err["error"]["message"]


def test_logit_bias_bans_and_forces_tokens_as_offline(url, setup, offline):
    """Issue 36, defect 7: logit_bias is applied (it used to be dropped). Banning the greedy
    first token changes the text to what the offline engine gives with the same bias; a +100
    bias makes a sampled chat answer that one token throughout."""
    first = offline("Hello", 3).token_ids[0]
    ban = {str(first): -100}
    status, body = _completion(url, prompt="Hello", max_tokens=3, logit_bias=ban)
    params = SamplingParams(temperature=0, max_tokens=3, logit_bias={first: -100.0})
    (want,) = setup[2].generate("Hello", params, use_tqdm=False)
    assert want.token_ids[0] != first
    assert status == 200 and body["choices"][0]["text"] == want.text
    chat = {"messages": MESSAGES, "logit_bias": {"65": 100}, "max_tokens": 4, "seed": 3}
    r = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == setup[2].tokenizer.decode([65] * 4)


def test_tokenize_detokenize_and_tokenizer_info_as_vllm(url, setup):
    """vLLM's tokenizer endpoints (lm-eval's remote tokenizer backend uses them): the ids
    are the ones a completion of the prompt runs, and bad input is a 400 naming the field."""
    tok = setup[2].tokenizer
    r = httpx.post(f"{url}/tokenize", json={"prompt": "Hello", "model": NAME}, timeout=TIMEOUT)
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == tok.encode("Hello") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == setup[2].max_model_len and body["token_strs"] is None
    _, completion = _completion(url, prompt="Hello", max_tokens=1)
    assert completion["usage"]["prompt_tokens"] == body["count"]
    chat = {"messages": MESSAGES, "return_token_strs": True}
    r = httpx.post(f"{url}/tokenize", json=chat, timeout=TIMEOUT)
    ids = tok.encode_chat(MESSAGES)
    assert r.json()["tokens"] == ids
    assert "".join(r.json()["token_strs"]) == tok.decode(ids, skip_special_tokens=False)
    r = httpx.post(f"{url}/detokenize", json={"tokens": tok.encode("Hi!")}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json() == {"prompt": "Hi!"}
    info = httpx.get(f"{url}/tokenizer_info", timeout=TIMEOUT).json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    assert info["vocab_size"] == tok.vocab_size
    for path, payload, match in [
        ("tokenize", {"prompt": "a", "messages": MESSAGES}, "exactly one of prompt and messages"),
        ("tokenize", {}, "exactly one of prompt and messages"),
        ("tokenize", '{"prompt": "\\ud800"}', "lone surrogate"),
        ("tokenize", {"messages": [{"role": "bot", "content": "x"}]}, "role"),
        ("detokenize", {"tokens": [1, 10**9]}, "token id 1000000000 is outside"),
        ("detokenize", {"tokens": ["a"]}, "tokens"),
    ]:
        kind = "content" if isinstance(payload, str) else "json"
        headers = {"content-type": "application/json"}
        r = httpx.post(f"{url}/{path}", **{kind: payload}, headers=headers, timeout=TIMEOUT)
        assert r.status_code == 400 and match in r.json()["error"]["message"], (payload, r.text)
    r = httpx.post(f"{url}/tokenize", json={"prompt": "a", "model": "other"}, timeout=TIMEOUT)
    assert r.status_code == 404


def test_harmless_values_of_unserved_fields_pass_and_max_completion_tokens_counts(url, offline):
    body = {"prompt": "Hello", "temperature": 0, "max_completion_tokens": 3, "max_tokens": 9}
    extra = {"logit_bias": {}, "best_of": 1, "suffix": "", "response_format": {"type": "text"}}
    r = httpx.post(f"{url}/v1/completions", json={**body, **extra}, timeout=TIMEOUT)
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == offline("Hello", 3).text
    assert r.json()["usage"]["completion_tokens"] == 3


# ---- big bodies (issue 36, defect 2) ----------------------------------------------------------


def test_an_over_long_prompt_is_refused_before_all_of_it_is_tokenized(url, server, monkeypatch):
    seen = []
    tokenizer = server.tokenizer

    class Recording:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def encode(self, text, **kw):
            seen.append(len(text))
            return tokenizer.encode(text, **kw)

    monkeypatch.setattr(server, "tokenizer", Recording())
    r = httpx.post(
        f"{url}/v1/completions", json={"prompt": "x" * 100_000, "max_tokens": 1}, timeout=TIMEOUT
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    message = r.json()["error"]["message"]
    assert (
        "exceeds max_model_len 252 (more than 252 tokens in its first 2016 characters)" in message
    )
    assert seen == [2016]  # the probe only, never the 100,000 characters


def test_a_body_over_the_limit_is_413_and_the_server_goes_on(setup):
    llm = _engine_like(setup[2])
    app = build_app(llm, model_name=NAME, max_request_bytes=4096)
    with BackgroundServer(app) as small:
        big = {"prompt": "x" * 5000, "max_tokens": 1}
        r = httpx.post(f"{small.url}/v1/completions", json=big, timeout=TIMEOUT)
        assert r.status_code == 413 and r.headers["connection"] == "close"
        assert "request body exceeds 4096 bytes" in r.json()["error"]["message"]

        def chunks():  # no content-length: counted as it arrives
            for _ in range(10):
                yield b" " * 1000

        r = httpx.post(f"{small.url}/v1/completions", content=chunks(), timeout=TIMEOUT)
        assert r.status_code == 413
        ok = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
        r = httpx.post(f"{small.url}/v1/completions", json=ok, timeout=TIMEOUT)
        assert r.status_code == 200


def test_health_is_warming_up_until_the_first_steps_ran(setup):
    """Issue 36: /health is 503 until the server's warm-up request (the first compile) has run;
    a request sent meanwhile queues and is answered."""
    llm = _engine_like(setup[2])
    gate, real = threading.Event(), llm.step

    def held_step():
        gate.wait(60)
        return real()

    llm.step = held_step
    app = build_app(llm, model_name=NAME)
    with BackgroundServer(app, wait_ready=False) as server:
        r = httpx.get(f"{server.url}/health", timeout=TIMEOUT)
        assert r.status_code == 503 and r.json() == {"status": "warming up"}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
            pending = pool.submit(httpx.post, f"{server.url}/v1/completions", json=body, timeout=60)
            gate.set()
            assert pending.result().status_code == 200
        deadline = time.monotonic() + 60
        while httpx.get(f"{server.url}/health", timeout=TIMEOUT).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert app.state.server.ready


def test_idle_and_header_phase_connections_are_closed(setup):
    """Issue 36, defect 5: a connection that sends nothing, or headers that never finish, is
    closed after the keep-alive timeout (uvicorn alone held them forever)."""
    import socket

    app = build_app(_engine_like(setup[2]), model_name=NAME)
    with BackgroundServer(app, timeout_keep_alive=0.5) as server:
        host, port = server.url.removeprefix("http://").split(":")

        def closed_within(payload: bytes, seconds: float) -> bool:
            with socket.create_connection((host, int(port)), timeout=seconds) as s:
                for i in range(0, len(payload), 4):  # trickled: bytes do not extend it
                    s.sendall(payload[i : i + 4])
                    time.sleep(0.05)
                try:
                    return s.recv(1024) == b""  # the server closed it
                except TimeoutError:
                    return False

        assert closed_within(b"", 5)
        assert closed_within(b"GET /health HTTP/1.1\r\nHost: x\r\n", 5)
        r = httpx.get(f"{server.url}/health", timeout=TIMEOUT)  # a whole request still works
        assert r.status_code == 200
