"""The Mosaic GPU MLA kernel (`kernels/mla_decode_mgpu.py`) in Mosaic GPU's interpreter against
the pure-JAX reference: the same ragged paged batches as the Triton kernel's tests.

The interpreter is public from jax 0.12 (`make test-py312` runs these); on older jax the kernel
refuses with a clear error, which is tested instead."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest

from kernels import mla_decode_mgpu
from kernels.mla_decode_mgpu import mla_paged_attention_mgpu
from tests.kernels.test_mla_decode import Case, check, make_batch, reference, sm_scale

BF16 = jnp.bfloat16
needs_interpreter = pytest.mark.skipif(
    not mla_decode_mgpu.available(), reason="Mosaic GPU's interpreter needs jax >= 0.12"
)

CASES = [
    # 16-key pages, four a 64-key step; two splits; an empty sequence
    Case(
        T=1,
        H=5,
        page_size=16,
        P=9,
        ctx=(37, 0, 130),
        dtype=BF16,
        L=64,
        R=64,
        knobs=(("num_splits", 2),),
    ),
    # a verify window of 9 x 8 = 72 rows: two 64-row blocks; 32-key pages
    Case(
        T=9, H=8, page_size=32, P=5, ctx=(140, 9), dtype=BF16, L=128, R=64, knobs=(("block_l", 64),)
    ),
    # the release dims (L 512 + R 64), 64-key pages, latent in 128-column tiles
    Case(T=2, H=4, page_size=64, P=3, ctx=(150, 64), dtype=BF16, L=512, R=64),
]


def run(case: Case, cache=None, **extra):
    q_lat, q_pe, c, table, lens, _ = make_batch(case)
    knobs = dict(case.knobs) | extra
    return mla_paged_attention_mgpu(
        q_lat,
        q_pe,
        c if cache is None else cache,
        table,
        lens,
        sm_scale=sm_scale(case),
        interpret=True,
        **knobs,
    )


@needs_interpreter
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_reference(case: Case):
    q_lat, q_pe, cache, table, lens, _ = make_batch(case)
    want = reference(q_lat, q_pe, cache, table, lens, sm_scale=sm_scale(case))
    check(run(case), want, case.dtype, case.id)


@needs_interpreter
@pytest.mark.parametrize("poison", [np.nan, 1e30], ids=["nan", "1e30"])
def test_poisoned_slots_leave_output_bit_identical(poison):
    """Slots no row may read (the tail of a last page, pages nobody owns) hold garbage."""
    case = CASES[0]
    _, _, cache, _, _, unowned = make_batch(case)
    dirty = jnp.where(jnp.asarray(unowned)[..., None], jnp.asarray(poison, BF16), cache)
    for a, b, name in zip(run(case), run(case, cache=dirty), ("o", "lse")):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@needs_interpreter
def test_barriers_have_no_races():
    check(run(CASES[0], detect_races=True), run(CASES[0]), BF16, "races")


@needs_interpreter
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(dtype=jnp.float32), "takes bfloat16 queries and cache"),
        (dict(page_size=128, P=2), "takes page sizes (16, 32, 64)"),
        (dict(knobs=(("block_l", 32),)), "block_l must be a power of two in [64, 64]"),
        (dict(knobs=(("num_splits", 4),)), "num_splits must be in [1, 3] (64-key steps)"),
    ],
)
def test_bad_input_raises(change, message):
    case = Case(**{**CASES[0].__dict__, **change})
    with pytest.raises(ValueError, match=re.escape(message)):
        run(case)


@pytest.mark.skipif(mla_decode_mgpu.available(), reason="this jax has the Mosaic GPU API")
def test_older_jax_is_told_to_use_the_triton_kernel():
    with pytest.raises(NotImplementedError, match="needs jax >= 0.12"):
        run(CASES[0])
