"""What a draft-model window costs, in plain decode steps of the built-in model, for the
shipped draft and for smaller draft shapes; and from that price, the best speed-up any
acceptance could give and the acceptance a 1.5x speed-up needs. Batch 1, float32, greedy.

Each draft runs in its own engine (`speculative={"method": "draft_model", "min_acceptance":
0}`, so every step drafts) continuing a held-out prompt for `--max-tokens` tokens; a plain
engine continues the same prompt. The engines take turns, `--repeats` rounds. Inside each, the
compiled calls are timed until their results are ready: the draft's k + 1 fused steps, the
target's verify window, the draft's state rollback, and (plain engine) one decode step; per
call the median, per engine the best round. A draft's cost does not depend on its weights, so
the shapes other than the shipped draft run with random weights (`--drafts`).

window price P = (draft + verify + rollback) / plain step. A window gains 1 + a * k tokens
(a: accepted / proposed drafts), so the speed-up is (1 + a k) / P: at most (1 + k) / P, and
1.5x needs a >= (1.5 P - 1) / k. Host work between calls is left out: this is a bound.

Run: ``python benchmarks/draft_cost.py [--k 4] [--repeats 3]`` (about a minute).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import print_table, serving_heap, write_json  # noqa: E402

serving_heap()

import jax  # noqa: E402
from code_speculation import prompts_from_held_out  # noqa: E402
from flax import nnx  # noqa: E402

import serving.runner as runner_mod  # noqa: E402
import serving.speculative.draft_model as draft_mod  # noqa: E402
import serving.speculative.steps as steps_mod  # noqa: E402
from kimi_linear_jax import load_pretrained  # noqa: E402
from kimi_linear_jax.checkpoint import BUILTIN_DRAFT, save_pretrained  # noqa: E402
from kimi_linear_jax.presets import preset  # noqa: E402
from kimi_linear_jax.testing import random_model  # noqa: E402
from serving.engine import LLM  # noqa: E402
from serving.sampling import SamplingParams  # noqa: E402

# Draft shapes besides the shipped one (`pycode-draft`: 2 MLA layers, dense MLPs, width 128),
# as overrides of its preset: the draft shipped until 2026-12-01 (3 KDA layers and 1 MLA
# layer, 4 routed experts: per-step states to keep and roll back, and many more ops), and one
# MLA layer alone.
CANDIDATES = {
    "old draft: 3 KDA + 1 MLA + MoE": dict(
        num_hidden_layers=4, kda_layers=(1, 2, 3), full_attn_layers=(4,), first_k_dense_replace=1
    ),
    "1 MLA layer": dict(num_hidden_layers=1, full_attn_layers=(1,), first_k_dense_replace=1),
}

# (module, function name, what it is) of the compiled calls timed.
CALLS = [
    (runner_mod, "decode_steps", "plain"),
    (steps_mod, "verify_step", "verify"),
    (draft_mod, "decode_steps", "draft"),
    (draft_mod, "_rollback", "rollback"),
]


class CallTimer:
    """Times the compiled calls of `CALLS` by the engine that makes them (`current`)."""

    def __init__(self) -> None:
        self.current = ""
        self.times: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
        self._real = {(m, f): getattr(m, f) for m, f, _ in CALLS}
        for (module, fn), real in self._real.items():
            what = next(w for m, f, w in CALLS if (m, f) == (module, fn))
            setattr(module, fn, self._timed(real, what))

    def _timed(self, real, what: str):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            out = jax.block_until_ready(real(*args, **kwargs))
            self.times[(self.current, what)].append(time.perf_counter() - t0)
            return out

        return call

    def restore(self) -> None:
        for (module, fn), real in self._real.items():
            setattr(module, fn, real)


def count_params(model) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def engines(k: int, tmp: str, names: list[str]) -> dict[str, tuple[LLM, int]]:
    """name -> (engine, draft parameters); "plain" first."""
    shapes = dict(max_num_seqs=1, num_pages=64, dtype="float32")
    spec = {"method": "draft_model", "num_draft_tokens": k, "min_acceptance": 0.0}
    out = {"plain": (LLM(**shapes), 0)}
    shipped = load_pretrained(BUILTIN_DRAFT, dtype="float32")
    out["pycode-draft (shipped)"] = (LLM(speculative=spec, **shapes), count_params(shipped))
    for name in names:
        path = os.path.join(tmp, str(len(out)))
        model = random_model(preset("pycode-draft", **CANDIDATES[name]))
        save_pretrained(model, path)
        out[name] = (LLM(speculative={**spec, "model": path}, **shapes), count_params(model))
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--drafts", default=",".join(CANDIDATES), help="candidate shapes to time")
    a = p.parse_args(argv)
    names = [n for n in a.drafts.split(",") if n]
    timer = CallTimer()
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    best: dict[tuple[str, str], float] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            llms = engines(a.k, tmp, names)
            prompt = prompts_from_held_out(llms["plain"][0].tokenizer, 128, a.max_tokens, 1)
            for llm, _ in llms.values():  # compile
                llm.generate(prompt, params, use_tqdm=False)
            for _ in range(a.repeats):
                for name, (llm, _) in llms.items():
                    timer.times.clear()
                    timer.current = name
                    llm.generate(prompt, params, use_tqdm=False)
                    for key, ts in timer.times.items():
                        best[key] = min(best.get(key, float("inf")), statistics.median(ts))
    finally:
        timer.restore()
    plain = best[("plain", "plain")]
    rows = []
    for name, (_, n_params) in llms.items():
        if name == "plain":
            continue
        parts = {w: best.get((name, w), 0.0) for w in ("draft", "verify", "rollback")}
        price = sum(parts.values()) / plain
        rows.append(
            {
                "draft": name,
                "params": n_params,
                "k": a.k,
                **{f"{w}_ms": 1e3 * t for w, t in parts.items()},
                "plain_ms": 1e3 * plain,
                "window_steps": price,
                "ceiling": (1 + a.k) / price,
                "acceptance_for_1.5x": (1.5 * price - 1) / a.k,
            }
        )
    cols = ["draft", "params", "k", "draft_ms", "verify_ms", "rollback_ms", "plain_ms"]
    print_table(rows, [*cols, "window_steps", "ceiling", "acceptance_for_1.5x"])
    meta = {"k": a.k, "max_tokens": a.max_tokens, "repeats": a.repeats, "B": 1}
    print("wrote", write_json(f"draft_cost_k{a.k}", rows, meta))
    return rows


if __name__ == "__main__":
    main()
