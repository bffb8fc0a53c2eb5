"""Decode: offline generation against transformers and the memory roofline, where a decode
step's time goes, async against sync scheduling, decode time against the pools' size, float32
against bfloat16.

    python -m benchmarks decode [--only throughput profile async pools dtype] [--quick]

Every engine is greedy with EOS ignored, float32 unless said, and compiled before it is timed.
"""

from __future__ import annotations

import collections
import functools
import glob
import gzip
import json
import os
import re
import resource
import statistics
import tempfile
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import serving.runner as runner_mod
from benchmarks.harness import Suite, Table, add_ratio, batch_shapes, interleaved, ints, repeats
from kimi_linear_jax.checkpoint import save_pretrained
from kimi_linear_jax.config import KimiLinearConfig
from kimi_linear_jax.presets import preset
from kimi_linear_jax.testing import random_model
from serving.core.decode import decode_steps
from serving.core.sampling import SamplingParams
from serving.core.scheduler_output import Placement
from serving.engine import LLM

SUITE = Suite("decode", __doc__)
SUITE.option("--batches", help="batch sizes, e.g. 1,8,32 (each measure has its default)")
SUITE.option("--preset", help="throughput, profile: the model's preset (small; --quick tiny)")
SUITE.option("--prompt-len", type=int, help="throughput: prompt ids per row (64)")
SUITE.option("--max-tokens", type=int, help="new tokens per row (throughput 16, async 64)")
SUITE.option("--fused-steps", type=int, default=8, help="throughput: fused column's steps")
SUITE.option("--torch-threads", default="1,2", help="throughput: transformers' thread counts")
SUITE.option("--no-hf", action="store_true", help="throughput: leave transformers out")
SUITE.option("--dump-hlo", metavar="DIR", help="profile: write the optimized HLO here")


# ---- the weight roofline ----------------------------------------------------------------------
def memory_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Host memory bandwidth, GB/s: ``np.copyto`` of an ``nbytes`` array, bytes read + written
    over the fastest of ``repeats`` copies (numpy copies on one thread)."""
    src = np.ones(nbytes // 8, np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch the pages of dst
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return 2 * src.nbytes / min(times) / 1e9


def expected_experts(config: KimiLinearConfig, b: int) -> float:
    """Expected distinct routed experts one MoE layer reads for b tokens under uniform,
    independent routing: E * (1 - (1 - k/E)^b)."""
    e, k = config.num_experts, config.num_experts_per_token
    return e * (1.0 - (1.0 - k / e) ** b)


def weight_bytes_per_step(model, b: int) -> float:
    """Weight bytes a decode step of b rows must read at least: every dense weight once, b
    embedding rows, and of each MoE layer's routed experts only the expected distinct ones."""
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
    return dense + embed + experts * frac


def count_params(model) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


# ---- throughput -------------------------------------------------------------------------------
def load_transformers(path: str):
    """transformers' `KimiLinearForCausalLM` on a checkpoint of ours, float32, eval mode."""
    import torch
    import transformers

    model = transformers.KimiLinearForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


class Timing(NamedTuple):
    """One generate call: time to every row's first token, time from there to the last."""

    prefill_s: float
    decode_s: float
    tokens: np.ndarray


def ours_generate(llm: LLM, prompts: np.ndarray, n: int) -> Timing:
    """``LLM.generate``'s loop (add every request, ``step()`` until done) with a timestamp after
    each step; every row prefills in the first step (see ``throughput_engine``)."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, seed=0)
    t0 = time.perf_counter()
    rids = [llm.add_request(p.tolist(), params) for p in prompts]
    stamps, tokens = [], {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            tokens[out.request_id] = out.token_ids
        stamps.append(time.perf_counter())
    if any(len(tokens[r]) != n for r in rids):
        raise RuntimeError(f"expected {n} tokens per row")
    return Timing(stamps[0] - t0, stamps[-1] - stamps[0], np.array([tokens[r] for r in rids]))


def hf_generate(tmodel, prompts: np.ndarray, n: int, threads: int) -> Timing:
    """transformers' ``generate`` on ``threads`` torch threads, a logits processor stamping the
    time of each new token's logits (the first follows the prefill)."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    stamps: list[float] = []

    class Stamp(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    ids = torch.as_tensor(prompts, dtype=torch.long)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = tmodel.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            logits_processor=transformers.LogitsProcessorList([Stamp()]),
        )
    if len(stamps) != n:
        raise RuntimeError(f"expected {n} logits calls, got {len(stamps)}")
    return Timing(stamps[0] - t0, stamps[-1] - stamps[0], out[:, prompts.shape[1] :].numpy())


def throughput_engine(path: str, batches: list[int], prompt_len: int, n: int, **extra) -> LLM:
    """An engine whose largest batch prefills in one [B, prompt_len] call and then decodes
    together: no chunking, batch buckets the measured batch sizes, one token bucket, block
    tables as wide as a request needs, prefix caching off (timed runs repeat prompts)."""
    return LLM(
        path,
        **batch_shapes(batches, prompt_len, n),
        **extra,
    )


@SUITE.measure("throughput")
def throughput(args) -> Table:
    """Offline generation, ours against transformers' generate on the same checkpoint, and the
    weight roofline.

    One random checkpoint (``small``, float32) loaded by our engine (unfused; fused
    ``num_scheduler_steps``; async scheduling) and by transformers (pure-torch KDA, each
    ``--torch-threads`` count, the faster reported). B prompts of ``--prompt-len`` random ids,
    N new tokens. Both spans are timed inside each call: prefill = time to every row's first
    token, decode = first to last token (N - 1 steps, host work included). Best of N, the
    sides taking turns. Roofline tok/s = B / (weight bytes a step must read / numpy-copy
    bandwidth, the faster of before and after the timings).
    """
    quick = args.quick
    name = args.preset or ("tiny" if quick else "small")
    batches = ints(args.batches or ("1,2" if quick else "1,8,32"))
    prompt_len = args.prompt_len or (16 if quick else 64)
    n = args.max_tokens or (8 if quick else 16)
    rounds = repeats(args, 3, 2)
    threads = ints(args.torch_threads)
    bandwidth = memory_bandwidth()
    config = preset(name)
    model = random_model(config, seed=0, dtype=jnp.float32)
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp)
        engines = {"ours": throughput_engine(tmp, batches, prompt_len, n)}
        if args.fused_steps > 1:
            fused = dict(num_scheduler_steps=args.fused_steps)
            engines["fused"] = throughput_engine(tmp, batches, prompt_len, n, **fused)
        engines["async"] = throughput_engine(tmp, batches, prompt_len, n, async_scheduling=True)
        tmodel = None if args.no_hf else load_transformers(tmp)
    if tmodel is not None:  # nothing stops early, like ours with ignore_eos
        tmodel.generation_config.eos_token_id = None
        tmodel.generation_config.pad_token_id = config.pad_token_id
    rng = np.random.default_rng(0)
    rows = []
    for b in batches:
        prompts = rng.integers(0, config.vocab_size, (b, prompt_len), dtype=np.int64)
        sides = {k: functools.partial(ours_generate, e, prompts, n) for k, e in engines.items()}
        for t in threads if tmodel is not None else ():
            sides[f"hf_{t}t"] = functools.partial(hf_generate, tmodel, prompts, n, t)
        runs = interleaved(sides, warmup=1, repeats=rounds)
        row: dict = {"B": b, "prompt_len": prompt_len, "max_tokens": n}
        for side, r in runs.items():
            row[f"{side}_prefill_tok_s"] = b * prompt_len / min(t.prefill_s for t in r.results)
            row[f"{side}_decode_tok_s"] = b * (n - 1) / min(t.decode_s for t in r.results)
            row[f"{side}_decode_all_s"] = [t.decode_s for t in r.results]
        for fig in ("prefill", "decode"):
            hf = {t: row[f"hf_{t}t_{fig}_tok_s"] for t in threads if f"hf_{t}t" in runs}
            if hf:
                best = max(hf, key=hf.get)
                row[f"hf_{fig}_tok_s"], row[f"hf_{fig}_threads"] = hf[best], best
        if tmodel is not None:
            ours_t, hf_t = runs["ours"].results[-1].tokens, runs[f"hf_{threads[0]}t"].results[-1]
            equal = (ours_t == hf_t.tokens).all(axis=1)
            row["greedy_rows_equal"] = f"{int(equal.sum())}/{len(equal)}"
        row["ms_per_step"] = 1e3 * b / row["ours_decode_tok_s"]
        row["weight_MB"] = weight_bytes_per_step(model, b) / 1e6
        rows.append(row)
    bandwidth = max(bandwidth, memory_bandwidth())
    for row in rows:
        row["roofline_tok_s"] = row["B"] / (row["weight_MB"] / 1e3 / bandwidth)
        for side in engines:
            row[f"{side}/roofline"] = row[f"{side}_decode_tok_s"] / row["roofline_tok_s"]
            if "hf_decode_tok_s" in row:
                row[f"{side}/hf"] = row[f"{side}_decode_tok_s"] / row["hf_decode_tok_s"]
        if "hf_prefill_tok_s" in row:
            row["prefill ours/hf"] = row["ours_prefill_tok_s"] / row["hf_prefill_tok_s"]
    columns = ["B", "ours_decode_tok_s", "ms_per_step", "hf_decode_tok_s", "hf_decode_threads"]
    columns += [f"{s}/hf" for s in engines] + ["roofline_tok_s"]
    columns += [f"{s}/roofline" for s in engines] + ["prefill ours/hf", "greedy_rows_equal"]
    meta = {"preset": name, "n_params": count_params(model), "bandwidth_GBps": bandwidth}
    meta.update(fused_steps=args.fused_steps, torch_threads=threads, repeats=rounds)
    if tmodel is not None:
        import torch
        import transformers

        meta.update(torch=torch.__version__, transformers=transformers.__version__)
    title = (
        f"decode tok/s, {name} ({meta['n_params'] / 1e6:.1f}M parameters, f32), prompt "
        f"{prompt_len}, {n} new tokens, best of {rounds}; hf = transformers; roofline at "
        f"{bandwidth:.1f} GB/s"
    )
    return Table(title, rows, columns, meta)


# ---- profile: where a decode step's time goes -------------------------------------------------
# Parts of the step, matched against an op's source stack from the innermost frame out.
STACK_RULES = [
    ("sampling (argmax)", ("_pick",)),
    ("KDA state commit", ("commit_kda", "scatter_rows")),
    ("KDA state gather", ("state_rows",)),
    ("MoE routed experts", ("Experts.",)),
    ("MoE router", ("Router.", "_sort_by_expert")),
    ("MoE shared expert", ("MoE.__call__",)),
    ("dense MLP (layer 0)", ("MLP.__call__",)),
    ("MLA attention", ("MLA.", "paged_attention", "mla_paged_attention")),
    ("KDA recurrence", ("kda_window", "_run_steps", "_delta_step")),
    ("KDA projections, conv, norms", ("KDA.",)),
    ("final norm + lm_head", ("_logits",)),
    ("embedding", ("Embed.",)),
    ("block norms + residuals", ("DecoderBlock.",)),
]
# Ops without a source stack (XLA's own copies, rewritten dots): by the parameter they read.
PARAM_RULES = [
    ("XLA copy of an MLA latent pool", "cache_mla"),
    ("XLA copy of a KDA state pool", "cache_kda"),
    ("MoE shared expert", "shared_experts"),
    ("MoE routed experts", "experts"),
    ("dense MLP (layer 0)", "___mlp___"),
    ("final norm + lm_head", "lm_head"),
    ("embedding", "embed_tokens"),
]
_OP = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
_LAYER_ATTN = re.compile(r"layers___(\d+)___self_attn")
CALL_MARK = "decode_profile_call"  # the profiler annotation around each traced call


def _section(text: str, name: str, end: str | None) -> list[str]:
    a = text.index(f"\n{name}\n") + len(name) + 2
    b = text.index(f"\n{end}\n", a) if end else text.index("\n\n", a)
    return text[a:b].strip().splitlines()


def stack_functions(text: str):
    """stack_frame_id -> the function names of its frames, innermost first (from the tables
    XLA prints before the optimized HLO)."""
    funcs = {
        int(x.split()[0]): x.split(None, 1)[1].strip('"')
        for x in _section(text, "FunctionNames", "FileLocations")
    }
    locs = {}
    for line in _section(text, "FileLocations", "StackFrames"):
        m = re.match(r"(\d+) \{file_name_id=\d+ function_name_id=(\d+)", line)
        locs[int(m[1])] = int(m[2])
    frames = {}
    for line in _section(text, "StackFrames", None):
        m = re.match(r"(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)", line)
        if m:  # a parent id is one more than the id the table prints (0: none)
            frames[int(m[1])] = (int(m[2]), int(m[3]) - 1)

    def chain(fid: int) -> list[str]:
        out, seen = [], set()
        while fid in frames and fid not in seen:
            seen.add(fid)
            loc, fid = frames[fid]
            out.append(funcs[locs[loc]])
        return out

    return chain


def classify(text: str, layer_kinds) -> dict[str, str]:
    """Op name -> part of the model: by its source stack, else by what it reads."""
    chain = stack_functions(text)
    parts: dict[str, str] = {}
    for line in text.splitlines():
        m = _OP.match(line)
        if not m:
            continue
        name, _, _, rest = m.groups()
        frame = re.search(r"stack_frame_id=(\d+)", rest)
        funcs = chain(int(frame[1])) if frame else []
        if any("MLP.__call__" in f for f in funcs) and any("MoE.__call__" in f for f in funcs):
            part = "MoE shared expert"
        else:
            part = next(
                (p for f in funcs for p, keys in STACK_RULES if any(k in f for k in keys)), None
            )
        if part is None:
            operands = rest.split("), ")[0]
            names = re.findall(r"%([\w.\-]+)", operands)
            copied = [parts[n] for n in names if parts.get(n, "").startswith("XLA copy")]
            attn = _LAYER_ATTN.search(operands)
            if copied:
                part = copied[0]
            elif attn:
                mla = layer_kinds[int(attn[1])] == "mla"
                part = "MLA attention" if mla else "KDA projections, conv, norms"
            else:
                part = next((p for p, key in PARAM_RULES if key in operands), "other")
        parts[name] = part
    return parts


def self_times(ops: list[dict]) -> dict[str, float]:
    """Self time (us) per op: its duration minus the ops nested in it on its thread."""
    out: dict[str, float] = collections.defaultdict(float)
    by_thread = collections.defaultdict(list)
    for e in ops:
        by_thread[e["tid"]].append(e)
    for evs in by_thread.values():
        stack: list[dict] = []
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                out[stack[-1]["name"]] -= e["dur"]
            out[e["name"]] += e["dur"]
            stack.append(e)
    return out


def traced_op_ms(trace_dir: str, op_names: set[str]) -> dict[str, float]:
    """Per op, the median over the traced calls of its self time (ms)."""
    path = sorted(
        glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    )
    with gzip.open(path[-1]) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    events = [e for e in events if e.get("ph") == "X"]
    windows = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == CALL_MARK)
    ops = [e for e in events if e["name"] in op_names]
    per_call = [self_times([e for e in ops if lo <= e["ts"] <= hi]) for lo, hi in windows]
    names = set().union(*per_call)
    return {n: statistics.median(c.get(n, 0.0) for c in per_call) / 1e3 for n in names}


def engine_steps(llm: LLM, b: int, prompt_len: int, steps: int, seed: int):
    """Per decode step: the wall time of ``LLM.step()`` and of the compiled decode inside it;
    and the last compiled decode's arguments."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for _ in range(b):
        llm.add_request(rng.integers(0, llm.config.vocab_size, prompt_len).tolist(), params)
    llm.step()  # prefill: every row's first token
    captured, calls, real = {}, [], runner_mod.decode_steps

    def recorder(*a, **kw):
        captured.update(args=a, kwargs=kw)
        t0 = time.perf_counter()
        out = jax.block_until_ready(real(*a, **kw))  # the runner reads it next anyway
        calls.append(time.perf_counter() - t0)
        return out

    step_times = []
    runner_mod.decode_steps = recorder
    try:
        while llm.has_unfinished_requests():
            t0 = time.perf_counter()
            llm.step()
            step_times.append(time.perf_counter() - t0)
    finally:
        runner_mod.decode_steps = real
    return step_times, calls, captured


def compiled_calls(llm: LLM, captured: dict, n: int) -> None:
    """n calls of the captured compiled decode, the cache fed back, each marked for the
    profiler."""
    a, kw = captured["args"], captured["kwargs"]
    cache = llm.runner.cache
    for _ in range(n):
        with jax.profiler.TraceAnnotation(CALL_MARK):
            picked, _, cache = runner_mod.decode_steps(*a[:3], cache, *a[4:], **kw)
            jax.block_until_ready(picked)
    llm.runner.cache = cache


@SUITE.measure("profile")
def profile(args) -> list[Table]:
    """Where a decode step's time goes: engine step, compiled call, host, and per part of the
    model (XLA op self time from a profiler trace).

    An engine (``small``, random weights, prefix caching off) prefills B prompts of 64 ids,
    then times each ``LLM.step()`` and the compiled decode inside it (host = step - call, same
    step), best of N runs by their median step. A
    ``jax.profiler`` trace of compiled calls with the last step's arguments gives each op's
    self time, attributed to a part of the model by its source stack in the optimized HLO. Two
    XLA threads run ops concurrently: read the shares. Also XLA's temp bytes, the minor page
    faults per call and the weight roofline at the bandwidth measured here.
    """
    quick = args.quick
    name = args.preset or ("tiny" if quick else "small")
    batches = ints(args.batches or ("1" if quick else "1,8,32"))
    steps, prompt_len, traced = (8, 16, 4) if quick else (24, 64, 20)
    rounds = repeats(args, 3, 1)
    bandwidth = memory_bandwidth()
    model = random_model(preset(name), dtype=jnp.float32)
    summary, tables = [], []
    for b in batches:
        llm = LLM(
            model,
            max_num_seqs=b,
            batch_buckets=(b,),
            token_buckets=(prompt_len,),
            chunk_size=prompt_len,
            max_num_batched_tokens=b * prompt_len,
            max_model_len=prompt_len + steps + 8,
            enable_prefix_caching=False,
        )
        engine_steps(llm, b, prompt_len, steps, seed=0)  # compile prefill and decode
        runs = [engine_steps(llm, b, prompt_len, steps, seed=r + 1) for r in range(rounds)]
        captured = runs[-1][2]
        a, kw = captured["args"], captured["kwargs"]
        compiled = runner_mod.decode_steps.lower(*a[:3], llm.runner.cache, *a[4:], **kw).compile()
        text = compiled.as_text()
        parts = classify(text, llm.config.layer_kinds)
        compiled_calls(llm, captured, 2)  # warm, outside the trace
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        compiled_calls(llm, captured, 10)
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / 10
        with tempfile.TemporaryDirectory() as tmp:
            jax.profiler.start_trace(tmp, create_perfetto_trace=True)
            compiled_calls(llm, captured, traced)
            jax.profiler.stop_trace()
            op_ms = traced_op_ms(tmp, set(parts))
        by_part: dict[str, float] = collections.defaultdict(float)
        for op, ms in op_ms.items():
            by_part[parts[op]] += ms
        total = sum(by_part.values())
        rows = [
            {"part": p, "ms_per_step": ms, "share": ms / total}
            for p, ms in sorted(by_part.items(), key=lambda kv: -kv[1])
        ]
        tables.append(Table(f"B = {b}: op time per decode step by part", rows, list(rows[0])))
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        engine_ms = min(statistics.median(s) for s, _, _ in runs) * 1e3
        row = {
            "B": b,
            "engine_step_ms": engine_ms,
            "compiled_call_ms": min(statistics.median(c) for _, c, _ in runs) * 1e3,
            "host_ms": min(statistics.median(np.subtract(s, c)) for s, c, _ in runs) * 1e3,
            "ops_sum_ms": total,
            "roofline_ms": weight_bytes_per_step(llm.model, b) / 1e9 / bandwidth * 1e3,
            "xla_bytes_MB": float(cost.get("bytes accessed", float("nan"))) / 1e6,
            "xla_temp_MB": compiled.memory_analysis().temp_size_in_bytes / 1e6,
            "page_faults_per_call": faults,
        }
        row["host/engine"] = row["host_ms"] / engine_ms
        row["roofline/engine"] = row["roofline_ms"] / engine_ms
        summary.append(row)
        if args.dump_hlo:
            os.makedirs(args.dump_hlo, exist_ok=True)
            with open(os.path.join(args.dump_hlo, f"decode_{name}_B{b}.hlo.txt"), "w") as f:
                f.write(text)
    title = f"decode step, {name}, ms (best of {rounds} runs of {steps} steps)"
    meta = {"preset": name, "bandwidth_GBps": bandwidth, "traced_calls": traced}
    return [Table(title, summary, list(summary[0]), meta), *tables]


# ---- async scheduling -------------------------------------------------------------------------
DEVICE_STEPS = 32  # back-to-back steps of the device-only loop


class Probe:
    """Times one engine runner's decode dispatches and token fetches."""

    def __init__(self, runner) -> None:
        self.dispatches: list[tuple[float, float]] = []
        self.collects: list[tuple[float, float]] = []
        for name, log in (("dispatch_decode", self.dispatches), ("collect", self.collects)):
            setattr(runner, name, self._timed(getattr(runner, name), log))

    @staticmethod
    def _timed(fn, log):
        def timed(*a):
            t0 = time.perf_counter()
            out = fn(*a)
            log.append((t0, time.perf_counter()))
            return out

        return timed

    def stats(self) -> dict:
        """Steps, their wall time, host time outside fetches, and the mean host gap (fetch of
        step n done -> dispatch of step n + 1 done)."""
        d, c = self.dispatches, self.collects
        gaps = [max(0.0, d[i + 1][1] - c[i][1]) for i in range(min(len(c), len(d) - 1))]
        wall = c[-1][1] - d[0][0]
        out = dict(steps=len(d), wall_s=wall)
        out["host_ms_per_step"] = (wall - sum(b - a for a, b in c)) / len(d) * 1e3
        out["host_gap_ms"] = statistics.mean(gaps) * 1e3 if gaps else 0.0
        self.dispatches.clear()
        self.collects.clear()
        return out


def device_loop(llm: LLM, batch: int, context: int):
    """The engine's compiled greedy decode step, back to back, each feeding the next on the
    device: a step's device time with no host work between. It writes into slots 1..batch and
    the first pages (the prefix cache emptied first; a later request rewrites what it reads)."""
    runner = llm.runner
    each = llm.cache.pages_for(context + 1)
    rows = [
        Placement(1 + i, tuple(range(1 + i * each, 1 + (i + 1) * each)), context, 1)
        for i in range(batch)
    ]

    def run():
        llm.reset_prefix_cache()
        b, placed = runner.buckets.batch(rows)
        sampling = runner.buckets.sampling([None] * batch, b, "greedy")
        ids, steps_left = jnp.zeros(b, jnp.int32), jnp.ones(b, jnp.int32)
        for _ in range(DEVICE_STEPS):
            picked, _, runner.cache = decode_steps(
                runner.graphdef,
                runner.params,
                ids,
                runner.cache,
                placed,
                steps_left,
                *sampling,
                num_steps=1,
                mode="greedy",
            )
            ids = picked[0][:, 0]
        return ids

    return run


def probed_generate(llm: LLM, probe: Probe, prompts, params) -> dict:
    """One ``generate``, with the probe's stats and the steps that overlapped the next."""
    before = llm.metrics().get("overlapped_steps", 0)
    llm.generate(prompts, params, use_tqdm=False)
    overlapped = llm.metrics().get("overlapped_steps", 0) - before
    return {**probe.stats(), "overlapped_steps": overlapped}


@SUITE.measure("async")
def async_scheduling(args) -> Table:
    """Async against sync scheduling on the built-in model: ms per token, host time on the
    critical path, device idle.

    Unfused greedy decode of 3-token prompts, one batch bucket = batch. The sync and async
    engines and a device-only loop (the compiled step back to back) take turns, best of N.
    Host gap: from a step's tokens on the host until the next step is dispatched (host work on
    the critical path). Device idle: 1 - device-only ms / ms per decode step.
    """
    tokens = args.max_tokens or (16 if args.quick else 64)
    rounds = repeats(args, 5, 1)
    rows = []
    for batch in ints(args.batches or ("1" if args.quick else "1,8")):
        engines = {on: LLM(batch_buckets=(batch,), async_scheduling=on) for on in (False, True)}
        probes = {on: Probe(llm.runner) for on, llm in engines.items()}
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        prompts = [[5, 6 + b, 7] for b in range(batch)]

        fns = {
            name: functools.partial(probed_generate, engines[on], probes[on], prompts, params)
            for name, on in (("sync", False), ("async", True))
        }
        fns["device"] = device_loop(engines[False], batch, 3 + tokens // 2)
        runs = interleaved(fns, warmup=1, repeats=rounds)
        device_ms = runs["device"].best / DEVICE_STEPS * 1e3
        for name in ("sync", "async"):
            stats = runs[name].best_result
            step_ms = stats["wall_s"] / stats["steps"] * 1e3
            rows.append(
                dict(
                    batch=batch,
                    scheduling=name,
                    ms_per_token=runs[name].best / tokens * 1e3,
                    ms_per_step=step_ms,
                    device_ms_per_step=device_ms,
                    device_idle=max(0.0, 1 - device_ms / step_ms),
                    host_ms_per_step=stats["host_ms_per_step"],
                    host_gap_ms=stats["host_gap_ms"],
                    overlapped=f"{stats['overlapped_steps']} / {stats['steps']}",
                )
            )
    sync = {r["batch"]: r for r in rows if r["scheduling"] == "sync"}
    add_ratio(rows, "ms_per_token", lambda r: sync[r["batch"]], "vs_sync")
    columns = ["batch", "scheduling", "ms_per_token", "vs_sync", "ms_per_step"]
    columns += ["device_ms_per_step", "device_idle", "host_ms_per_step", "host_gap_ms"]
    title = f"built-in model, {tokens} tokens per request, best of {rounds}"
    return Table(title, rows, columns + ["overlapped"], {"tokens": tokens})


# ---- pools ------------------------------------------------------------------------------------
@SUITE.measure("pools")
def pools(args) -> Table:
    """Decode time against the size of the cache pools: a step that copied a whole pool would
    slow down with it.

    The ``small`` shapes with a 320-id vocabulary (random weights, two MLA layers). State
    slots: a small pool (max(1, B) sequences, one checkpoint slot) against 97 slots (32
    sequences, 64 checkpoint slots). Latent pages: 64 against 4,096 pages of 16, 8 sequences.
    Greedy, unfused, ms per generated token, best of N with the engines taking turns.
    """
    tokens, rounds = 40, repeats(args, 3, 1)
    batches = ints(args.batches or ("1" if args.quick else "1,8"))
    model = random_model(preset("tiny" if args.quick else "small", vocab_size=320))
    rows = []
    for kind in ("slots", "pages"):
        for batch in batches:
            if kind == "slots":
                engines = {
                    name: LLM(
                        model,
                        batch_buckets=(batch,),
                        max_num_seqs=max(seqs, batch),
                        num_checkpoint_slots=ckpt,
                    )
                    for name, seqs, ckpt in (("small pool", 1, 1), ("97 slots", 32, 64))
                }
            else:
                engines = {
                    f"{n:,} pages": LLM(model, batch_buckets=(batch,), max_num_seqs=8, num_pages=n)
                    for n in (64, 4096)
                }
            params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
            prompts = [[5, 6 + b, 7] for b in range(batch)]
            fns = {
                name: functools.partial(e.generate, prompts, params, use_tqdm=False)
                for name, e in engines.items()
            }
            runs = interleaved(fns, warmup=1, repeats=rounds, keep=False)
            base = None
            for name, e in engines.items():
                row = dict(kind=kind, batch=batch, pool=name, slots=e.layout.num_slots)
                row.update(pages=e.layout.num_pages, ms_per_token=runs[name].best / tokens * 1e3)
                base = base or row
                add_ratio([row], "ms_per_token", base, "vs_smallest")
                rows.append(row)
            del engines  # the 4,096-page pools: hundreds of MB
    columns = ["kind", "batch", "pool", "slots", "pages", "ms_per_token", "vs_smallest"]
    return Table(f"ms per token, {tokens} tokens, best of {rounds}", rows, columns)


# ---- dtype ------------------------------------------------------------------------------------
@SUITE.measure("dtype")
def dtype(args) -> Table:
    """The built-in model in float32 (what ``dtype="auto"`` picks for it) and in bfloat16 (its
    checkpoint's dtype): plain decoding and the n-gram (k 8) on held-out code, batch 1.

    On XLA:CPU a bfloat16 product of one row is a slow loop while from two rows on bfloat16
    runs faster than float32: this measures which wins for whole steps and verify windows.
    decode tok/s as in ``speculative code``; best of N, the engines taking turns.
    """
    from benchmarks.speculative import decode_rates, held_out_prompts

    n = args.max_tokens or (16 if args.quick else 128)
    engines = {}
    for dt in ("float32", "bfloat16"):
        shapes = dict(max_num_seqs=1, num_pages=64, dtype=dt)
        engines[f"{dt} plain"] = LLM(**shapes)
        spec = {"method": "ngram", "num_draft_tokens": 8}
        engines[f"{dt} ngram"] = LLM(speculative=spec, **shapes)
    tokenizer = engines["float32 plain"].tokenizer
    prompts = held_out_prompts(tokenizer, 128, n, 1 if args.quick else 6)
    rounds = repeats(args, 2, 1)
    rates = decode_rates(engines, prompts, n, rounds)
    rows = []
    for name, r in rates.items():
        dt, config = name.split()
        plain = rates[f"{dt} plain"]
        row = {"dtype": dt, "config": config, "decode_tok_s": r["decode_tok_s"]}
        row["identical_to_its_plain"] = r["tokens"] == plain["tokens"]
        row["vs_own_plain"] = r["decode_tok_s"] / plain["decode_tok_s"]
        rows.append(row)
    add_ratio(rows, "decode_tok_s", rows[0], "vs_float32_plain")
    columns = ["dtype", "config", "decode_tok_s", "vs_float32_plain", "vs_own_plain"]
    title = f"built-in model, {len(prompts)} held-out prompts, {n} tokens, best of {rounds}"
    return Table(title, rows, columns + ["identical_to_its_plain"])
