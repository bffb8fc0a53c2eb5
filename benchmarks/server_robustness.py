"""What hostile or heavy client input costs the server, each beside its baseline in one run:

- /health latency while a 10 MB text prompt is being refused, against /health idle (the old
  server tokenized such a prompt on the event loop: /health then took seconds);
- time to the refusal of that prompt and of a 50 MB body (413), against tokenizing the 10 MB
  prompt in full (what the old server did before its 400);
- idle connections closed after the keep-alive timeout (the old server closed none);
- a decode step with a 300-entry logit_bias against the same sampled step without one.

The prompts are tokenized by the built-in model's tokenizer.json.

    python benchmarks/server_robustness.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import httpx  # noqa: E402
from common import print_table, timeit_interleaved, write_json  # noqa: E402

from kimi_linear_jax.checkpoint import BUILTIN_MODEL, read_config  # noqa: E402
from kimi_linear_jax.presets import preset  # noqa: E402
from kimi_linear_jax.testing import random_model  # noqa: E402
from kimi_linear_jax.tokenizer import load_tokenizer  # noqa: E402
from serving.engine import LLM  # noqa: E402
from serving.sampling import SamplingParams  # noqa: E402
from serving.server import BackgroundServer, build_app  # noqa: E402

SHAPES = dict(num_pages=256, page_size=16, max_num_seqs=8, batch_buckets=(8,))
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


def big_prompt_rows(url: str, tokenizer, mb: int, probes: int) -> list[dict]:
    text = "word " * ((mb << 20) // 5)
    body = b'{"prompt": "' + text.encode() + b'", "max_tokens": 1}'
    idle = health_ms(url, probes)
    during: list[float] = []
    refusal: list = []
    worker = threading.Thread(target=lambda: refusal.append(post_s(url, body)))
    worker.start()
    while worker.is_alive():
        during += health_ms(url, 1)
    refuse_s, status = refusal[0]
    t0 = time.perf_counter()
    tokenizer.encode(text)
    full_s = time.perf_counter() - t0
    huge_s, huge_status = post_s(url, b'{"prompt": "' + b"x" * (50 << 20) + b'"}')
    return [
        {"measure": "/health p50 idle (ms)", "value": statistics.median(idle), "baseline": ""},
        {
            "measure": f"/health max during a {mb} MB prompt (ms)",
            "value": max(during),
            "baseline": max(idle),
            "ratio": max(during) / max(idle),
        },
        {
            "measure": f"{mb} MB text prompt refused (s), status {status}",
            "value": refuse_s,
            "baseline": full_s,
            "ratio": refuse_s / full_s,
            "note": "baseline: tokenizing it in full",
        },
        {
            "measure": f"50 MB body refused (s), status {huge_status}",
            "value": huge_s,
            "baseline": full_s,
            "ratio": huge_s / full_s,
        },
    ]


def idle_connection_row(url: str, n: int) -> dict:
    host, port = url.removeprefix("http://").split(":")
    socks = [socket.create_connection((host, int(port))) for _ in range(n)]
    time.sleep(KEEP_ALIVE_S * 3)
    closed = sum(_closed(s) for s in socks)
    return {
        "measure": f"idle connections closed {KEEP_ALIVE_S * 3:g} s after opening",
        "value": closed,
        "baseline": n,
        "ratio": closed / n,
    }


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed `sock` (EOF or reset); a socket still open times out."""
    sock.settimeout(0.5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    finally:
        sock.close()


def bias_rows(llm: LLM, tokens: int, repeats: int) -> list[dict]:
    vocab = llm.config.vocab_size
    bias = {t: (-1.0) ** t for t in range(min(300, vocab))}
    plain = SamplingParams(temperature=0.8, seed=1, max_tokens=tokens, ignore_eos=True)
    biased = SamplingParams(**{**plain.__dict__, "logit_bias": bias})
    prompts = [list(range(1, 9))] * 8

    def run(params):
        return lambda: llm.generate(prompts, params, use_tqdm=False)

    times = timeit_interleaved({"plain": run(plain), "biased": run(biased)}, repeats=repeats)
    base, got = times["plain"]["min_s"], times["biased"]["min_s"]
    return [
        {
            "measure": f"8 rows x {tokens} sampled tokens, 300-entry logit_bias (s)",
            "value": got,
            "baseline": base,
            "ratio": got / base,
        }
    ]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller prompt, fewer repeats")
    args = parser.parse_args(argv)
    # The built-in model's tokenizer.json (a BPE, as slow per byte as a real one), over the tiny
    # preset at its vocabulary: the step costs are not what is measured here.
    vocab = read_config(BUILTIN_MODEL).vocab_size
    tokenizer = load_tokenizer(BUILTIN_MODEL, vocab)
    model = random_model(preset("tiny", vocab_size=vocab))
    llm = LLM(model, tokenizer=tokenizer, **SHAPES)
    app = build_app(llm, model_name="bench")
    rows = []
    with BackgroundServer(app, timeout_keep_alive=KEEP_ALIVE_S) as server:
        rows += big_prompt_rows(server.url, tokenizer, 2 if args.quick else 10, 20)
        rows += [idle_connection_row(server.url, 50 if args.quick else 500)]
    rows += bias_rows(LLM(model, tokenizer=tokenizer, **SHAPES), 16, 2 if args.quick else 5)
    print_table(rows, ["measure", "value", "baseline", "ratio", "note"])
    write_json("server_robustness", rows, {"quick": args.quick})


if __name__ == "__main__":
    main()
