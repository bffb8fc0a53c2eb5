"""The paged MLA decode/verify kernel (interpret mode) against its pure-JAX reference.

Also: poisoned pages must not change a bit of the output, verify rows equal single-row decodes,
and every variant lowers for CUDA (which enforces the Triton rules interpret mode ignores).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.mla_decode import kernel_supports, mla_paged_attention
from kimi_linear_jax.ops.mla import mla_paged_attention_reference
from kimi_linear_jax.presets import preset
from tests.helpers import abstract_gpu, assert_close

# Per-dtype tolerances (max-abs, relative RMS) for o, and max-abs for the finite lse, ~5-20x
# above what is reached. f32 reaches <= 5e-7 on o and lse (sums reassociated over pages and
# splits). bf16 reaches 2.2e-3 max-abs and 1.3e-3 relative RMS on o: the kernel casts the
# probabilities to bf16 for the value product (tensor cores) where the reference keeps them f32;
# the scores are the same bf16 products summed in f32, so lse stays at 5e-7.
TOL = {
    jnp.float32: dict(o=dict(atol=1e-5, rtol_rms=1e-5), lse=1e-5),
    jnp.bfloat16: dict(o=dict(atol=1e-2, rtol_rms=5e-3), lse=1e-5),
}

# Interpret mode compiles the kernel as an XLA program per shape; skipping the LLVM
# optimisation passes roughly halves that and changes speed only, not float semantics.
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}

reference = jax.jit(
    mla_paged_attention_reference, static_argnames=("sm_scale",), compiler_options=_FAST_COMPILE
)


@functools.cache
def kernel(**knobs):
    """The kernel in interpret mode, one compiled wrapper per knob setting."""
    fn = functools.partial(mla_paged_attention, interpret=True, **knobs)
    return jax.jit(fn, compiler_options=_FAST_COMPILE)


@dataclass(frozen=True)
class Case:
    """A ragged paged batch: ctx[b] tokens per sequence, verify rows, P table entries."""

    T: int
    H: int
    page_size: int
    P: int  # block-table width
    ctx: tuple[int, ...]  # B sequence lengths (0 = an empty / padding sequence)
    dtype: type = jnp.float32
    L: int = 64
    R: int = 16
    knobs: tuple = ()

    @property
    def id(self) -> str:
        d = "bf16" if self.dtype == jnp.bfloat16 else "f32"
        parts = [f"T{self.T}-H{self.H}-L{self.L}-R{self.R}-ps{self.page_size}-P{self.P}-{d}"]
        return "-".join(parts + [f"{n}{v}" for n, v in self.knobs])


def verify_lens(ctx, T: int) -> np.ndarray:
    """kv_lens [B, T]: row t of a window ending at ctx sees ctx - T + 1 + t keys."""
    ctx = np.asarray(ctx)[:, None]
    lens = ctx - T + 1 + np.arange(T)[None, :]
    return np.where(ctx > 0, np.maximum(lens, 0), 0).astype(np.int32)


def make_batch(case: Case, seed: int = 0):
    """Inputs with a shuffled block table; unused table entries point at pages nobody owns.

    Returns (q_lat, q_pe, cache, block_table, kv_lens, unowned) with `unowned` a boolean mask
    [num_pages, page_size] of cache slots no sequence may read.
    """
    rng = np.random.default_rng(seed)
    B, ps = len(case.ctx), case.page_size
    owned = [-(-c // ps) for c in case.ctx]
    num_pages = sum(owned) + 4  # 4 spare pages that nobody owns
    perm = rng.permutation(num_pages)
    spare = perm[sum(owned) :]
    table = rng.choice(spare, size=(B, case.P)).astype(np.int32)
    unowned = np.ones((num_pages, ps), bool)
    start = 0
    for b, (n, c) in enumerate(zip(owned, case.ctx)):
        table[b, :n] = perm[start : start + n]
        start += n
        for j, page in enumerate(table[b, :n]):
            unowned[page, : max(0, min(ps, c - j * ps))] = False
    W = case.L + case.R
    cache = rng.standard_normal((num_pages, ps, W)).astype(np.float32)
    q_lat = rng.standard_normal((B, case.T, case.H, case.L)).astype(np.float32)
    q_pe = rng.standard_normal((B, case.T, case.H, case.R)).astype(np.float32)
    cast = lambda x: jnp.asarray(x, case.dtype)
    lens = jnp.asarray(verify_lens(case.ctx, case.T))
    return cast(q_lat), cast(q_pe), cast(cache), jnp.asarray(table), lens, unowned


def sm_scale(case: Case) -> float:
    return (case.L + case.R) ** -0.5


def check(actual, expected, dtype, name: str) -> None:
    """o everywhere; lse: the same empty rows (-inf), the rest within tolerance."""
    (o, lse), (o_ref, lse_ref) = actual, expected
    tol = TOL[dtype]
    assert_close(o, o_ref, **tol["o"], name=f"{name} o")
    lse, lse_ref = np.asarray(lse), np.asarray(lse_ref)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref), err_msg=f"{name} empty")
    seen = np.isfinite(lse_ref)
    assert_close(lse[seen], lse_ref[seen], atol=tol["lse"], rtol_rms=tol["lse"], name=f"{name} lse")


CASES = [
    # decode; table width 7 with 3 splits; a length that is a page multiple and an empty one
    Case(T=1, H=3, page_size=16, P=7, ctx=(37, 0, 96, 5), knobs=(("num_splits", 3),)),
    Case(T=1, H=5, page_size=64, P=3, ctx=(150, 1), dtype=jnp.bfloat16),
    # verify windows; 24 folded rows in two row blocks of 16
    Case(T=2, H=5, page_size=64, P=3, ctx=(130, 0, 64), knobs=(("num_splits", 2),)),
    Case(
        T=5,
        H=3,
        page_size=16,
        P=9,
        ctx=(5, 71, 140),
        dtype=jnp.bfloat16,
        knobs=(("num_splits", 4),),
    ),
    Case(T=8, H=3, page_size=16, P=7, ctx=(100, 8, 0), knobs=(("pages_per_split", 2),)),
    Case(T=8, H=3, page_size=16, P=5, ctx=(77, 9), dtype=jnp.bfloat16, knobs=(("block_h", 16),)),
    # the release dims, L = 512 latent + R = 64 rope
    Case(T=1, H=16, page_size=64, P=3, ctx=(130, 0, 64), dtype=jnp.bfloat16, L=512, R=64),
    Case(T=2, H=3, page_size=16, P=5, ctx=(50, 17), L=512, R=64, knobs=(("num_splits", 2),)),
    # bf16 with 64 folded rows: the 64-row tile (wgmma's) walks pages in half-page key tiles
    Case(T=4, H=16, page_size=64, P=3, ctx=(150, 70), dtype=jnp.bfloat16, L=512, R=64),
    # every tile knob below its default: key tiles, latent output tiles, score chunks
    Case(
        T=3,
        H=5,
        page_size=64,
        P=3,
        ctx=(129, 40),
        L=128,
        knobs=(("block_n", 16), ("block_l", 32), ("block_k", 64)),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_reference(case: Case):
    q_lat, q_pe, cache, table, lens, _ = make_batch(case)
    scale = sm_scale(case)
    got = kernel(sm_scale=scale, **dict(case.knobs))(q_lat, q_pe, cache, table, lens)
    want = reference(q_lat, q_pe, cache, table, lens, sm_scale=scale)
    check(got, want, case.dtype, case.id)


@pytest.mark.parametrize("poison", [np.nan, np.inf, 1e30], ids=["nan", "inf", "1e30"])
@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=lambda c: c.id)
def test_reference_ignores_poisoned_slots(case: Case, poison: float):
    """The XLA path (a CPU, and the fallback where the kernel does not apply) as the kernel:
    slots no row may see never reach an output, not even as 0 x NaN."""
    q_lat, q_pe, cache, table, lens, unowned = make_batch(case)
    clean = reference(q_lat, q_pe, cache, table, lens, sm_scale=sm_scale(case))
    poisoned = jnp.where(jnp.asarray(unowned)[..., None], jnp.asarray(poison, cache.dtype), cache)
    dirty = reference(q_lat, q_pe, poisoned, table, lens, sm_scale=sm_scale(case))
    for a, b, name in zip(clean, dirty, ("o", "lse")):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.mark.parametrize("poison", [np.nan, 1e30], ids=["nan", "1e30"])
@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[-1]], ids=lambda c: c.id)
def test_poisoned_pages_leave_output_bit_identical(case: Case, poison: float):
    q_lat, q_pe, cache, table, lens, unowned = make_batch(case)
    fn = kernel(sm_scale=sm_scale(case), **dict(case.knobs))
    clean = fn(q_lat, q_pe, cache, table, lens)
    poisoned = jnp.where(jnp.asarray(unowned)[..., None], jnp.asarray(poison, cache.dtype), cache)
    dirty = fn(q_lat, q_pe, poisoned, table, lens)
    for a, b, name in zip(clean, dirty, ("o", "lse")):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.mark.parametrize("case", [CASES[3], CASES[4]], ids=lambda c: c.id)
def test_verify_rows_equal_single_row_decodes(case: Case):
    """Row t of a verify window is the decode of a query that sees ctx - T + 1 + t keys."""
    q_lat, q_pe, cache, table, lens, _ = make_batch(case)
    fn = kernel(sm_scale=sm_scale(case), **dict(case.knobs))
    o, lse = fn(q_lat, q_pe, cache, table, lens)
    np.testing.assert_array_equal(np.asarray(lens), verify_lens(case.ctx, case.T))
    for t in range(case.T):
        sl = slice(t, t + 1)
        got = fn(q_lat[:, sl], q_pe[:, sl], cache, table, lens[:, sl])
        check((o[:, sl], lse[:, sl]), got, case.dtype, f"t={t}")


@pytest.mark.parametrize(
    ("knob", "message"),
    [
        ({"block_h": 24}, "block_h = 24 must be a power of two"),
        ({"block_n": 32}, r"block_n = 32 must be a power of two in \[16, 16\]"),
        ({"block_l": 8}, r"block_l = 8 must be a power of two in \[16, 64\]"),
        ({"block_k": 48}, r"block_k = 48 must be a power of two in \[16, 64\]"),
    ],
)
def test_bad_tile_raises(knob, message):
    case = Case(T=1, H=3, page_size=16, P=2, ctx=(3,))
    q_lat, q_pe, cache, table, lens, _ = make_batch(case)
    with pytest.raises(ValueError, match=message):
        mla_paged_attention(q_lat, q_pe, cache, table, lens, sm_scale=1.0, **knob)


def _abstract(B, T, H, L, R, page_size, P, dtype, num_pages=64):
    s = jax.ShapeDtypeStruct
    return (
        s((B, T, H, L), dtype),
        s((B, T, H, R), dtype),
        s((num_pages, page_size, L + R), dtype),
        s((B, P), jnp.int32),
        s((B, T), jnp.int32),
    )


LOWERING_KNOBS = [
    {},
    {"block_h": 16, "num_splits": 3, "num_warps": 4, "num_stages": 3},
    {"block_h": 32, "pages_per_split": 1, "num_warps": 8, "num_stages": 2},
]


@pytest.mark.parametrize(
    "knobs", LOWERING_KNOBS, ids=lambda k: "-".join(f"{n}{v}" for n, v in k.items()) or "default"
)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize(("T", "H", "page_size"), [(1, 5, 64), (8, 32, 16)], ids=["T1", "T8"])
def test_lowers_for_cuda(T, H, page_size, dtype, knobs):
    """The Triton rules (power-of-two tiles, dot operands >= 16, the 512 + 64 split) hold."""
    args = _abstract(B=3, T=T, H=H, L=512, R=64, page_size=page_size, P=7, dtype=dtype)
    fn = functools.partial(mla_paged_attention, sm_scale=576**-0.5, **knobs)
    with abstract_gpu():
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    assert "xla.gpu.triton" in lowered.as_text()


@pytest.mark.parametrize("name", ["pycode", "pycode-draft"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("T", [1, 9])
def test_lowers_for_cuda_at_the_builtin_models_dims(name, dtype, T):
    """The built-in models run the kernel on a GPU (their L, R and page size are powers of two
    >= 16, so `paged_attention` does not fall back): it must lower at their dims too, for a
    decode step and a verify window of k = 8."""
    config = preset(name)
    L, R, H = config.kv_lora_rank, config.qk_rope_head_dim, config.num_attention_heads
    assert kernel_supports(L, R, 16)
    args = _abstract(B=1, T=T, H=H, L=L, R=R, page_size=16, P=4, dtype=dtype)
    fn = functools.partial(mla_paged_attention, sm_scale=(L + R) ** -0.5)
    with abstract_gpu():
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    assert "xla.gpu.triton" in lowered.as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("T", [1, 4])
def test_compiled_matches_reference_on_gpu(T: int, dtype):
    """The compiled Triton kernel (not interpret mode) at the release dims, where a GPU exists."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a CUDA device (run with JAX_PLATFORMS=cuda -m gpu)")
    case = Case(T=T, H=32, page_size=64, P=20, ctx=(1200, 0, 65, 700), dtype=dtype, L=512, R=64)
    q_lat, q_pe, cache, table, lens, _ = make_batch(case)
    got = mla_paged_attention(q_lat, q_pe, cache, table, lens, sm_scale=sm_scale(case))
    with jax.default_matmul_precision("highest"):  # no TF32 in the f32 reference
        want = reference(q_lat, q_pe, cache, table, lens, sm_scale=sm_scale(case))
    check(got, want, dtype, case.id)
