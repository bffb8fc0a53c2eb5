"""Load on the OpenAI-compatible server: requests/s, time to first token and inter-token latency
(p50 / p99) at 1, 8 and 32 concurrent streaming clients.

The server runs in this process (uvicorn in a thread, the engine loop in another) on the built-in
default model (`small` shapes, random weights); `--preset tiny --quick` is a fast smoke run.
Each concurrency level first runs an untimed round, so compilation stays out of the figures.

    python benchmarks/server_load.py [--preset small|tiny] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import httpx  # noqa: E402
from common import print_table, write_json  # noqa: E402

from serving.engine import LLM  # noqa: E402
from serving.server import BackgroundServer, build_app  # noqa: E402

PROMPTS = ["The quick brown fox", "Hello, world", "Once upon a time", "Kimi Linear is"]
CONCURRENCY = (1, 8, 32)


def make_llm(preset_name: str) -> LLM:
    # One request per state slot up to 32; buckets 1 / 8 / 32 match the concurrency levels.
    shapes = dict(max_num_seqs=32, batch_buckets=(1, 8, 32), num_pages=512)
    from kimi_linear_jax.presets import preset
    from kimi_linear_jax.testing import random_model
    from kimi_linear_jax.tokenizer import ByteTokenizer

    # `small` with the byte vocabulary: the built-in default model when these figures were
    # first taken (random weights; the built-in model is now the trained `pycode`).
    vocab = {"vocab_size": 320} if preset_name == "small" else {}
    model = random_model(preset(preset_name, **vocab))
    return LLM(model, tokenizer=ByteTokenizer(model.config.vocab_size), **shapes)


async def one_request(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    """Stream one completion; return its TTFT and the gaps between token chunks."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    times = []
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
    """`clients` concurrent users, each sending `per_client` requests one after another."""

    async def user(i: int, client: httpx.AsyncClient) -> list[dict]:
        prompts = [PROMPTS[(i + k) % len(PROMPTS)] for k in range(per_client)]
        return [await one_request(client, p, max_tokens) for p in prompts]

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        done = await asyncio.gather(*(user(i, client) for i in range(clients)))
        wall = time.perf_counter() - t0
    results = [r for rs in done for r in rs]
    return {"wall_s": wall, "results": results}


def percentile(values: list[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summarize(clients: int, max_tokens: int, run: dict) -> dict:
    ttft = [r["ttft"] for r in run["results"]]
    itl = [x for r in run["results"] for x in r["itl"]]
    n = len(run["results"])
    return {
        "clients": clients,
        "requests": n,
        "max_tokens": max_tokens,
        "req_per_s": n / run["wall_s"],
        "tok_per_s": n * max_tokens / run["wall_s"],
        "ttft_p50_ms": 1e3 * percentile(ttft, 50),
        "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "itl_p50_ms": 1e3 * percentile(itl, 50),
        "itl_p99_ms": 1e3 * percentile(itl, 99),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", choices=["small", "tiny"])
    p.add_argument("--quick", action="store_true", help="fewer, shorter requests")
    args = p.parse_args()
    per_client, max_tokens = (1, 8) if args.quick else (2, 16)
    llm = make_llm(args.preset)
    rows = []
    with BackgroundServer(build_app(llm)) as server:
        for clients in CONCURRENCY:
            asyncio.run(round_of(server.url, clients, 1, max_tokens))  # warm-up: compiles
            run = asyncio.run(round_of(server.url, clients, per_client, max_tokens))
            rows.append(summarize(clients, max_tokens, run))
            print(f"{clients} clients done", file=sys.stderr)
    columns = list(rows[0])
    print_table(rows, columns)
    meta = {"preset": args.preset, "quick": args.quick, "per_client": per_client}
    print(write_json("server_load", rows, meta))


if __name__ == "__main__":
    main()
