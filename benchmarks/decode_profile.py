"""Where the time of one unfused decode step goes (issue 13): engine step vs compiled call vs the
XLA ops inside it, float32, greedy, on a CPU.

For each batch size B (default 1 and 8), an engine (`serving.LLM`, prefix caching off so that
no step snapshots a checkpoint) prefills B prompts of ``--prompt-len`` ids and then:

1. **engine step**: the wall time of ``LLM.step()`` for each of ``--steps`` decode steps
   (scheduling, batch building, the compiled call, the device-to-host transfer, bookkeeping),
   best of ``--repeats`` runs by their median step;
2. **compiled call**: inside each of those steps, the time of the runner's jitted decode
   (``serving.runner.decode_steps``, num_steps 1) until its results are ready. host = engine
   step - compiled call of the same step (median), so noise between runs cancels;
3. **per-op breakdown**: a ``jax.profiler`` trace of ``--trace-calls`` compiled calls with the
   arguments of the last engine step (captured; the cache fed back from call to call). Each XLA
   op (a thunk: fusion, dot, copy, loop) is timed by the trace; its self time (minus nested
   ops) is attributed to a part of the model by the op's source stack in the optimized HLO
   (`classify`), or, for ops XLA made up (copies, some dots), by the parameters or caches
   it reads. Per op the median over the traced calls is taken. Two XLA threads run ops in
   parallel, so the ops' summed time can exceed the wall time: the table gives each part's ms
   per step (summed over threads) and share of the sum. The profiler slows a call (by about a
   third at B = 1): read the shares, and the untraced compiled call for the time;
4. **XLA's cost analysis** of the compiled step (flops, bytes accessed, temp bytes), the minor
   page faults per compiled call (``getrusage``: fresh temp pages touched), and the
   weight-bytes roofline of ``throughput.py`` at the bandwidth measured in the same run.

``--model default`` is the built-in default model of the time these figures were first taken
(`small` shapes with a byte vocabulary of 320, random weights; the built-in model is now the
trained `pycode`); ``--model small`` is the ``small`` preset with its 16,384-token
vocabulary, the model of ``throughput.py``. The tables go to
``results/decode_profile*.json``; ``--dump-hlo DIR`` writes the optimized HLO that the op
names refer to.

Run: ``python benchmarks/decode_profile.py [--batches 1,8] [--model default] [--steps 24]
[--repeats 3] [--trace-calls 20]`` (under a minute for the defaults on the 2-core development
machine; ``--model small --batches 1,8,32`` about a minute and a half).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import resource
import statistics
import sys
import tempfile
import time

# benchmarks/ for its siblings, then the repo root: the checkout's packages, not an install.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import print_table, serving_heap, write_json  # noqa: E402
from throughput import memory_bandwidth, weight_bytes_per_step  # noqa: E402

import serving.runner as runner_mod  # noqa: E402
from kimi_linear_jax.presets import preset  # noqa: E402
from kimi_linear_jax.testing import random_model  # noqa: E402
from serving import LLM, SamplingParams  # noqa: E402

# Parts of the step, matched against an op's source stack from the innermost frame out: the
# first frame whose function matches a rule names the part.
STACK_RULES = [
    ("sampling (argmax)", ("_pick",)),
    ("KDA state commit", ("commit_kda", "scatter_rows")),
    ("KDA state gather", ("state_rows",)),
    ("MoE routed experts", ("Experts.",)),
    ("MoE router", ("Router.", "_sort_by_expert")),
    ("MoE shared expert", ("MoE.__call__",)),  # MoE.__call__'s own ops; the MLP: _by_stack
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


# ---- the optimized HLO: op name -> part of the model ------------------------------------------
def _section(text: str, name: str, end: str | None) -> list[str]:
    a = text.index(f"\n{name}\n") + len(name) + 2
    b = text.index(f"\n{end}\n", a) if end else text.index("\n\n", a)
    return text[a:b].strip().splitlines()


def _table(lines: list[str]) -> dict[int, str]:
    return {int(x.split()[0]): x.split(None, 1)[1].strip('"') for x in lines}


def stack_functions(text: str):
    """A function: stack_frame_id -> the function names of its frames, innermost first (the
    tables XLA prints before the HLO: file names, function names, file locations, frames)."""
    funcs = _table(_section(text, "FunctionNames", "FileLocations"))
    locs = {}
    for line in _section(text, "FileLocations", "StackFrames"):
        m = re.match(r"(\d+) \{file_name_id=\d+ function_name_id=(\d+)", line)
        locs[int(m[1])] = int(m[2])
    frames = {}
    for line in _section(text, "StackFrames", None):
        m = re.match(r"(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)", line)
        if m:
            # A parent id is one more than the id the table prints (0: no parent).
            frames[int(m[1])] = (int(m[2]), int(m[3]) - 1)

    def chain(fid: int) -> list[str]:
        out, seen = [], set()
        while fid in frames and fid not in seen:
            seen.add(fid)
            loc, fid = frames[fid]
            out.append(funcs[locs[loc]])
        return out

    return chain


# name = shape opcode(operands...: the shape may be a tuple with spaces, so match it lazily.
_OP = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
_LAYER_ATTN = re.compile(r"layers___(\d+)___self_attn")


def _by_operands(operands: str, parts: dict, layer_kinds) -> str:
    """The part of an op without a source stack, from what it reads: a parameter, a cache, or
    an op already classified as an XLA copy (a copy of a copy)."""
    for name in re.findall(r"%([\w.\-]+)", operands):
        if parts.get(name, ("",))[0].startswith("XLA copy"):
            return parts[name][0]
    attn = _LAYER_ATTN.search(operands)
    if attn:  # checkpoint layer names count from 0, like layer_kinds
        kind = layer_kinds[int(attn[1])]
        return "MLA attention" if kind == "mla" else "KDA projections, conv, norms"
    return next((p for p, key in PARAM_RULES if key in operands), "other")


def _by_stack(funcs: list[str]) -> str | None:
    """The part named by the innermost frame that a rule matches. The shared expert is an MLP
    called from MoE.__call__: the frames above the MLP decide it is not the dense layer's."""
    if any("MLP.__call__" in f for f in funcs) and any("MoE.__call__" in f for f in funcs):
        return "MoE shared expert"
    return next((p for f in funcs for p, keys in STACK_RULES if any(k in f for k in keys)), None)


def classify(text: str, layer_kinds) -> dict[str, tuple[str, str]]:
    """Op name -> (part of the model, a short description: opcode and result shape)."""
    chain = stack_functions(text)
    parts: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        m = _OP.match(line)
        if not m:
            continue
        name, shape, opcode, rest = m.groups()
        frame = re.search(r"stack_frame_id=(\d+)", rest)
        funcs = chain(int(frame[1])) if frame else []
        part = _by_stack(funcs)
        if part is None:
            part = _by_operands(rest.split("), ")[0], parts, layer_kinds)
        parts[name] = (part, f"{opcode} {shape[:48]}")
    return parts


# ---- the profiler trace: op name -> self time -------------------------------------------------
def _load_trace(trace_dir: str) -> list[dict]:
    path = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    with gzip.open(sorted(path)[-1]) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    return [e for e in events if e.get("ph") == "X"]


# Each traced call runs inside a TraceAnnotation of this name (dispatch to results ready), so
# the ops of call i are the ones inside its annotation.
CALL_MARK = "decode_profile_call"


def call_windows(events: list[dict]) -> list[tuple[float, float]]:
    """[start, end] of each traced call, from its ``CALL_MARK`` annotation."""
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == CALL_MARK)


def self_times(ops: list[dict]) -> dict[str, float]:
    """Self time (us) per op name: its duration minus the ops nested in it on its thread (a
    loop's body, a conditional's branch)."""
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


def _union(events: list[dict]) -> float:
    """Length of the union of the events' [ts, ts + dur) intervals."""
    total, end = 0.0, -float("inf")
    for e in sorted(events, key=lambda e: e["ts"]):
        lo, hi = max(e["ts"], end), e["ts"] + e["dur"]
        if hi > lo:
            total += hi - lo
        end = max(end, hi)
    return total


def per_call_op_times(trace_dir: str, op_names: set[str]) -> dict:
    """From the trace of several calls: per op, the median over calls of its self time (ms);
    the median call window (ms) and the median time in it during which some op ran (ms; the
    rest is dispatch, the executor's scheduling and waits). Medians: a stall of the shared
    machine in one call does not move them."""
    events = _load_trace(trace_dir)
    windows = call_windows(events)
    ops = [e for e in events if e["name"] in op_names]
    per_call, busy = [], []
    for lo, hi in windows:
        mine = [e for e in ops if lo <= e["ts"] <= hi]
        per_call.append(self_times(mine))
        busy.append(_union(mine))
    names = set().union(*per_call)
    return {
        "op_ms": {n: statistics.median(c.get(n, 0.0) for c in per_call) / 1e3 for n in names},
        "call_ms": statistics.median(hi - lo for lo, hi in windows) / 1e3,
        "busy_ms": statistics.median(busy) / 1e3,
        "calls": len(windows),
    }


# ---- the engine and its compiled decode -------------------------------------------------------
def make_engine(model: str, b: int, prompt_len: int, steps: int) -> LLM:
    """One engine per batch size: batch bucket b, the whole prompt in one prefill chunk."""
    vocab = {"vocab_size": 320} if model == "default" else {}
    src = random_model(preset("small", **vocab), dtype=jnp.float32)
    return LLM(
        src,
        max_num_seqs=b,
        batch_buckets=(b,),
        token_buckets=(prompt_len,),
        chunk_size=prompt_len,
        max_num_batched_tokens=b * prompt_len,
        max_model_len=prompt_len + steps + 8,
        enable_prefix_caching=False,
    )


def engine_steps(llm: LLM, b: int, prompt_len: int, steps: int, seed: int):
    """Per decode step (the first step prefills and is not counted): the wall time of
    ``LLM.step()`` and of the compiled decode inside it (the call and its result ready), both
    from the same step; and the arguments of the last step's compiled decode."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for _ in range(b):
        prompt = rng.integers(0, llm.config.vocab_size, prompt_len).tolist()
        llm.add_request(prompt, params)
    llm.step()  # prefill: every row's first token
    captured, calls, real = {}, [], runner_mod.decode_steps

    def recorder(*args, **kwargs):
        captured.update(args=args, kwargs=kwargs)
        t0 = time.perf_counter()
        out = jax.block_until_ready(real(*args, **kwargs))  # the runner reads it next anyway
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


def compiled_calls(llm: LLM, captured: dict, n: int) -> list[float]:
    """n calls of the captured compiled decode, the cache fed back; seconds per call. Each
    call is marked for the profiler (``CALL_MARK``; free when no trace runs)."""
    args, kwargs = captured["args"], captured["kwargs"]
    cache, times = llm.runner.cache, []
    for _ in range(n):
        t0 = time.perf_counter()
        with jax.profiler.TraceAnnotation(CALL_MARK):
            picked, _, cache = runner_mod.decode_steps(*args[:3], cache, *args[4:], **kwargs)
            jax.block_until_ready(picked)
        times.append(time.perf_counter() - t0)
    llm.runner.cache = cache
    return times


def faults_per_call(llm: LLM, captured: dict, calls: int) -> float:
    """Minor page faults per compiled call. XLA:CPU takes each call's temp buffers from malloc;
    past glibc's mmap threshold (at most 32 MiB by default) that is a fresh mapping whose
    every page faults on first touch, on every call."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    compiled_calls(llm, captured, calls)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls


def op_breakdown(llm: LLM, captured: dict, calls: int):
    """(rows of parts, top ops, compiled HLO text, cost analysis, trace summary)."""
    args, kwargs = captured["args"], captured["kwargs"]
    compiled = runner_mod.decode_steps.lower(
        *args[:3], llm.runner.cache, *args[4:], **kwargs
    ).compile()
    text = compiled.as_text()
    parts = classify(text, llm.config.layer_kinds)
    compiled_calls(llm, captured, 2)  # warm, outside the trace
    faults = faults_per_call(llm, captured, 10)
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp, create_perfetto_trace=True)
        compiled_calls(llm, captured, calls)
        jax.profiler.stop_trace()
        traced = per_call_op_times(tmp, set(parts))
    traced["faults_per_call"] = faults
    traced["temp_MB"] = compiled.memory_analysis().temp_size_in_bytes / 1e6
    op_ms = traced.pop("op_ms")
    by_part: dict[str, float] = collections.defaultdict(float)
    for name, ms in op_ms.items():
        by_part[parts[name][0]] += ms
    total = sum(by_part.values())
    rows = [
        {"part": p, "ms_per_step": ms, "share": ms / total}
        for p, ms in sorted(by_part.items(), key=lambda kv: -kv[1])
    ]
    top = [
        {"op": n, "part": parts[n][0], "what": parts[n][1], "ms_per_step": ms}
        for n, ms in sorted(op_ms.items(), key=lambda kv: -kv[1])[:40]
    ]
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    cost = {k: float(cost[k]) for k in ("flops", "bytes accessed", "transcendentals") if k in cost}
    return rows, top, text, cost, traced


# ---- main ---------------------------------------------------------------------------------------
def profile_batch(a, b: int, bw: dict) -> tuple[dict, list[dict], list[dict], str]:
    llm = make_engine(a.model, b, a.prompt_len, a.steps)
    engine_steps(llm, b, a.prompt_len, a.steps, seed=0)  # compile prefill and decode
    runs = [engine_steps(llm, b, a.prompt_len, a.steps, seed=r + 1) for r in range(a.repeats)]
    captured = runs[-1][2]
    # Best run by its median step (a median resists one-off stalls within the run); the host
    # time per step is step - call of the same step, so machine noise between runs cancels.
    engine_ms = min(statistics.median(steps) for steps, _, _ in runs) * 1e3
    call_ms = min(statistics.median(calls) for _, calls, _ in runs) * 1e3
    host_ms = min(statistics.median(np.subtract(steps, calls)) for steps, calls, _ in runs) * 1e3
    parts, top, text, cost, traced = op_breakdown(llm, captured, a.trace_calls)
    wb = weight_bytes_per_step(llm.model, b)["weight_bytes_per_step"]
    gbps = bw["bandwidth_GBps"]
    summary = {
        "B": b,
        "engine_step_ms": engine_ms,
        "compiled_call_ms": call_ms,
        "host_ms": host_ms,
        "traced_call_ms": traced["call_ms"],
        "ops_busy_ms": traced["busy_ms"],
        "traced_calls": traced["calls"],
        "xla_temp_MB": traced["temp_MB"],
        "page_faults_per_call": traced["faults_per_call"],
        "ops_sum_ms": sum(r["ms_per_step"] for r in parts),
        "weight_MB": wb / 1e6,
        "roofline_ms": wb / 1e9 / gbps * 1e3,
        "xla_bytes_MB": cost.get("bytes accessed", float("nan")) / 1e6,
        "xla_bytes_at_bw_ms": cost.get("bytes accessed", float("nan")) / 1e9 / gbps * 1e3,
        "xla_GFLOP": cost.get("flops", float("nan")) / 1e9,
        "loadavg_1m": os.getloadavg()[0],
    }
    summary["roofline/engine"] = summary["roofline_ms"] / engine_ms
    return summary, parts, top, text


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8")
    p.add_argument("--model", choices=("default", "small"), default="default")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=24, help="decode steps per timed run")
    p.add_argument("--repeats", type=int, default=3, help="timed runs (best of)")
    p.add_argument("--trace-calls", type=int, default=20, help="compiled calls traced")
    p.add_argument("--json", help="results/<JSON>.json (default decode_profile[_small])")
    p.add_argument("--dump-hlo", metavar="DIR", help="write the optimized HLO of each step here")
    a = p.parse_args(argv)
    serving_heap()  # as `kimi-linear-jax generate` / `serve` run
    batches = [int(x) for x in a.batches.split(",") if x.strip()]
    print(f"load average at start: {list(os.getloadavg())}", flush=True)
    bw = memory_bandwidth()
    print(f"memory bandwidth (numpy copy): {bw['bandwidth_GBps']:.2f} GB/s", flush=True)
    summaries, details = [], []
    for b in batches:
        summary, parts, top, text = profile_batch(a, b, bw)
        summaries.append(summary)
        details.append({"B": b, "parts": parts, "top_ops": top})
        print(f"\n== B = {b}: ms per decode step, by part of the model (XLA op self time) ==")
        print_table(parts, ["part", "ms_per_step", "share"])
        print(f"\n-- B = {b}: top ops --")
        print_table(top[:15], ["op", "part", "what", "ms_per_step"])
        if a.dump_hlo:  # megabytes of text: not in results/
            os.makedirs(a.dump_hlo, exist_ok=True)
            with open(os.path.join(a.dump_hlo, f"decode_{a.model}_B{b}.hlo.txt"), "w") as f:
                f.write(text)
    print("\n== summary (ms per decode step) ==")
    columns = [
        "B",
        "engine_step_ms",
        "compiled_call_ms",
        "host_ms",
        "traced_call_ms",
        "ops_busy_ms",
        "ops_sum_ms",
        "roofline_ms",
        "roofline/engine",
        "xla_bytes_MB",
        "xla_GFLOP",
        "xla_temp_MB",
        "page_faults_per_call",
        "loadavg_1m",
    ]
    print_table(summaries, columns)
    name = a.json or ("decode_profile" if a.model == "default" else f"decode_profile_{a.model}")
    path = write_json(
        name,
        summaries,
        {
            "model": a.model,
            "prompt_len": a.prompt_len,
            "steps": a.steps,
            "repeats": a.repeats,
            "trace_calls": a.trace_calls,
            **bw,
            "details": details,
            "note": (
                "engine_step_ms: median LLM.step() of a decode step, best of `repeats` runs; "
                "compiled_call_ms: the runner's jitted decode inside those steps; "
                "host_ms = engine - compiled, per step; parts: XLA op self time from a "
                "jax.profiler trace, median over the traced calls (two threads: the sum can "
                "exceed the wall); ops_busy_ms: time some op ran, per traced call "
                "(traced_call_ms, profiler overhead included); roofline_ms: weight bytes "
                "per step (throughput.weight_bytes_per_step) / numpy-copy bandwidth."
            ),
        },
    )
    print(f"\nwrote {os.path.relpath(path)}")
    return summaries


if __name__ == "__main__":
    main()
