"""Absorbed paged MLA decode/verify: GB/s and TFLOP/s of the Pallas kernel and the XLA reference.

Release dims: H = 32 heads, L = 512 latent + R = 64 rope, bf16 cache in pages of 64 tokens,
shuffled block tables. T = 1 is decode; T > 1 is a verify window whose row t sees
``ctx - T + 1 + t`` keys. Counted work (from the FlashMLA accounting, see
shared/reference/mla_dcp.md, "Numbers"), with ``kv`` the mean visible length over the rows:

    bytes = B * (T*H*576*2 + kv*576*2 + T*H*512*2)     (q in, latent cache once, o out, bf16)
    FLOPs = B * H * T * (2*576 + 2*512) * kv

The same run measures the device copy bandwidth (a jitted ``x * s`` over a large bf16 array,
bytes read + written) and reports each GB/s as a fraction of it. On a GPU the Pallas kernel
(``kernels.mla_decode.mla_paged_attention``) and the jitted reference
(``kimi_linear_jax.ops.mla.mla_paged_attention_reference``) take turns call by call, their
outputs are compared (max |o_kernel - o_ref|) so both timings are of the same work, and the
kernel's verify/decode time ratio is reported. On a CPU only the reference is timed (the kernel
is a Triton kernel), over a reduced grid unless ``--B/--ctx/--T`` say otherwise; its correctness
column then comes from one untimed interpret-mode kernel call (``--no-interpret-check`` skips
it).

Small configs would sit in L2 if one cache were read over and over: each config gets a page pool
of at least ``--min-pool-mib`` and consecutive calls rotate over disjoint block tables in it.
On a GPU a small config's call is shorter than Python's dispatch of it, so one jitted program
makes ``--unroll`` calls back to back (configs over 256 MiB of cache: one), and a timed sample
is ``inner`` such programs (sized to ~``--sample-ms``); the reported time is a sample's median
over the calls in it. Compilation is excluded.

Run from the repo root: ``python benchmarks/mla_decode.py [--B 1 16 64] [--ctx 4096 32768]
[--T 1 4] [--repeats N] [--out DIR]``. Writes ``mla_decode.json`` to ``--out`` (default
benchmarks/results), after every config, so a run cut short still leaves its rows.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import print_table, timeit, timeit_interleaved, write_json  # noqa: E402

from kimi_linear_jax.ops.mla import mla_paged_attention_reference  # noqa: E402

H, L, R, PAGE = 32, 512, 64, 64
W = L + R
DTYPE = jnp.bfloat16
SM_SCALE = W**-0.5

FULL_GRID = {"B": [1, 16, 64], "ctx": [4096, 32768], "T": [1, 4]}
CPU_GRID = {"B": [1, 16], "ctx": [4096], "T": [1, 4]}

COLUMNS = [
    "B",
    "ctx",
    "T",
    "MB",
    "kern_us",
    "ref_us",
    "kern_GBps",
    "ref_GBps",
    "kern_TFLOPs",
    "ref_TFLOPs",
    "kern/copy",
    "ref/copy",
    "kern_T4/T1",
    "ref_T4/T1",
    "max_abs_diff",
    "note",
]


def counted_work(B: int, T: int, mean_kv: float) -> tuple[float, float]:
    """(bytes, FLOPs) of one absorbed MLA decode/verify call, by the formulas above."""
    nbytes = B * (T * H * W * 2 + mean_kv * W * 2 + T * H * L * 2)
    flops = B * H * T * (2 * W + 2 * L) * mean_kv
    return float(nbytes), float(flops)


def verify_lens(B: int, ctx: int, T: int) -> np.ndarray:
    """kv_lens [B, T]: row t of a window ending at ctx sees ctx - T + 1 + t keys."""
    row = ctx - T + 1 + np.arange(T, dtype=np.int32)
    return np.broadcast_to(row, (B, T)).astype(np.int32)


def _is_oom(e: BaseException) -> bool:
    msg = str(e)
    return "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower()


def _err(e: BaseException) -> str:
    kind = "OOM" if _is_oom(e) else type(e).__name__
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{kind}: {first[:160]}"


def _inner_for(fn, sample_s: float, cap: int = 1000) -> int:
    """Back-to-back calls per timed sample so that a sample lasts about ``sample_s``."""
    if sample_s <= 0:
        return 1
    t = timeit(fn, warmup=0, repeats=3)["min_s"]
    return max(1, min(cap, math.ceil(sample_s / max(t, 1e-7))))


def _rotating(fn, arg_sets, inner: int):
    """A thunk making ``inner`` calls of fn, each on the next argument set (returns the last;
    device work runs in order, so blocking on it waits for all)."""
    state = {"i": 0}

    def run():
        out = None
        for _ in range(inner):
            out = fn(*arg_sets[state["i"] % len(arg_sets)])
            state["i"] += 1
        return out

    return run


def copy_bandwidth(nbytes: int, repeats: int, sample_s: float) -> dict:
    """Device copy bandwidth: a jitted ``x * s`` over a bf16 array (bytes read + written)."""
    n = nbytes // 2
    x = jax.random.normal(jax.random.key(1), (n,), DTYPE)
    s = jnp.asarray(1.0, DTYPE)  # a runtime scalar: XLA cannot fold the multiply away
    f = jax.jit(lambda x, s: x * s)
    f = f.lower(x, s).compile()
    jax.block_until_ready(f(x, s))
    thunk = lambda: f(x, s)
    inner = _inner_for(thunk, sample_s)
    res = timeit(_rotating(f, [(x, s)], inner), warmup=1, repeats=repeats)
    t = res["median_s"] / inner
    return {
        "copy_MiB": nbytes / 2**20,
        "copy_GBps": 2 * n * 2 / t / 1e9,
        "copy_min_GBps": 2 * n * 2 / (res["min_s"] / inner) / 1e9,
        "copy_inner": inner,
    }


def make_inputs(B: int, ctx: int, T: int, min_pool_bytes: int, unroll: int, seed: int = 0):
    """Queries, a random bf16 page pool and block tables over disjoint shuffled pages.

    Returns ``(arg_groups, n_sets)``: each group is ``(q_lat, q_pe, cache, kv_lens, *tables)``
    with ``unroll`` tables; n_sets tables in all, enough to cover ``min_pool_bytes`` of cache.
    """
    pages_per_seq = -(-ctx // PAGE)
    set_bytes = B * pages_per_seq * PAGE * W * 2
    n_sets = max(1, min(256, -(-min_pool_bytes // set_bytes)))
    n_sets = -(-n_sets // unroll) * unroll
    num_pages = n_sets * B * pages_per_seq
    rng = np.random.default_rng(seed)
    tables = rng.permutation(num_pages).astype(np.int32).reshape(n_sets, B, pages_per_seq)
    kc, kq, kp = jax.random.split(jax.random.key(seed), 3)
    cache = jax.random.normal(kc, (num_pages, PAGE, W), DTYPE)
    q_lat = jax.random.normal(kq, (B, T, H, L), DTYPE)
    q_pe = jax.random.normal(kp, (B, T, H, R), DTYPE)
    lens = jnp.asarray(verify_lens(B, ctx, T))
    tables = [jnp.asarray(t) for t in tables]
    groups = [(q_lat, q_pe, cache, lens, *tables[i : i + unroll]) for i in range(0, n_sets, unroll)]
    return groups, n_sets


def _unrolled(fn):
    """One jitted program making one call of fn per table argument, back to back on the device
    (no host dispatch between them); returns every call's (o, lse)."""

    def many(q_lat, q_pe, cache, kv_lens, *tables):
        return tuple(fn(q_lat, q_pe, cache, t, kv_lens) for t in tables)

    return jax.jit(many)


def _load_kernel():
    from kernels.mla_decode import kernel_supports, mla_paged_attention

    if not kernel_supports(L, R, PAGE):
        raise ValueError("kernel does not take L=512, R=64, page 64")
    return mla_paged_attention


# The kernel tests' bf16 tolerance on o (the kernel feeds bf16 probabilities to the value dot).
O_ATOL = 1e-2


def _record_diff(row: dict, notes: list[str], got, want) -> None:
    """max |o - o_ref| (and the same for lse); a note if o is past the tests' tolerance."""
    row["max_abs_diff"] = float(jnp.max(jnp.abs(got[0] - want[0])))
    row["max_abs_diff_lse"] = float(jnp.max(jnp.abs(got[1] - want[1])))
    if not row["max_abs_diff"] <= O_ATOL:  # NaN included
        notes.append(f"MISMATCH: max |o - o_ref| > {O_ATOL}")


def bench_config(B, ctx, T, *, on_gpu, repeats, sample_s, min_pool_bytes, unroll, check):
    row = {"B": B, "ctx": ctx, "T": T, "H": H, "L": L, "R": R, "page": PAGE, "repeats": repeats}
    notes = []
    # Big configs run long past any launch overhead: one call a program keeps memory flat.
    if B * ctx * W * 2 > 256 * 2**20:
        unroll = 1
    groups, n_sets = make_inputs(B, ctx, T, min_pool_bytes, unroll)
    lens = np.asarray(groups[0][3])
    mean_kv = float(lens.mean())
    nbytes, flops = counted_work(B, T, mean_kv)
    row.update(mean_kv=mean_kv, bytes=nbytes, flops=flops, MB=nbytes / 1e6)
    row.update(table_sets=n_sets, unroll=unroll)

    fns = {"ref": functools.partial(mla_paged_attention_reference, sm_scale=SM_SCALE)}
    if on_gpu:
        try:
            fns["kern"] = functools.partial(_load_kernel(), sm_scale=SM_SCALE)
        except Exception as e:  # an import or dims problem: keep the reference numbers
            notes.append(f"kern: {_err(e)}")

    compiled, outs = {}, {}
    for name, fn in fns.items():
        try:
            t0 = time.perf_counter()
            compiled[name] = _unrolled(fn).lower(*groups[0]).compile()
            row[f"{name}_compile_s"] = time.perf_counter() - t0
            outs[name] = jax.block_until_ready(compiled[name](*groups[0])[0])
        except Exception as e:
            notes.append(f"{name}: {_err(e)}")
            compiled.pop(name, None)

    if "kern" in outs and "ref" in outs:
        _record_diff(row, notes, outs["kern"], outs["ref"])
    elif not on_gpu and check and "ref" in outs:
        # One untimed interpret-mode call on the first sequence (interpret mode runs the grid
        # one program at a time; the whole batch would dominate a CPU run).
        try:
            kern = jax.jit(functools.partial(_load_kernel(), sm_scale=SM_SCALE, interpret=True))
            q_lat, q_pe, cache, lens, table = groups[0][:5]
            got = kern(q_lat[:1], q_pe[:1], cache, table[:1], lens[:1])
            notes.append("diff: kernel in interpret mode, sequence 0")
            _record_diff(row, notes, got, tuple(x[:1] for x in outs["ref"]))
        except Exception as e:
            notes.append(f"interpret check: {_err(e)}")
    outs.clear()

    if compiled:
        try:
            inner = {n: _inner_for(_rotating(c, groups, 1), sample_s) for n, c in compiled.items()}
            thunks = {n: _rotating(c, groups, inner[n]) for n, c in compiled.items()}
            res = timeit_interleaved(thunks, warmup=1, repeats=repeats)
            for name, r in res.items():
                calls = inner[name] * unroll
                t, t_min = r["median_s"] / calls, r["min_s"] / calls
                row[f"{name}_calls_per_sample"] = calls
                row[f"{name}_us"] = t * 1e6
                row[f"{name}_min_us"] = t_min * 1e6
                row[f"{name}_GBps"] = nbytes / t / 1e9
                row[f"{name}_TFLOPs"] = flops / t / 1e12
        except Exception as e:
            notes.append(f"timing: {_err(e)}")
    row["note"] = "; ".join(notes)
    return row


def _fill_ratios(rows: list[dict], copy_GBps: float) -> None:
    """Fractions of the copy bandwidth, and verify (largest T) / decode (T = 1) time ratios."""
    for r in rows:
        for name in ("kern", "ref"):
            if f"{name}_GBps" in r:
                r[f"{name}/copy"] = r[f"{name}_GBps"] / copy_GBps
    decode = {(r["B"], r["ctx"]): r for r in rows if r["T"] == 1}
    for r in rows:
        d = decode.get((r["B"], r["ctx"]))
        if d is None or r["T"] == 1:
            continue
        for name in ("kern", "ref"):
            if f"{name}_us" in r and f"{name}_us" in d:
                # Named for the default verify width; the row's own T is in column T.
                r[f"{name}_T4/T1"] = r[f"{name}_us"] / d[f"{name}_us"]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--B", type=int, nargs="+", help="batch sizes (GPU: 1 16 64; CPU: 1 16)")
    p.add_argument(
        "--ctx", type=int, nargs="+", help="context lengths (GPU: 4096 32768; CPU: 4096)"
    )
    p.add_argument("--T", type=int, nargs="+", help="query tokens per sequence (default: 1 4)")
    p.add_argument("--full", action="store_true", help="the full grid on a CPU as well")
    p.add_argument("--repeats", type=int, help="timed samples per impl (GPU: 20, CPU: 3)")
    p.add_argument("--sample-ms", type=float, help="target length of a timed sample (GPU: 20)")
    p.add_argument("--copy-mib", type=int, help="copy-bandwidth array (GPU: 2048, CPU: 256)")
    p.add_argument(
        "--min-pool-mib", type=int, help="page pool per config, rotated (GPU: 512, CPU: 64)"
    )
    p.add_argument(
        "--unroll",
        type=int,
        help="calls per jitted program for configs under 256 MiB of cache (GPU: 8, CPU: 1)",
    )
    p.add_argument(
        "--time-budget", type=float, help="seconds; start no new config past it (default: none)"
    )
    p.add_argument("--no-interpret-check", action="store_true", help="CPU: skip the kernel check")
    p.add_argument("--out", help="directory for mla_decode.json (default: benchmarks/results)")
    a = p.parse_args(argv)

    t_start = time.perf_counter()
    on_gpu = jax.default_backend() == "gpu"
    grid = FULL_GRID if (on_gpu or a.full) else CPU_GRID
    Bs, ctxs, Ts = a.B or grid["B"], a.ctx or grid["ctx"], a.T or grid["T"]
    repeats = a.repeats or (20 if on_gpu else 3)
    sample_s = (a.sample_ms or (20.0 if on_gpu else 0.0)) / 1e3
    copy_bytes = (a.copy_mib or (2048 if on_gpu else 256)) * 2**20
    min_pool = (a.min_pool_mib or (512 if on_gpu else 64)) * 2**20
    unroll = a.unroll or (8 if on_gpu else 1)
    reduced = not on_gpu and not (a.full or a.B or a.ctx or a.T)
    meta = {
        "dtype": "bfloat16",
        "H": H,
        "L": L,
        "R": R,
        "page_size": PAGE,
        "sm_scale": SM_SCALE,
        "grid": {"B": Bs, "ctx": ctxs, "T": Ts},
        "grid_reduced": reduced,
        "impls": "kern (Pallas Triton kernel) + ref (jitted XLA reference)"
        if on_gpu
        else "ref only (XLA reference; the Triton kernel needs a GPU)",
        "note": (
            "time = median of timed samples / calls per sample (inner * unroll), compile "
            "excluded; "
            "bytes = B*(T*H*576*2 + mean_kv*576*2 + T*H*512*2), "
            "FLOPs = B*H*T*(2*576+2*512)*mean_kv, mean_kv = mean visible keys over the rows; "
            "*/copy = GB/s over the measured copy bandwidth (read + write) of this run; "
            "*_T4/T1 = time of this verify row over the T=1 row of the same B, ctx"
        ),
    }
    if reduced:
        meta["reduction"] = (
            f"CPU default grid {CPU_GRID} instead of {FULL_GRID} (pass --full or --B/--ctx/--T)"
        )

    print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind})", flush=True)
    try:
        copy = copy_bandwidth(copy_bytes, repeats, sample_s)
    except Exception as e:
        if not _is_oom(e):
            raise
        copy = copy_bandwidth(copy_bytes // 8, repeats, sample_s)
    meta.update(copy)
    print(f"copy bandwidth: {copy['copy_GBps']:,.1f} GB/s ({copy['copy_MiB']:.0f} MiB array)")

    rows: list[dict] = []
    path = write_json("mla_decode", rows, meta, a.out)
    configs = [(B, ctx, T) for B in Bs for ctx in ctxs for T in Ts]
    for B, ctx, T in configs:
        if a.time_budget is not None and time.perf_counter() - t_start > a.time_budget:
            rows.append({"B": B, "ctx": ctx, "T": T, "note": "skipped: time budget"})
            path = write_json("mla_decode", rows, meta, a.out)
            continue
        t0 = time.perf_counter()
        try:
            row = bench_config(
                B,
                ctx,
                T,
                on_gpu=on_gpu,
                repeats=repeats,
                sample_s=sample_s,
                min_pool_bytes=min_pool,
                unroll=unroll,
                check=not a.no_interpret_check,
            )
        except Exception as e:  # OOM making the inputs, most likely: skip the config
            if not _is_oom(e):
                traceback.print_exc()
            row = {"B": B, "ctx": ctx, "T": T, "note": f"skipped: {_err(e)}"}
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
        print(f"done: B={B} ctx={ctx} T={T} ({row['wall_s']:.1f} s) {row.get('note', '')}")
        sys.stdout.flush()
        _fill_ratios(rows, copy["copy_GBps"])
        meta["elapsed_s"] = time.perf_counter() - t_start
        path = write_json("mla_decode", rows, meta, a.out)
    print()
    print_table(rows, [c for c in COLUMNS if any(c in r for r in rows)])
    print(f"\ncopy bandwidth {copy['copy_GBps']:,.1f} GB/s; wrote {os.path.relpath(path)}")
    return rows


if __name__ == "__main__":
    main()
