"""Offline generation throughput of the ``small`` preset: our engine (``serving.engine.LLM``) vs
transformers' ``generate``, float32, CPU, beside the CPU memory roofline.

One random ``small`` model is saved with ``save_pretrained``; our engine and transformers both
load that checkpoint, so both sides run identical weights on identical prompts. For each batch
size B: B random prompts of ``--prompt-len`` ids (seeded, equal lengths, so transformers needs
no padding), greedy, no stop on EOS, a fixed number of new tokens N.

- prefill tok/s = B * prompt_len / time(generate with 1 new token);
- decode tok/s  = B * (N - 1) / (time(generate with N new tokens) - time(... 1 new token)).

Each shape is generated once untimed first (our engine compiles per bucket shape; transformers'
first call warms its allocator). Timed calls alternate between the two sides so that machine
noise hits both alike; each figure is the fastest of ``--repeats`` calls.

Roofline: bytes of weights a decode step must read at batch B (see ``weight_bytes_per_step``)
over the memory bandwidth measured in the same run (numpy copy of a 512 MiB array, read +
write bytes, best of several), so roofline tok/s = B / (bytes per step / bandwidth).

The greedy tokens of both sides are compared row by row (reported, not asserted: random f32
weights give near-ties that summation order can flip).

Run from the repo root: ``python benchmarks/throughput.py [--batches 1,8,32]
[--prompt-len 64] [--max-tokens 32] [--repeats 1] [--quick]``.
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_forward import load_transformers  # noqa: E402
from common import print_table, write_json  # noqa: E402
from flax import nnx  # noqa: E402

from kimi_linear_jax.checkpoint import save_pretrained  # noqa: E402
from kimi_linear_jax.config import KimiLinearConfig, preset  # noqa: E402
from kimi_linear_jax.testing import random_model  # noqa: E402
from serving.engine import LLM  # noqa: E402
from serving.sampling import SamplingParams  # noqa: E402

COLUMNS = [
    "B",
    "ours_prefill_tok_s",
    "hf_prefill_tok_s",
    "prefill_ratio",
    "ours_decode_tok_s",
    "hf_decode_tok_s",
    "decode_ratio",
    "roofline_decode_tok_s",
    "ours/roofline",
    "greedy_rows_equal",
]
FUSED_STEPS = 8  # `num_scheduler_steps` for the extra column, when LLM accepts it


# ---- roofline ----------------------------------------------------------------------------------
def memory_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> dict:
    """Host memory bandwidth: ``np.copyto`` of an ``nbytes`` array, bytes read + written over
    the fastest of ``repeats`` copies (numpy copies on one thread)."""
    src = np.ones(nbytes // 8, np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch the pages of dst
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return {
        "bandwidth_GBps": 2 * src.nbytes / min(times) / 1e9,
        "bandwidth_median_GBps": 2 * src.nbytes / float(np.median(times)) / 1e9,
        "bandwidth_copy_MiB": src.nbytes / 2**20,
    }


def expected_experts(config: KimiLinearConfig, b: int) -> float:
    """Expected distinct routed experts that one MoE layer touches for b tokens.

    Each token picks k distinct experts of E; under uniform, independent routing an expert is
    missed by one token with probability 1 - k/E, so the expected count is
    E * (1 - (1 - k/E)^b): exactly k at b = 1, never more than min(E, b*k), -> E for large b.
    """
    e, k = config.num_experts, config.num_experts_per_token
    return e * (1.0 - (1.0 - k / e) ** b)


def weight_bytes_per_step(model, b: int) -> dict:
    """Weight bytes one decode step of b rows must read at least: every dense weight once, b
    rows of the embedding table, and of each MoE layer's routed experts only the expected
    distinct ones (``expected_experts``); shared experts, router, norms, attention and lm_head
    in full."""
    config = model.config
    frac = expected_experts(config, b) / config.num_experts
    dense = experts = embed = 0
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = [str(p) for p in path]
        nbytes = int(np.prod(var.shape)) * jnp.dtype(var.dtype).itemsize
        if "embed_tokens" in names:
            embed += nbytes * min(b, var.shape[0]) // var.shape[0]
        elif "experts" in names and "shared_experts" not in names:
            experts += nbytes
        else:
            dense += nbytes
    total = dense + embed + experts * frac
    return {
        "weight_bytes_per_step": total,
        "expert_bytes_all": experts,
        "expected_distinct_experts": expected_experts(config, b),
    }


def state_bytes_per_step(config: KimiLinearConfig, b: int, ctx: float, itemsize: int) -> float:
    """Cache bytes a decode step moves besides weights (not in the roofline, recorded beside
    it): each KDA layer reads and writes its [H, K, V] state per row; each MLA layer reads ctx
    latent + rope entries per row."""
    kda = len(config.kda_layer_ids) * 2 * config.linear_num_heads * config.linear_head_dim**2
    mla = len(config.mla_layer_ids) * ctx * (config.kv_lora_rank + config.qk_rope_head_dim)
    return b * (kda + mla) * itemsize


# ---- the two sides -----------------------------------------------------------------------------
def make_llm(path: str, batches: list[int], prompt_len: int, max_tokens: int, **extra) -> LLM:
    """Our engine sized so that the largest batch prefills in one step and decodes together.

    Choice: no chunking. ``max_num_batched_tokens = max(B) * prompt_len`` and ``chunk_size =
    prompt_len``, so all prompts prefill in a single [B, prompt_len] call (one compiled shape
    per B) and every later step is one decode of all B rows. Pages: enough for every row's
    prompt + max_tokens, plus the null page. Batch buckets are exactly the measured batch sizes
    and the one token bucket is prompt_len, so no row or token padding is timed.
    """
    top = max(batches)
    page_size = 16
    pages_per_seq = math.ceil((prompt_len + max_tokens) / page_size)
    return LLM(
        path,
        dtype="float32",
        max_num_seqs=top,
        page_size=page_size,
        num_pages=top * pages_per_seq + 2,
        max_num_batched_tokens=top * prompt_len,
        # Block tables as wide as a request needs: the MLA decode gathers every page of a row's
        # table, so the pool-wide default (num_pages - 1) would add reads the roofline omits.
        max_model_len=prompt_len + max_tokens,
        chunk_size=prompt_len,
        batch_buckets=sorted(set(batches)),
        token_buckets=(prompt_len,),
        # Timed runs repeat the warm-up's prompts: a prefix-cache hit would change (and
        # compile) what is timed. Prefix caching has its own benchmark (prefix_cache.py).
        enable_prefix_caching=False,
        **extra,
    )


# Newer engines draw a progress bar per generate call; keep it out of the timings.
_NO_TQDM = {"use_tqdm": False} if "use_tqdm" in inspect.signature(LLM.generate).parameters else {}


def ours_generate(llm: LLM, prompts: np.ndarray, n: int) -> tuple[float, np.ndarray]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, seed=0)
    t0 = time.perf_counter()
    outs = llm.generate([p.tolist() for p in prompts], params, **_NO_TQDM)
    dt = time.perf_counter() - t0
    return dt, np.array([o.token_ids for o in outs], np.int64)


def hf_generate(tmodel, prompts, n: int) -> tuple[float, np.ndarray]:
    import torch

    ids = torch.as_tensor(prompts, dtype=torch.long)
    mask = torch.ones_like(ids)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = tmodel.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
        )
    dt = time.perf_counter() - t0
    return dt, out[:, prompts.shape[1] :].numpy().astype(np.int64)


def _rates(b: int, prompt_len: int, n: int, t1: float, tn: float) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) from the 1-token and n-token generate times."""
    decode = b * (n - 1) / (tn - t1) if n > 1 and tn > t1 else float("nan")
    return b * prompt_len / t1, decode


def measure(name, fn, b, prompt_len, n, repeats, row) -> np.ndarray | None:
    """Time ``fn(1)`` and ``fn(n)`` (fastest of repeats) into ``row[name_*]``; returns the
    n-token ids, or None (error recorded in the row) when the side fails."""
    try:
        t1 = min(fn(1)[0] for _ in range(repeats))
        tn, tokens = math.inf, None
        for _ in range(repeats):
            dt, got = fn(n)
            if dt < tn:
                tn, tokens = dt, got
    except Exception as e:  # noqa: BLE001 - report any failure of one side in the table
        row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
        row[f"{name}_prefill_tok_s"] = row[f"{name}_decode_tok_s"] = "error"
        print(f"  {name} failed at B={b}: {row[f'{name}_error']}", flush=True)
        return None
    prefill, decode = _rates(b, prompt_len, n, t1, tn)
    row.update(
        {
            f"{name}_t1_s": t1,
            f"{name}_tn_s": tn,
            f"{name}_prefill_tok_s": prefill,
            f"{name}_decode_tok_s": decode,
            f"{name}_decode_ms_per_step": 1e3 * (tn - t1) / (n - 1) if n > 1 else float("nan"),
        }
    )
    return tokens


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=64)
    # 16, not the issue's 32: transformers' pure-torch KDA fallback needs ~4 s per decode step
    # at B = 32 on the 2-core development machine, and the whole run should stay < 15 min.
    p.add_argument("--max-tokens", type=int, default=16, help="new tokens per row (N)")
    p.add_argument("--repeats", type=int, default=1, help="timed calls per side and shape")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--quick", action="store_true", help="smoke run: B 1,2, prompt 16, N 8")
    a = p.parse_args(argv)
    if a.quick:
        a.batches, a.prompt_len, a.max_tokens = "1,2", 16, 8
    batches = sorted({int(x) for x in a.batches.split(",") if x.strip()})
    n = a.max_tokens
    if n < 2:
        p.error("--max-tokens must be >= 2 (decode = N-token minus 1-token time)")

    import torch
    import transformers

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    t_start = time.perf_counter()

    bw = memory_bandwidth()
    print(f"memory bandwidth (numpy copy): {bw['bandwidth_GBps']:.2f} GB/s", flush=True)

    config = preset("small")
    model = random_model(config, seed=a.seed, dtype=jnp.float32)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    fused = "num_scheduler_steps" in inspect.signature(LLM.__init__).parameters
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp)
        llm = make_llm(tmp, batches, a.prompt_len, n)
        llm_fused = (
            make_llm(tmp, batches, a.prompt_len, n, num_scheduler_steps=FUSED_STEPS)
            if fused
            else None
        )
        tmodel = None if a.no_hf else load_transformers(tmp)
    if tmodel is not None:
        # No EOS at all: nothing stops early and no logits processor masks EOS, like ours
        # with ignore_eos=True (min_new_tokens is then a no-op kept for clarity).
        tmodel.generation_config.eos_token_id = None
        tmodel.generation_config.pad_token_id = config.pad_token_id
    print(
        f"small preset: {n_params / 1e6:.1f}M parameters; torch threads = {threads}; "
        f"fused-step column: {'yes' if fused else 'no (LLM has no num_scheduler_steps)'}",
        flush=True,
    )

    rng = np.random.default_rng(a.seed)
    rows = []
    for b in batches:
        prompts = rng.integers(0, config.vocab_size, (b, a.prompt_len), dtype=np.int64)
        row: dict = {"B": b, "prompt_len": a.prompt_len, "max_tokens": n}
        sides = {"ours": lambda k, prompts=prompts: ours_generate(llm, prompts, k)}
        if llm_fused is not None:
            sides["ours_fused"] = lambda k, prompts=prompts: ours_generate(llm_fused, prompts, k)
        if tmodel is not None:
            sides["hf"] = lambda k, prompts=prompts: hf_generate(tmodel, prompts, k)
        # Warm-up with the timed shape: compiles our [B, prompt_len] prefill and every decode
        # shape the N-token run uses (with fused steps, possibly several step counts).
        for name, fn in list(sides.items()):
            t0 = time.perf_counter()
            try:
                # transformers compiles nothing: 2 tokens warm its prefill and decode paths.
                fn(2 if name == "hf" else n)
            except Exception as e:  # noqa: BLE001 - measure() records it again below
                print(f"  warm-up of {name} failed: {type(e).__name__}: {e}", flush=True)
            row[f"{name}_warmup_s"] = time.perf_counter() - t0
        tokens = {
            name: measure(name, fn, b, a.prompt_len, n, a.repeats, row)
            for name, fn in sides.items()
        }
        if tokens.get("ours") is not None and tokens.get("hf") is not None:
            ours_t, hf_t = tokens["ours"], tokens["hf"]
            equal = (ours_t == hf_t).all(axis=1)
            first_diff = [
                int(np.argmax(o != h)) if not e else n
                for o, h, e in zip(ours_t, hf_t, equal, strict=True)
            ]
            row["greedy_rows_equal"] = f"{int(equal.sum())}/{b}"
            row["greedy_first_diff"] = first_diff
        for name in ("ours", "ours_fused"):
            if isinstance(row.get(f"{name}_prefill_tok_s"), float) and isinstance(
                row.get("hf_prefill_tok_s"), float
            ):
                row[f"{name}/hf_prefill"] = row[f"{name}_prefill_tok_s"] / row["hf_prefill_tok_s"]
                row[f"{name}/hf_decode"] = row[f"{name}_decode_tok_s"] / row["hf_decode_tok_s"]
        row["prefill_ratio"] = row.get("ours/hf_prefill", "")
        row["decode_ratio"] = row.get("ours/hf_decode", "")
        wb = weight_bytes_per_step(model, b)
        row.update(wb)
        row["roofline_decode_tok_s"] = b / (
            wb["weight_bytes_per_step"] / 1e9 / bw["bandwidth_GBps"]
        )
        ctx = a.prompt_len + n / 2  # mean context over the decode steps
        sb = state_bytes_per_step(config, b, ctx, 4)
        row["state_bytes_per_step"] = sb
        row["roofline_with_state_tok_s"] = b / (
            (wb["weight_bytes_per_step"] + sb) / 1e9 / bw["bandwidth_GBps"]
        )
        if isinstance(row.get("ours_decode_tok_s"), float):
            row["ours/roofline"] = row["ours_decode_tok_s"] / row["roofline_decode_tok_s"]
        if isinstance(row.get("ours_fused_decode_tok_s"), float):
            row["ours_fused/roofline"] = (
                row["ours_fused_decode_tok_s"] / row["roofline_decode_tok_s"]
            )
        rows.append(row)
        print(f"done: B={b} ({time.perf_counter() - t_start:.0f} s so far)", flush=True)

    columns = list(COLUMNS)
    if fused:
        columns[columns.index("decode_ratio") + 1 : columns.index("decode_ratio") + 1] = [
            "ours_fused_decode_tok_s",
            "ours_fused/hf_decode",
        ]
    print()
    print_table(rows, columns)
    wall = time.perf_counter() - t_start
    path = write_json(
        "throughput",
        rows,
        {
            "preset": "small",
            "n_params": n_params,
            "dtype": "float32",
            "prompt_len": a.prompt_len,
            "max_tokens": n,
            "batches": batches,
            "repeats": a.repeats,
            "quick": a.quick,
            "torch_version": torch.__version__,
            "transformers_version": transformers.__version__,
            "torch_num_threads": threads,
            "fused_steps_column": fused,
            "wall_s": wall,
            **bw,
            "note": (
                "prefill tok/s = B*prompt_len / t(1 new token); decode tok/s = B*(N-1) / "
                "(t(N new tokens) - t(1 new token)); fastest of `repeats` calls, warm-up and "
                "compilation excluded; greedy, no EOS stop. roofline tok/s = B / (weight bytes "
                "per decode step / numpy-copy bandwidth), with routed experts counted as "
                "E*(1-(1-k/E)^B) expected distinct experts per MoE layer; "
                "roofline_with_state adds KDA state read+write and MLA cache reads."
            ),
        },
    )
    print(f"\nwall {wall:.0f} s; wrote {os.path.relpath(path)}")
    return rows


if __name__ == "__main__":
    main()
