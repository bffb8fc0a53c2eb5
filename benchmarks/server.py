"""The OpenAI-compatible server: load (requests/s, time to first token, inter-token latency at
1, 8 and 32 streaming clients) and what hostile or heavy client input costs it.

    python -m benchmarks server [--only load robustness] [--quick]

The server runs in this process (uvicorn in a thread, the engine loop in another).
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import threading
import time

import httpx

from benchmarks.harness import Suite, Table, add_ratio, interleaved, repeats
from kimi_linear_jax.checkpoint import BUILTIN_MODEL, read_config
from kimi_linear_jax.presets import preset
from kimi_linear_jax.testing import random_model
from kimi_linear_jax.tokenizer import ByteTokenizer, load_tokenizer
from serving.core.sampling import SamplingParams
from serving.engine import LLM
from serving.server import BackgroundServer, build_app

SUITE = Suite("server", __doc__)
SUITE.option("--preset", help="load: the model's preset (small; --quick tiny)")
SUITE.option("--requests-per-client", type=int, help="load: requests each client sends (2)")
SUITE.option("--max-tokens", type=int, help="load: tokens a request (16)")

PROMPTS = ["The quick brown fox", "Hello, world", "Once upon a time", "Kimi Linear is"]


# ---- load -------------------------------------------------------------------------------------
async def one_request(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    """Stream one completion: its TTFT and the gaps between token chunks."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    t0, times = time.perf_counter(), []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(time.perf_counter())
    return {"ttft": times[0] - t0, "itl": [b - a for a, b in zip(times, times[1:])]}


async def round_of(url: str, clients: int, per_client: int, max_tokens: int) -> dict:
    """``clients`` concurrent users, each sending ``per_client`` requests one after another."""

    async def user(i: int, client: httpx.AsyncClient) -> list[dict]:
        prompts = [PROMPTS[(i + j) % len(PROMPTS)] for j in range(per_client)]
        return [await one_request(client, p, max_tokens) for p in prompts]

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        done = await asyncio.gather(*(user(i, client) for i in range(clients)))
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "results": [r for rs in done for r in rs]}


def percentile(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


@SUITE.measure("load")
def load(args) -> Table:
    """Requests/s, TTFT and inter-token latency (p50 / p99) at 1, 8 and 32 concurrent
    streaming clients, each level after an untimed round (compiles), beside one client.

    The model: ``small`` shapes with a 320-id byte vocabulary, random weights, up to 32
    sequences, batch buckets 1 / 8 / 32.
    """
    name = args.preset or ("tiny" if args.quick else "small")
    per_client = args.requests_per_client or (1 if args.quick else 2)
    max_tokens = args.max_tokens or (8 if args.quick else 16)
    levels = (1, 8) if args.quick else (1, 8, 32)
    model = random_model(preset(name, vocab_size=320))
    shapes = dict(max_num_seqs=32, batch_buckets=(1, 8, 32), num_pages=512)
    llm = LLM(model, tokenizer=ByteTokenizer(model.config.vocab_size), **shapes)
    rows = []
    with BackgroundServer(build_app(llm)) as server:
        for clients in levels:
            asyncio.run(round_of(server.url, clients, 1, max_tokens))  # compiles
            run = asyncio.run(round_of(server.url, clients, per_client, max_tokens))
            ttft = [r["ttft"] for r in run["results"]]
            itl = [x for r in run["results"] for x in r["itl"]]
            n = len(run["results"])
            rows.append(
                {
                    "clients": clients,
                    "requests": n,
                    "req_per_s": n / run["wall_s"],
                    "tok_per_s": n * max_tokens / run["wall_s"],
                    "ttft_p50_ms": 1e3 * percentile(ttft, 50),
                    "ttft_p99_ms": 1e3 * percentile(ttft, 99),
                    "itl_p50_ms": 1e3 * percentile(itl, 50),
                    "itl_p99_ms": 1e3 * percentile(itl, 99),
                }
            )
    add_ratio(rows, "tok_per_s", rows[0], "tok_s_vs_1_client")
    title = f"{name} shapes, random weights, {max_tokens} tokens a request, {per_client} a client"
    return Table(title, rows, list(rows[0]), {"preset": name, "max_tokens": max_tokens})


# ---- robustness -------------------------------------------------------------------------------
KEEP_ALIVE_S = 1.0


def health_ms(url: str, n: int) -> list[float]:
    out = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for _ in range(n):
            t0 = time.perf_counter()
            client.get("/health").raise_for_status()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def post_s(url: str, content: bytes) -> tuple[float, int]:
    headers = {"content-type": "application/json"}
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", content=content, headers=headers, timeout=300)
    return time.perf_counter() - t0, r.status_code


def closed(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (EOF or reset); a socket still open times out."""
    sock.settimeout(0.5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    finally:
        sock.close()


@SUITE.measure("robustness")
def robustness(args) -> Table:
    """What hostile or heavy client input costs the server, each beside its baseline.

    /health while a 10 MB text prompt is refused (against /health idle); the time to that
    refusal and to a 50 MB body's 413 (against tokenizing the prompt in full); idle
    connections closed after the keep-alive timeout (against those opened); 8 sampled rows
    with a 300-entry logit_bias (against none). The tiny preset at the built-in model's
    vocabulary, prompts tokenized by the built-in ``tokenizer.json``.
    """
    mb, conns = (2, 50) if args.quick else (10, 500)
    vocab = read_config(BUILTIN_MODEL).vocab_size
    tokenizer = load_tokenizer(BUILTIN_MODEL, vocab)
    model = random_model(preset("tiny", vocab_size=vocab))
    shapes = dict(num_pages=256, page_size=16, max_num_seqs=8, batch_buckets=(8,))
    llm = LLM(model, tokenizer=tokenizer, **shapes)
    rows = []
    with BackgroundServer(build_app(llm, model_name="bench"), timeout_keep_alive=KEEP_ALIVE_S) as s:
        text = "word " * ((mb << 20) // 5)
        idle = health_ms(s.url, 20)
        during: list[float] = []
        refusal: list = []
        body = b'{"prompt": "' + text.encode() + b'", "max_tokens": 1}'
        worker = threading.Thread(target=lambda: refusal.append(post_s(s.url, body)))
        worker.start()
        while worker.is_alive():
            during += health_ms(s.url, 1)
        refuse_s, status = refusal[0]
        t0 = time.perf_counter()
        tokenizer.encode(text)
        full_s = time.perf_counter() - t0
        huge_s, huge_status = post_s(s.url, b'{"prompt": "' + b"x" * (50 << 20) + b'"}')
        rows += [
            {
                "measure": f"/health, slowest during a {mb} MB prompt (ms)",
                "value": max(during),
                "baseline": max(idle),
                "baseline is": "slowest idle",
            },
            {
                "measure": f"{mb} MB text prompt, time to its {status} (s)",
                "value": refuse_s,
                "baseline": full_s,
                "baseline is": "tokenizing it in full",
            },
            {
                "measure": f"50 MB body, time to its {huge_status} (s)",
                "value": huge_s,
                "baseline": full_s,
                "baseline is": "tokenizing the prompt in full",
            },
        ]
        host, port = s.url.removeprefix("http://").split(":")
        socks = [socket.create_connection((host, int(port))) for _ in range(conns)]
        time.sleep(KEEP_ALIVE_S * 3)
        rows.append(
            {
                "measure": f"idle connections closed {KEEP_ALIVE_S * 3:g} s after opening",
                "value": sum(closed(x) for x in socks),
                "baseline": conns,
                "baseline is": "opened",
            }
        )
    llm = LLM(model, tokenizer=tokenizer, **shapes)
    plain = SamplingParams(temperature=0.8, seed=1, max_tokens=16, ignore_eos=True)
    bias = {t: (-1.0) ** t for t in range(min(300, vocab))}
    biased = SamplingParams(**{**plain.__dict__, "logit_bias": bias})
    prompts = [list(range(1, 9))] * 8
    fns = {
        name: lambda p=p: llm.generate(prompts, p, use_tqdm=False)
        for name, p in (("plain", plain), ("biased", biased))
    }
    runs = interleaved(fns, warmup=1, repeats=repeats(args, 5, 2), keep=False)
    rows.append(
        {
            "measure": "8 rows x 16 sampled tokens, 300-entry logit_bias (s)",
            "value": runs["biased"].best,
            "baseline": runs["plain"].best,
            "baseline is": "no bias",
        }
    )
    for r in rows:
        r["ratio"] = r["value"] / r["baseline"]
    columns = ["measure", "value", "baseline", "ratio", "baseline is"]
    return Table(
        f"tiny preset, the built-in tokenizer, keep-alive {KEEP_ALIVE_S:g} s", rows, columns
    )
