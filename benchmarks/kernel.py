"""Kernels and ops: the paged MLA decode kernel against the XLA reference and the copy
bandwidth, the DCP combines, KDA prefill (chunked against recurrent), the full forward against
transformers, and the CPU routed experts' tiles.

    python -m benchmarks kernel [--only mla_decode dcp_combine kda forward moe] [--quick]

Every op is jitted and compiled before it is timed; the compared implementations take turns
call by call and their outputs are checked against each other.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import tempfile
import time
import traceback
import types

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.harness import Suite, Table, add_ratio, interleaved, repeats, timeit, write_json
from kimi_linear_jax.checkpoint import save_pretrained
from kimi_linear_jax.layers import moe as moe_mod
from kimi_linear_jax.model import forward as model_forward
from kimi_linear_jax.model import set_kda_impl
from kimi_linear_jax.ops.kda import kda_chunked, kda_recurrent
from kimi_linear_jax.ops.mla import mla_paged_attention_reference
from kimi_linear_jax.parallel import dcp
from kimi_linear_jax.parallel.mesh import shard_map
from kimi_linear_jax.presets import preset
from kimi_linear_jax.testing import random_model

SUITE = Suite("kernel", __doc__)
SUITE.option("--B", type=int, nargs="+", help="mla_decode: batch sizes (GPU 1 16 64, CPU 1 16)")
SUITE.option("--ctx", type=int, nargs="+", help="mla_decode: contexts (GPU 4096 32768, CPU 4096)")
SUITE.option("--T", type=int, nargs="+", help="mla_decode: query tokens per sequence (1 4)")
SUITE.option("--full", action="store_true", help="mla_decode: the GPU grid on a CPU as well")
SUITE.option("--sample-ms", type=float, help="mla_decode: a timed sample's length (GPU 20)")
SUITE.option("--copy-mib", type=int, help="mla_decode: copy-bandwidth array (GPU 2048, CPU 256)")
SUITE.option("--min-pool-mib", type=int, help="mla_decode: page pool per config (GPU 512)")
SUITE.option("--unroll", type=int, help="mla_decode: calls per jitted program (GPU 8, CPU 1)")
SUITE.option("--time-budget", type=float, help="mla_decode: start no config past these seconds")
SUITE.option("--no-interpret-check", action="store_true", help="mla_decode: CPU, skip the check")
SUITE.option("--kda-len", type=int, help="kda: tokens per sequence (2048)")
SUITE.option("--forward-lens", type=int, nargs="+", help="forward: sequence lengths (128 512)")


# ---- paged MLA decode -------------------------------------------------------------------------
H, L, R, PAGE = 32, 512, 64, 64
W = L + R
SM_SCALE = W**-0.5
FULL_GRID = {"B": [1, 16, 64], "ctx": [4096, 32768], "T": [1, 4]}
CPU_GRID = {"B": [1, 16], "ctx": [4096], "T": [1, 4]}
O_ATOL = 1e-2  # the kernel tests' bf16 tolerance on o
MLA_COLUMNS = ["B", "ctx", "T", "MB", "kern_us", "ref_us", "kern_GBps", "ref_GBps"]
MLA_COLUMNS += ["kern_TFLOPs", "ref_TFLOPs", "kern/copy", "ref/copy", "kern/ref"]
MLA_COLUMNS += ["kern_T4/T1", "ref_T4/T1", "max_abs_diff", "note"]


def counted_work(B: int, T: int, mean_kv: float) -> tuple[float, float]:
    """(bytes, FLOPs) of one absorbed MLA call: q in, the latent cache once, o out (bf16);
    B * H * T * (2 * 576 + 2 * 512) * kv FLOPs."""
    nbytes = B * (T * H * W * 2 + mean_kv * W * 2 + T * H * L * 2)
    return float(nbytes), float(B * H * T * (2 * W + 2 * L) * mean_kv)


def _err(e: BaseException) -> str:
    msg = str(e)
    oom = "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower()
    return f"{'OOM' if oom else type(e).__name__}: {(msg.strip().splitlines() or [''])[0][:160]}"


def _rotating(fn, arg_sets, inner: int):
    """A thunk making ``inner`` calls of fn, each on the next argument set."""
    state = {"i": 0}

    def run():
        out = None
        for _ in range(inner):
            out = fn(*arg_sets[state["i"] % len(arg_sets)])
            state["i"] += 1
        return out

    return run


def _inner_for(fn, sample_s: float) -> int:
    """Back-to-back calls per timed sample so that a sample lasts about ``sample_s``."""
    if sample_s <= 0:
        return 1
    t = timeit(fn, warmup=0, repeats=3)["min_s"]
    return max(1, min(1000, math.ceil(sample_s / max(t, 1e-7))))


def copy_bandwidth(nbytes: int, rounds: int, sample_s: float) -> float:
    """Device copy bandwidth, GB/s: a jitted ``x * s`` over a bf16 array, read + written."""
    n = nbytes // 2
    x = jax.random.normal(jax.random.key(1), (n,), jnp.bfloat16)
    s = jnp.asarray(1.0, jnp.bfloat16)  # a runtime scalar: XLA cannot fold the multiply away
    f = jax.jit(lambda x, s: x * s).lower(x, s).compile()
    inner = _inner_for(lambda: f(x, s), sample_s)
    t = timeit(_rotating(f, [(x, s)], inner), warmup=1, repeats=rounds)["median_s"] / inner
    return 2 * n * 2 / t / 1e9


def mla_inputs(B: int, ctx: int, T: int, min_pool_bytes: int, unroll: int, seed: int = 0):
    """Argument groups ``(q_lat, q_pe, cache, kv_lens, *tables)`` over one random bf16 page
    pool of at least ``min_pool_bytes``, with disjoint shuffled block tables (consecutive
    calls read different pages, so a small config is not served from L2). Row t of a window
    ending at ctx sees ctx - T + 1 + t keys."""
    pages_per_seq = -(-ctx // PAGE)
    n_sets = max(1, min(256, -(-min_pool_bytes // (B * pages_per_seq * PAGE * W * 2))))
    n_sets = -(-n_sets // unroll) * unroll
    num_pages = n_sets * B * pages_per_seq
    rng = np.random.default_rng(seed)
    tables = rng.permutation(num_pages).astype(np.int32).reshape(n_sets, B, pages_per_seq)
    kc, kq, kp = jax.random.split(jax.random.key(seed), 3)
    cache = jax.random.normal(kc, (num_pages, PAGE, W), jnp.bfloat16)
    q_lat = jax.random.normal(kq, (B, T, H, L), jnp.bfloat16)
    q_pe = jax.random.normal(kp, (B, T, H, R), jnp.bfloat16)
    lens = jnp.asarray(np.broadcast_to(ctx - T + 1 + np.arange(T, dtype=np.int32), (B, T)))
    tables = [jnp.asarray(t) for t in tables]
    return [(q_lat, q_pe, cache, lens, *tables[i : i + unroll]) for i in range(0, n_sets, unroll)]


def _unrolled(fn):
    """One jitted program making one call of fn per table argument, back to back."""

    def many(q_lat, q_pe, cache, kv_lens, *tables):
        return tuple(fn(q_lat, q_pe, cache, t, kv_lens) for t in tables)

    return jax.jit(many)


def _kernel():
    from kernels.mla_decode import kernel_supports, mla_paged_attention

    if not kernel_supports(L, R, PAGE):
        raise ValueError("kernel does not take L=512, R=64, page 64")
    return mla_paged_attention


def _diff(row: dict, notes: list[str], got, want) -> None:
    row["max_abs_diff"] = float(jnp.max(jnp.abs(got[0] - want[0])))
    row["max_abs_diff_lse"] = float(jnp.max(jnp.abs(got[1] - want[1])))
    if not row["max_abs_diff"] <= O_ATOL:  # NaN included
        notes.append(f"MISMATCH: max |o - o_ref| > {O_ATOL}")


def mla_config(B, ctx, T, *, on_gpu, rounds, sample_s, min_pool, unroll, check) -> dict:
    row = {"B": B, "ctx": ctx, "T": T, "H": H, "L": L, "R": R, "page": PAGE}
    notes = []
    if B * ctx * W * 2 > 256 * 2**20:  # long past any launch overhead: one call a program
        unroll = 1
    groups = mla_inputs(B, ctx, T, min_pool, unroll)
    mean_kv = float(np.asarray(groups[0][3]).mean())
    nbytes, flops = counted_work(B, T, mean_kv)
    row.update(mean_kv=mean_kv, MB=nbytes / 1e6, unroll=unroll)
    fns = {"ref": functools.partial(mla_paged_attention_reference, sm_scale=SM_SCALE)}
    if on_gpu:
        try:
            fns["kern"] = functools.partial(_kernel(), sm_scale=SM_SCALE)
        except Exception as e:  # an import or dims problem: keep the reference's figures
            notes.append(f"kern: {_err(e)}")
    compiled, outs = {}, {}
    for name, fn in fns.items():
        try:
            compiled[name] = _unrolled(fn).lower(*groups[0]).compile()
            outs[name] = jax.block_until_ready(compiled[name](*groups[0])[0])
        except Exception as e:
            notes.append(f"{name}: {_err(e)}")
            compiled.pop(name, None)
    if "kern" in outs and "ref" in outs:
        _diff(row, notes, outs["kern"], outs["ref"])
    elif not on_gpu and check and "ref" in outs:
        try:  # one untimed interpret-mode call on sequence 0 (interpret mode is slow)
            kern = jax.jit(functools.partial(_kernel(), sm_scale=SM_SCALE, interpret=True))
            q_lat, q_pe, cache, lens, table = groups[0][:5]
            got = kern(q_lat[:1], q_pe[:1], cache, table[:1], lens[:1])
            notes.append("diff: kernel in interpret mode, sequence 0")
            _diff(row, notes, got, tuple(x[:1] for x in outs["ref"]))
        except Exception as e:
            notes.append(f"interpret check: {_err(e)}")
    outs.clear()
    if compiled:
        try:
            inner = {n: _inner_for(_rotating(c, groups, 1), sample_s) for n, c in compiled.items()}
            thunks = {n: _rotating(c, groups, inner[n]) for n, c in compiled.items()}
            for name, r in interleaved(thunks, warmup=1, repeats=rounds, keep=False).items():
                t = r.median / (inner[name] * unroll)
                row[f"{name}_us"] = t * 1e6
                row[f"{name}_GBps"] = nbytes / t / 1e9
                row[f"{name}_TFLOPs"] = flops / t / 1e12
        except Exception as e:
            notes.append(f"timing: {_err(e)}")
    if "kern_us" in row and "ref_us" in row:
        row["kern/ref"] = row["ref_us"] / row["kern_us"]  # speed-up over the reference
    row["note"] = "; ".join(notes)
    return row


def _mla_ratios(rows: list[dict], copy_gbps: float) -> None:
    """GB/s over the copy bandwidth, and each verify row's time over the T = 1 row's."""
    decode = {(r["B"], r["ctx"]): r for r in rows if r["T"] == 1}
    for r in rows:
        d = decode.get((r["B"], r["ctx"]))
        for name in ("kern", "ref"):
            if f"{name}_GBps" in r:
                r[f"{name}/copy"] = r[f"{name}_GBps"] / copy_gbps
            if d is not None and r["T"] != 1 and f"{name}_us" in r and f"{name}_us" in d:
                r[f"{name}_T4/T1"] = r[f"{name}_us"] / d[f"{name}_us"]


@SUITE.measure("mla_decode")
def mla_decode(args) -> Table:
    """Absorbed paged MLA decode / verify at the release's dims (H 32, L 512, R 64, bf16,
    pages of 64, shuffled block tables): the Pallas kernel against the XLA reference (GPU),
    GB/s against the device copy bandwidth measured in the same run.

    T = 1 is decode, T > 1 a verify window (row t sees ctx - T + 1 + t keys). bytes = B (T H
    576 2 + kv 576 2 + T H 512 2). On a GPU the two take turns and their outputs are
    compared; on a CPU only the reference is timed (reduced grid), its check an
    interpret-mode kernel call. On a GPU one program makes ``--unroll`` calls and a sample
    lasts about ``--sample-ms``. JSON rewritten after every config: a run cut short keeps its
    rows.
    """
    on_gpu = jax.default_backend() == "gpu"
    grid = FULL_GRID if (on_gpu or args.full) else CPU_GRID
    if args.quick and not on_gpu:
        grid = {"B": [1], "ctx": [512], "T": [1, 4]}
    Bs, ctxs, Ts = args.B or grid["B"], args.ctx or grid["ctx"], args.T or grid["T"]
    rounds = repeats(args, 20 if on_gpu else 3, 2)
    sample_s = (args.sample_ms or (20.0 if on_gpu else 0.0)) / 1e3
    copy_mib = args.copy_mib or (2048 if on_gpu else 64 if args.quick else 256)
    min_pool = (args.min_pool_mib or (512 if on_gpu else 8 if args.quick else 64)) * 2**20
    unroll = args.unroll or (8 if on_gpu else 1)
    print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind})", flush=True)
    try:
        copy = copy_bandwidth(copy_mib * 2**20, rounds, sample_s)
    except Exception:  # out of memory, most likely
        copy = copy_bandwidth(copy_mib * 2**17, rounds, sample_s)
    print(f"copy bandwidth: {copy:,.1f} GB/s", flush=True)
    meta = {"copy_GBps": copy, "grid": {"B": Bs, "ctx": ctxs, "T": Ts}, "repeats": rounds}
    meta["impls"] = "kern + ref" if on_gpu else "ref only (the Triton kernel needs a GPU)"
    rows: list[dict] = []
    t_start = time.perf_counter()
    for B in Bs:
        for ctx in ctxs:
            for T in Ts:
                if (
                    args.time_budget is not None
                    and time.perf_counter() - t_start > args.time_budget
                ):
                    rows.append({"B": B, "ctx": ctx, "T": T, "note": "skipped: time budget"})
                    continue
                t0 = time.perf_counter()
                try:
                    row = mla_config(
                        B,
                        ctx,
                        T,
                        on_gpu=on_gpu,
                        rounds=rounds,
                        sample_s=sample_s,
                        min_pool=min_pool,
                        unroll=unroll,
                        check=not args.no_interpret_check,
                    )
                except Exception as e:  # out of memory making the inputs, most likely
                    traceback.print_exc()
                    row = {"B": B, "ctx": ctx, "T": T, "note": f"skipped: {_err(e)}"}
                row["wall_s"] = time.perf_counter() - t0
                rows.append(row)
                print(f"done: B={B} ctx={ctx} T={T} ({row['wall_s']:.1f} s) {row['note']}")
                sys.stdout.flush()
                _mla_ratios(rows, copy)
                write_json("kernel_mla_decode", rows, meta, args.out)
    title = f"paged MLA decode, release dims, bf16; copy bandwidth {copy:,.1f} GB/s"
    return Table(title, rows, MLA_COLUMNS, meta)


# ---- DCP combine ------------------------------------------------------------------------------
def _a2a_ag(o, lse, c):
    o_m, lse_m = dcp.combine_a2a(o, lse, c)
    ax = dcp.DCP_AXIS
    return jax.lax.all_gather(o_m, ax, axis=2, tiled=True), jax.lax.all_gather(
        lse_m, ax, axis=2, tiled=True
    )


def combines(mesh: Mesh, c: int) -> dict:
    """name -> jitted fn(o [c, B, T, H, L], lse [c, B, T, H]), sharded over 'dcp' on axis 0."""
    ax = dcp.DCP_AXIS
    heads = (P(None, None, ax, None), P(None, None, ax))

    def wrap(f, out_specs):
        return jax.jit(shard_map(lambda o, lse: f(o[0], lse[0]), mesh, (P(ax), P(ax)), out_specs))

    return {
        "ag": wrap(dcp.combine_all_gather, (P(), P())),
        "a2a+ag": wrap(lambda o, l: _a2a_ag(o, l, c), (P(), P())),
        "ag_lse+psum": wrap(dcp.combine_lse_psum, (P(), P())),
        "a2a": wrap(lambda o, l: dcp.combine_a2a(o, l, c), heads),
        "ag_rs": wrap(lambda o, l: dcp.combine_ag_rs(o, l, c), heads),
    }


@SUITE.measure("dcp_combine", devices=8)
def dcp_combine(args) -> Table:
    """The DCP combine of the ranks' attention partials alone, on 8 emulated CPU devices
    (H 32, L 512, f32, median ms): the model's two head-sharded combines, ``ag_rs`` (default:
    all-gather the lse, reduce-scatter the rescaled o) and ``a2a`` (one all-to-all), beside the
    replicated ones (``ag``: all-gather o and lse, merge; ``a2a+ag``; ``ag_lse+psum``,
    ``dcp_attention``'s default).

    Emulated devices share the cores: this ranks the work and the copies, not NVLink.
    """
    rounds = repeats(args, 10, 3)
    cs = (2, 8) if args.quick else (2, 4, 8)
    shapes = ((1, 1), (8, 4)) if args.quick else ((1, 1), (8, 1), (32, 1), (8, 4), (64, 1))
    rows = []
    for c in cs:
        mesh = Mesh(np.array(jax.devices()[:c]), (dcp.DCP_AXIS,))
        fns = combines(mesh, c)
        for B, T in shapes:
            rng = np.random.default_rng(0)
            o = rng.standard_normal((c, B, T, 32, 512)).astype(np.float32)
            lse = (rng.standard_normal((c, B, T, 32)) * 3).astype(np.float32)
            lse[1:, 0], o[1:, 0] = -np.inf, 0.0  # a short sequence: only rank 0 has keys
            o = jax.device_put(o, NamedSharding(mesh, P(dcp.DCP_AXIS)))
            lse = jax.device_put(lse, NamedSharding(mesh, P(dcp.DCP_AXIS)))
            runs = interleaved(
                {k: functools.partial(f, o, lse) for k, f in fns.items()},
                warmup=1,
                repeats=rounds,
            )
            row = {"c": c, "B": B, "T": T, "o_MiB_per_rank": B * T * 32 * 512 * 4 / 2**20}
            row.update({f"{k}_ms": r.median * 1e3 for k, r in runs.items()})
            row["ag_rs/a2a"] = row["ag_rs_ms"] / row["a2a_ms"]
            ref = runs["ag"].results[0][0]
            row["max_abs_diff"] = max(
                float(jnp.max(jnp.abs(r.results[0][0] - ref))) for r in runs.values()
            )
            rows.append(row)
    columns = ["c", "B", "T", "o_MiB_per_rank", "a2a_ms", "ag_rs_ms", "ag_rs/a2a"]
    columns += ["ag_ms", "a2a+ag_ms", "ag_lse+psum_ms", "max_abs_diff"]
    return Table(f"combine alone, median ms of {rounds}", rows, columns)


# ---- KDA prefill ------------------------------------------------------------------------------
def kda_inputs(t: int, h: int, d: int, seed: int = 0):
    """B = 1 inputs in the model's ranges: unit-norm q / k, g <= 0, beta in (0, 1)."""
    rng = np.random.default_rng(seed)

    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q = unit(rng.standard_normal((1, t, h, d), np.float32))
    k = unit(rng.standard_normal((1, t, h, d), np.float32))
    v = rng.standard_normal((1, t, h, d), np.float32)
    g = -np.logaddexp(0.0, -(rng.standard_normal((1, t, h, d), np.float32) + 3.0))
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((1, t, h), np.float32)))
    return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta))


@SUITE.measure("kda")
def kda(args) -> Table:
    """KDA prefill: the chunked form (C = 64; the accelerators' path) against the recurrent
    scan (the CPU's), float32, B = 1, at the ``small`` preset's heads (6) and the release's
    (32), K = V = 128; tokens/s from the median call, and the ratio of the fastest calls.
    """
    t = args.kda_len or (256 if args.quick else 2048)
    shapes = [("small", preset("small"))]
    if not args.quick:
        shapes.append(("release", preset("kimi-linear-48b-a3b")))
    rows = []
    for name, cfg in shapes:
        a = kda_inputs(t, cfg.linear_num_heads, cfg.linear_head_dim)
        impls = {
            "chunked": functools.partial(kda_chunked, chunk_size=64),
            "recurrent": kda_recurrent,
        }
        compiled = {k: jax.jit(f).lower(*a).compile() for k, f in impls.items()}
        runs = interleaved(
            {k: functools.partial(c, *a) for k, c in compiled.items()},
            warmup=1,
            repeats=repeats(args, 5 if name == "small" else 3, 2),
        )
        row = {"shape": name, "T": t, "H": cfg.linear_num_heads, "K=V": cfg.linear_head_dim}
        for k, r in runs.items():
            row[f"{k}_tok_s"] = t / r.median
        row["chunked/recurrent"] = row["chunked_tok_s"] / row["recurrent_tok_s"]
        row["ratio_of_fastest"] = runs["recurrent"].best / runs["chunked"].best
        outs = {k: r.results[0] for k, r in runs.items()}
        row["max_abs_diff"] = max(
            float(jnp.max(jnp.abs(outs["chunked"][i] - outs["recurrent"][i]))) for i in range(2)
        )
        rows.append(row)
    return Table(f"KDA prefill, B = 1, T = {t}, f32", rows, list(rows[0]))


# ---- the full forward against transformers ----------------------------------------------------
@SUITE.measure("forward")
def forward(args) -> Table:
    """The full no-cache forward (logits at every position, B = 1, float32) against
    transformers on the same checkpoint (pure-torch fallback, all cores), ours with the
    default KDA prefill (the recurrent scan on a CPU) and the chunked form; the logits are
    compared.
    """
    import torch

    from benchmarks.decode import count_params, load_transformers

    torch.set_num_threads(os.cpu_count() or 1)
    name = "tiny" if args.quick else "small"
    lens = args.forward_lens or ([32] if args.quick else [128, 512])
    model = random_model(preset(name), seed=0, dtype=jnp.float32)
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp)
        tmodel = load_transformers(tmp)
    graphdef, params = nnx.split(model)
    chunked = nnx.graphdef(set_kda_impl(model, "chunked"))
    rng = np.random.default_rng(0)
    rows = []
    for t in lens:
        ids = rng.integers(0, model.config.vocab_size, (1, t), dtype=np.int32)
        ours = model_forward.lower(graphdef, params, jnp.asarray(ids)).compile()
        ours_chunked = model_forward.lower(chunked, params, jnp.asarray(ids)).compile()
        ids_t = torch.as_tensor(ids, dtype=torch.long)

        def theirs(ids_t=ids_t):
            with torch.no_grad():
                return tmodel(ids_t).logits.numpy()

        runs = interleaved(
            {
                "ours": functools.partial(ours, params, jnp.asarray(ids)),
                "ours_chunked": functools.partial(ours_chunked, params, jnp.asarray(ids)),
                "transformers": theirs,
            },
            warmup=1,
            repeats=repeats(args, 2, 1),
        )
        want = runs["transformers"].results[0].astype(np.float64)
        row = {"T": t, **{f"{k}_tok_s": t / r.median for k, r in runs.items()}}
        row["ours/transformers"] = row["ours_tok_s"] / row["transformers_tok_s"]
        row["chunked/transformers"] = row["ours_chunked_tok_s"] / row["transformers_tok_s"]
        row["ratio_of_fastest"] = runs["transformers"].best / runs["ours"].best
        got = np.asarray(runs["ours"].results[0], np.float64)
        row["max_rel_err"] = float(np.abs(got - want).max() / np.abs(want).max())
        rows.append(row)
    title = f"{name} preset ({count_params(model) / 1e6:.1f}M parameters), B = 1, f32"
    meta = {"torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    return Table(title, rows, list(rows[0]), meta)


# ---- the CPU routed experts' tiles ------------------------------------------------------------
# What each variant traces with: PAIR_TILES_UP_TO (0: tiles of min(N, TILE_ROWS) rows always;
# a large value: one-pair tiles always); "dense" runs every expert on every token.
TILE_VARIANTS = {"rule": None, "row tiles": 0, "pair tiles": 10**9, "dense": None}


@SUITE.measure("moe")
def moe(args) -> Table:
    """The CPU path of the routed experts over N tokens: the tile rule (``moe.tile_rows``: one
    (token, expert) pair a tile while the experts average at most ``PAIR_TILES_UP_TO`` pairs,
    else min(N, 128) rows) against row tiles always, pair tiles always and the dense
    reference, float32, ``small`` shapes; the outputs checked against the dense one.

    Each variant is compiled by itself (the tile size is chosen when the product is traced).
    """
    name = "tiny" if args.quick else "small"
    tokens = [1, 8, 32] if args.quick else [1, 8, 32, 64, 160, 512]
    config = preset(name)
    layer = moe_mod.MoE(config, dtype=jnp.float32, rngs=nnx.Rngs(0), dispatch="tiled")
    weights = (layer.experts.w1[...], layer.experts.w3[...], layer.experts.w2[...])
    saved = moe_mod.PAIR_TILES_UP_TO
    rows = []
    for n in tokens:
        x = jax.random.normal(jax.random.key(n), (n, config.hidden_size))
        w, idx = layer.gate(x)
        calls, outs = {}, {}
        for variant, limit in TILE_VARIANTS.items():
            path = moe_mod.Experts.dense if variant == "dense" else moe_mod.Experts.tiled

            def routed(w1, w3, w2, x, w, idx, path=path):
                return path(types.SimpleNamespace(w1=w1, w3=w3, w2=w2), x, w, idx)

            moe_mod.PAIR_TILES_UP_TO = saved if limit is None else limit
            jax.clear_caches()
            try:
                compiled = jax.jit(routed).lower(*weights, x, w, idx).compile()
            finally:
                moe_mod.PAIR_TILES_UP_TO = saved
            calls[variant] = functools.partial(compiled, *weights, x, w, idx)
            outs[variant] = calls[variant]()
        ref = outs["dense"]
        for variant, y in outs.items():
            err = float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref)))
            if err > 1e-5:
                raise AssertionError(f"{variant}, N = {n}: relative error {err:.2e} vs dense")
        runs = interleaved(calls, warmup=2, repeats=repeats(args, 20, 3), keep=False)
        rule_rows = moe_mod.tile_rows(n, config.num_experts_per_token, config.num_experts)
        for variant, r in runs.items():
            row = {"N": n, "variant": variant, "median_ms": r.median * 1e3}
            row["min_ms"] = r.best * 1e3
            row["rule's tile rows"] = rule_rows
            rows.append(row)
        add_ratio(rows[-len(runs) :], "median_ms", rows[-len(runs)], "vs_rule")
    title = (
        f"routed experts, {name} (E = {config.num_experts}, k = "
        f"{config.num_experts_per_token}), PAIR_TILES_UP_TO = {saved}"
    )
    columns = ["N", "variant", "median_ms", "min_ms", "vs_rule", "rule's tile rows"]
    return Table(title, rows, columns)
