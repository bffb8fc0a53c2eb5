"""How often the draft model's greedy token is the target's, and what that allows: the ceiling
of draft-model speculation on held-out code, independent of the machine's speed.

The built-in model continues `--prompts` held-out prompts greedily (`--max-tokens` each, the
engine, as `code_speculation.py` does). The draft then reads each whole sequence once (teacher
forcing): at every continuation position its argmax either is the target's token or is not.
A verify window accepts drafts up to the first disagreement, and drafts after an accepted one
see exactly the target's tokens, so these agreements replay every window of fixed width k
exactly: the window starting at position s yields 1 + (the agreeing run from s, at most k)
tokens.

Printed:

- agreement by the draft's confidence (the gap between its two most likely tokens), to see
  whether drafting only where the draft is sure would pay;
- per k: tokens per window (replayed), the window's price in plain steps (`draft_cost.py`'s
  `results/draft_cost_k{k}.json`, when there is one), the speed-up bound tokens / price, the
  same bound for a draft that cost nothing (the verify's price alone), and the highest price
  at which 1.5x stays possible (tokens / 1.5). The bounds leave out host work between calls
  and steps in which adaptive drafting rests.

Run: ``python benchmarks/draft_agreement.py [--prompts 12]`` (under a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import RESULTS_DIR, print_table, serving_heap, write_json  # noqa: E402

serving_heap()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from code_speculation import prompts_from_held_out  # noqa: E402
from flax import nnx  # noqa: E402

from kimi_linear_jax.checkpoint import BUILTIN_DRAFT, load_pretrained  # noqa: E402
from serving.engine import LLM  # noqa: E402
from serving.sampling import SamplingParams  # noqa: E402

# Lower edges of the confidence bins (top-1 minus top-2 probability).
GAP_EDGES = (0.0, 0.02, 0.05, 0.1, 0.2, 0.4)


def continuations(llm: LLM, prompts, n: int) -> list[np.ndarray]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [np.asarray(p + list(o.token_ids), np.int32) for p, o in zip(prompts, outs)]


def draft_reads(draft, seqs, start: int) -> tuple[np.ndarray, np.ndarray]:
    """(agrees, gap) [N, T - start]: whether the draft's argmax after each prefix is the
    target's next token, and its top-1 minus top-2 probability there."""
    graphdef, state = nnx.split(draft)

    @jax.jit
    def read(state, ids):
        probs = jax.nn.softmax(nnx.merge(graphdef, state)(ids), axis=-1)
        top = jax.lax.top_k(probs, 2)[0]
        return jnp.argmax(probs, -1), top[..., 0] - top[..., 1]

    picks, gaps = read(state, jnp.asarray(np.stack(seqs)))
    picks, gaps = np.asarray(picks), np.asarray(gaps)
    targets = np.stack(seqs)[:, start:]
    return picks[:, start - 1 : -1] == targets, gaps[:, start - 1 : -1]


def tokens_per_window(agrees: np.ndarray, k: int) -> float:
    """Mean tokens a width-k window yields, replaying consecutive windows over each row."""
    tokens = windows = 0
    for row in agrees:
        s = 0
        while s < len(row):
            run = 0
            while run < k and s + run < len(row) and row[s + run]:
                run += 1
            step = min(run + 1, len(row) - s)
            tokens, windows, s = tokens + step, windows + 1, s + step
    return tokens / windows


def window_prices(k: int) -> tuple[float, float]:
    """(window, verify alone) in plain steps, the shipped draft's from `draft_cost.py`; nan
    where that was not measured at this k."""
    path = os.path.join(RESULTS_DIR, f"draft_cost_k{k}.json")
    rows = json.load(open(path))["rows"] if os.path.exists(path) else []
    row = next((r for r in rows if r["draft"].endswith("(shipped)")), None)
    if row is None:
        return float("nan"), float("nan")
    return row["window_steps"], row["verify_ms"] / row["plain_ms"]


def by_gap(agrees: np.ndarray, gaps: np.ndarray) -> list[dict]:
    rows = []
    for lo, hi in zip(GAP_EDGES, (*GAP_EDGES[1:], 1.01), strict=True):
        inside = (gaps >= lo) & (gaps < hi)
        rows.append(
            {
                "gap": f"[{lo}, {min(hi, 1.0)}{']' if hi > 1 else ')'}",
                "positions": int(inside.sum()),
                "share": float(inside.mean()),
                "agreement": float(agrees[inside].mean()) if inside.any() else float("nan"),
            }
        )
    return rows


def by_k(agrees: np.ndarray, ks) -> list[dict]:
    rows = []
    for k in ks:
        tokens = tokens_per_window(agrees, k)
        price, verify = window_prices(k)
        rows.append(
            {
                "k": k,
                "tokens_per_window": tokens,
                "window_steps": price,
                "bound": tokens / price,
                "verify_steps": verify,
                "free_draft_bound": tokens / verify,
                "price_for_1.5x": tokens / 1.5,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--draft-model", default=BUILTIN_DRAFT)
    p.add_argument("--ks", default="2,4,8")
    p.add_argument("--out", help="directory for the JSON (default: benchmarks/results)")
    a = p.parse_args(argv)
    llm = LLM(max_num_seqs=a.prompts, num_pages=64 * a.prompts, dtype="float32")
    prompts = prompts_from_held_out(llm.tokenizer, a.prompt_len, a.max_tokens, a.prompts)
    seqs = continuations(llm, prompts, a.max_tokens)
    agrees, gaps = draft_reads(load_pretrained(a.draft_model, dtype="float32"), seqs, a.prompt_len)
    gap_rows = by_gap(agrees, gaps)
    k_rows = by_k(agrees, [int(k) for k in a.ks.split(",")])
    print(f"agreement over {agrees.size} positions of {len(seqs)} prompts: {agrees.mean():.3f}")
    print_table(gap_rows, ["gap", "positions", "share", "agreement"])
    print()
    cols = ["tokens_per_window", "window_steps", "bound", "verify_steps", "free_draft_bound"]
    print_table(k_rows, ["k", *cols, "price_for_1.5x"])
    meta = {"agreement": float(agrees.mean()), "prompts": len(seqs), "draft": a.draft_model}
    path = write_json("draft_agreement", [*gap_rows, *k_rows], meta, a.out)
    print(f"wrote {path}")
    return {"gap": gap_rows, "k": k_rows}


if __name__ == "__main__":
    main()
