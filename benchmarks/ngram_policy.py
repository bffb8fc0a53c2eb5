"""How n-gram drafting policies would do on the built-in model's own greedy continuations of
held-out code, without timing anything: the policy alone decides how many drafting windows a
request needs and how many tokens each one gains.

Two prompt sets from the held-out standard-library files (`data.json`): "start", the first
`--prompt-len` tokens of each file long enough (the prompts of `code_speculation.py`), and
"mid", windows of the same length every 512 tokens from token 256 on (unseen by every tuning
here, a check against fitting the policy to six prompts). The built-in model continues each
greedily for `--max-tokens` tokens (plain decoding, batched). Then each policy is replayed
over those continuations as the engine would run it with `min_acceptance` 0: at each step it
proposes up to k tokens from the tokens so far, the longest prefix equal to the continuation
is accepted, and the step gains that plus one token.

Policies: "latest", the continuation of the latest earlier match of the longest suffix n-gram
(the drafter before the vote, restated here as the baseline), "vote"
(`serving.speculative.ngram.ngram_lookup`), and "vote+corpus": the vote, else up to
`--corpus-k` drafts from the standard library's n-gram table (`ngram_table.py`, training split),
as the engine's `corpus` option drafts. Columns: windows with drafts per 100 tokens,
tokens gained per drafting window, acceptance (accepted / proposed), steps per 100 tokens (a
plain step for each token no window covers), and the speed-up bound `cost`-weighted:
tokens / (plain steps + windows x `--window-cost`), where `--window-cost` is a verify
window's price in plain steps (1.5-1.7 on the 2-core CPU for k = 4, `RESULTS.md`).
"bound by width" prices each window by its width instead, as the engine runs it (k + 1, or
`--corpus-k` + 1 when every draft is that short), at `--width-costs` (widths 2, 3, 5, 9:
`verify_window.py`'s back-to-back prices on the CPU).

Run: ``python benchmarks/ngram_policy.py [--k 4,8] [--window-cost 1.65]`` (about a minute).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from code_speculation import held_out_ids  # noqa: E402
from common import print_table, write_json  # noqa: E402

from serving.engine import LLM  # noqa: E402
from serving.sampling import SamplingParams  # noqa: E402
from serving.speculative.ngram import ngram_lookup  # noqa: E402
from serving.speculative.ngram_table import table_from_corpus  # noqa: E402


def latest_match(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The baseline: what followed the latest earlier match of the longest suffix n-gram."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        for start in range(size - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[size - n :]:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
    return []


def with_corpus(table, corpus_k: int):
    """The vote; where it finds nothing, the corpus table's drafts (at most `corpus_k`)."""

    def policy(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
        return ngram_lookup(tokens, k, max_n, min_n) or table.draft(tokens, min(k, corpus_k))

    return policy


POLICIES = {"latest": latest_match, "vote": ngram_lookup}


def prompt_sets(tokenizer, prompt_len: int, need: int) -> dict[str, list[list[int]]]:
    sets: dict[str, list[list[int]]] = {"start": [], "mid": []}
    for ids in held_out_ids(tokenizer):
        if len(ids) >= prompt_len + need:
            sets["start"].append(ids[:prompt_len])
        for off in range(256, len(ids) - prompt_len - need, 512):
            sets["mid"].append(ids[off : off + prompt_len])
    return sets


def replay(
    policy, prompt: list[int], out: list[int], k: int, max_n: int, min_n: int, price
) -> dict:
    """Windows, drafts, accepted drafts and the windows' price (`price(drafts)`, in plain
    steps) over one continuation; the first token comes from the prefill, as in the engine."""
    seq, pos, end = prompt + out, len(prompt) + 1, len(prompt) + len(out)
    stats = {"tokens": 0, "windows": 0, "plain": 0, "drafts": 0, "accepted": 0, "price": 0.0}
    while pos < end:
        drafts = policy(seq[:pos], k, max_n, min_n)
        accepted = 0
        for draft, truth in zip(drafts, seq[pos:end]):
            if draft != truth:
                break
            accepted += 1
        gain = min(accepted + 1, end - pos)
        pos += gain
        stats["tokens"] += gain
        stats["windows" if drafts else "plain"] += 1
        stats["drafts"] += len(drafts)
        stats["accepted"] += accepted
        stats["price"] += price(len(drafts)) if drafts else 0.0
    return stats


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", default="4,8")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-n", type=int, default=3)
    p.add_argument("--min-n", type=int, default=2)
    p.add_argument("--window-cost", type=float, default=1.65)
    p.add_argument("--width-costs", default="1.24,1.31,1.46,1.96", help="widths 2, 3, 5, 9")
    p.add_argument("--corpus", default="stdlib", help="vote+corpus ('' leaves it out)")
    p.add_argument("--corpus-k", type=int, default=2)
    a = p.parse_args(argv)
    llm = LLM(max_num_seqs=8, num_pages=512, dtype="float32")
    policies = dict(POLICIES)
    if a.corpus:
        policies["vote+corpus"] = with_corpus(
            table_from_corpus(a.corpus, llm.tokenizer), a.corpus_k
        )
    width_cost = dict(zip((2, 3, 5, 9), map(float, a.width_costs.split(",")), strict=True))
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    rows = []
    for set_name, prompts in prompt_sets(llm.tokenizer, a.prompt_len, a.max_tokens).items():
        outs = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        for k in (int(x) for x in a.k.split(",")):
            # As the engine narrows: corpus-k + 1 wide when every draft is that short.
            narrow = a.corpus_k + 1 if a.corpus and a.corpus_k < k else k + 1
            for name, policy in policies.items():

                def price(n, name=name, k=k, narrow=narrow):
                    wide = narrow if name == "vote+corpus" and n < narrow else k + 1
                    return width_cost[wide]

                total = dict.fromkeys(("tokens", "windows", "plain", "drafts", "accepted"), 0)
                total["price"] = 0.0
                for prompt, out in zip(prompts, outs, strict=True):
                    stats = replay(policy, prompt, out, k, a.max_n, a.min_n, price)
                    for key, value in stats.items():
                        total[key] += value
                t = total["tokens"]
                steps = total["plain"] + total["windows"]
                rows.append(
                    {
                        "prompts": f"{set_name} ({len(prompts)})",
                        "k": k,
                        "policy": name,
                        "windows_per_100": 100 * total["windows"] / t,
                        "tokens_per_window": (t - total["plain"]) / max(total["windows"], 1),
                        "acceptance": total["accepted"] / max(total["drafts"], 1),
                        "steps_per_100": 100 * steps / t,
                        "bound": t / (total["plain"] + a.window_cost * total["windows"]),
                        "bound_by_width": t / (total["plain"] + total["price"]),
                    }
                )
    cols = ["prompts", "k", "policy", "windows_per_100", "tokens_per_window", "acceptance"]
    print_table(rows, [*cols, "steps_per_100", "bound", "bound_by_width"])
    keys = ("prompt_len", "max_tokens", "max_n", "min_n", "window_cost", "width_costs")
    meta = {k: getattr(a, k) for k in (*keys, "corpus", "corpus_k")}
    print("wrote", write_json("ngram_policy", rows, meta))
    return rows


if __name__ == "__main__":
    main()
