"""Prefix caching: time to first token and prefill tokens saved for requests that share a long
prefix, cache on against off, in one run on the same engine shapes.

    python -m benchmarks prefix [--quick] [--prefix-len 2048]
"""

from __future__ import annotations

import time

import numpy as np

from benchmarks.harness import Suite, Table, add_ratio, repeats
from kimi_linear_jax.presets import preset
from kimi_linear_jax.testing import random_model
from serving.core.sampling import SamplingParams
from serving.engine import LLM

SUITE = Suite("prefix", __doc__)
SUITE.option("--prefix-len", type=int, help="shared prefix tokens (2048; --quick 256)")
SUITE.option("--suffix-len", type=int, default=32, help="each request's own tokens")
SUITE.option("--requests", type=int, help="requests sharing the prefix (4; --quick 3)")


def first_token(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[float, list, int]:
    """(TTFT seconds, output ids, cached tokens) of one request run alone, by the step API."""
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


@SUITE.measure("cache")
def cache(args) -> Table:
    """TTFT of requests that share a prefix (a system prompt), sent one after another, with the
    prefix cache on and off.

    With the cache on, the first request is cold and donates a recurrent-state checkpoint at
    the grid depth below its length; the others restore it and prefill only the rest. Both
    engines are warmed on another prefix first (compiles excluded, the restore path
    included), then the cache is emptied. The two modes take turns; best of N by the mean
    TTFT of the later requests. Outputs compared between the modes.
    """
    name = "tiny" if args.quick else "small"
    prefix_len = args.prefix_len or (256 if args.quick else 2048)
    count = args.requests or (3 if args.quick else 4)
    model = random_model(preset(name))
    vocab, page = model.config.vocab_size, 16
    total = prefix_len + args.suffix_len + 8
    shapes = dict(
        page_size=page,
        num_pages=2 * (total // page + 2) + 1,
        max_num_seqs=1,
        max_num_batched_tokens=512,
        chunk_size=512,
        batch_buckets=(1,),
        token_buckets=(64, 512),  # a hit prefills only the suffix: a small bucket for it
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    rng = np.random.default_rng(0)

    def prompts(n: int) -> list[list[int]]:
        prefix = rng.integers(1, vocab, prefix_len).tolist()
        return [prefix + rng.integers(1, vocab, args.suffix_len).tolist() for _ in range(n)]

    warm, batch = prompts(2), prompts(count)
    engines = {
        mode: LLM(model, enable_prefix_caching=mode == "on", **shapes) for mode in ("off", "on")
    }
    for llm in engines.values():
        for p in warm:
            first_token(llm, p, params)

    def run(llm: LLM) -> dict:
        llm.reset_prefix_cache()
        before = llm.metrics()["prefill_tokens"]
        got = [first_token(llm, p, params) for p in batch]
        return {
            "ttft_first_s": got[0][0],
            "ttft_rest_mean_s": float(np.mean([g[0] for g in got[1:]])),
            "prefill_tokens": llm.metrics()["prefill_tokens"] - before,
            "cached_tokens": sum(g[2] for g in got),
            "outputs": [g[1] for g in got],
        }

    best: dict[str, dict] = {}
    for _ in range(repeats(args, 2, 1)):
        for mode, llm in engines.items():
            r = run(llm)
            if mode not in best or r["ttft_rest_mean_s"] < best[mode]["ttft_rest_mean_s"]:
                best[mode] = r
    identical = best["on"].pop("outputs") == best["off"].pop("outputs")
    rows = [{"cache": mode, **r, "identical": identical} for mode, r in best.items()]
    add_ratio(rows, "ttft_rest_mean_s", rows[0], "ttft_speedup", invert=True)
    for r in rows:
        r["prefill_saved"] = rows[0]["prefill_tokens"] - r["prefill_tokens"]
    columns = ["cache", "ttft_first_s", "ttft_rest_mean_s", "ttft_speedup", "prefill_tokens"]
    columns += ["cached_tokens", "prefill_saved", "identical"]
    title = (
        f"{name} preset, {count} requests of a {prefix_len}-token prefix + {args.suffix_len} "
        "own tokens, 8 greedy tokens each"
    )
    return Table(title, rows, columns, {"preset": name, "prefix_len": prefix_len})
