"""Prefix caching: time to first token and prefill tokens saved for requests that share a long
prefix (a system prompt), cache on vs off, in the same run on the same engine shapes.

Workload: ``--requests`` questions, each ``--prefix-len`` shared tokens plus ``--suffix-len``
own tokens, sent one after another (a chat service with one system prompt). With the cache on,
the first request is cold and donates a recurrent-state checkpoint at the grid depth below its
length; the others restore it and prefill only the rest. TTFT is measured with the step API
(``add_request`` until the first token comes back); outputs are greedy and compared between the
two modes. Both engines are warmed up on another prefix first (compiles excluded), and the
cache is emptied before the measured requests.

Run from the repo root: ``python benchmarks/prefix_cache.py [--prefix-len 2048]
[--suffix-len 32] [--requests 4] [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from common import print_table, write_json  # noqa: E402

from kimi_linear_jax.presets import preset  # noqa: E402
from kimi_linear_jax.testing import random_model  # noqa: E402
from serving.engine import LLM  # noqa: E402
from serving.sampling import SamplingParams  # noqa: E402


def prompts(rng, vocab: int, prefix_len: int, suffix_len: int, n: int) -> list[list[int]]:
    prefix = rng.integers(1, vocab, prefix_len).tolist()
    return [prefix + rng.integers(1, vocab, suffix_len).tolist() for _ in range(n)]


def run_one(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[float, list[int], int]:
    """(TTFT seconds, output token ids, cached tokens) of one request run alone."""
    t0 = time.perf_counter()
    rid = llm.add_request(prompt, params)
    ttft, final = None, None
    while final is None:
        for out in llm.step():
            if out.request_id != rid:
                continue
            if ttft is None and out.token_ids:
                ttft = time.perf_counter() - t0
            if out.finished:
                final = out
    return ttft, final.token_ids, final.num_cached_tokens


def measure(llm: LLM, batch: list[list[int]], params: SamplingParams) -> dict:
    before = llm.metrics()["prefill_tokens"]
    runs = [run_one(llm, p, params) for p in batch]
    return {
        "ttft_first_s": runs[0][0],
        "ttft_rest_mean_s": float(np.mean([r[0] for r in runs[1:]])),
        "prefill_tokens": llm.metrics()["prefill_tokens"] - before,
        "cached_tokens": sum(r[2] for r in runs),
        "outputs": [r[1] for r in runs],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="tiny preset, 256-token prefix")
    args = ap.parse_args(argv)
    if args.quick:
        args.preset, args.prefix_len, args.requests = "tiny", 256, 3
    model = random_model(preset(args.preset))
    vocab = model.config.vocab_size
    total = args.prefix_len + args.suffix_len + args.max_tokens
    shapes = dict(
        page_size=16,
        num_pages=2 * (total // 16 + 2) + 1,
        max_num_seqs=1,
        max_num_batched_tokens=512,
        chunk_size=512,
        batch_buckets=(1,),
        token_buckets=(64, 512),  # a hit prefills only the suffix: a small bucket for it
    )
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rng = np.random.default_rng(0)
    warm = prompts(rng, vocab, args.prefix_len, args.suffix_len, 2)
    batch = prompts(rng, vocab, args.prefix_len, args.suffix_len, args.requests)
    results = {}
    for name, enabled in (("off", False), ("on", True)):
        llm = LLM(model, enable_prefix_caching=enabled, **shapes)
        for p in warm:  # compiles, including the restore path when the cache is on
            run_one(llm, p, params)
        llm.reset_prefix_cache()
        results[name] = measure(llm, batch, params)
    identical = results["on"].pop("outputs") == results["off"].pop("outputs")
    rows = [{"cache": k, **v} for k, v in results.items()]
    saved = results["off"]["prefill_tokens"] - results["on"]["prefill_tokens"]
    speedup = results["off"]["ttft_rest_mean_s"] / results["on"]["ttft_rest_mean_s"]
    print_table(
        rows, ["cache", "ttft_first_s", "ttft_rest_mean_s", "prefill_tokens", "cached_tokens"]
    )
    print(
        f"prefill tokens saved: {saved}; TTFT of a hit, off/on: {speedup:.2f}x; "
        f"outputs identical: {'yes' if identical else 'NO'}"
    )
    meta = dict(vars(args), saved_prefill_tokens=saved, ttft_speedup=speedup, identical=identical)
    print(write_json("prefix_cache", rows, meta))


if __name__ == "__main__":
    main()
