"""The kernel compiled for an H200 without one (`kernels/gpu_target.py`): XLA's Triton pipeline
and ptxas run for sm_90a under the H200's real limits. Needs the gpu-compile extra and the CUDA
plugin (`make gpu-compile` runs these, marked `deviceless`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kernels.gpu_target import Target, compile_deviceless, topology
from kernels.mla_decode import mla_paged_attention

pytestmark = pytest.mark.deviceless

H200 = Target.load("h200")
BF16, F32 = jnp.bfloat16, jnp.float32


def compile_kernel(q_dtype, cache_dtype, T, H, page_size, L=512, R=64, B=4, tokens=4096, **knobs):
    """The release-dims kernel compiled for the H200: its one MLA kernel's stats."""
    sharding = NamedSharding(Mesh(topology("h200").devices, ("x",)), PartitionSpec())
    P = tokens // page_size

    def arg(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    args = (
        arg((B, T, H, L), q_dtype),
        arg((B, T, H, R), q_dtype),
        arg((B * P, page_size, L + R), cache_dtype),
        arg((B, P), jnp.int32),
        arg((B, T), jnp.int32),
    )
    step = jax.jit(functools.partial(mla_paged_attention, sm_scale=0.05, **knobs))
    (kernel,) = compile_deviceless(step, *args).kernel("mla_paged_attention")
    return kernel


@pytest.mark.parametrize(
    ("q_dtype", "cache_dtype"), [(BF16, BF16), (F32, F32), (F32, BF16)], ids=["bf16", "f32", "mix"]
)
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize(("T", "H"), [(1, 32), (9, 8)], ids=["decode", "verify-tp4"])
def test_default_tiles_compile_without_spills(q_dtype, cache_dtype, page_size, T, H):
    k = compile_kernel(q_dtype, cache_dtype, T, H, page_size)
    assert k.spills == 0, k
    assert 0 < k.smem <= H200.smem_per_block, k
    assert k.blocks_per_sm(H200) >= 1
    assert k.mma in ("mma.sync", "wgmma")


def test_bf16_at_64_rows_uses_wgmma():
    """Two verify tokens of 32 heads fill a 64-row tile: Hopper's wgmma, no spill."""
    k = compile_kernel(BF16, BF16, T=2, H=32, page_size=64)
    assert (k.mma, k.spills) == ("wgmma", 0), k


def test_the_former_f32_tiles_do_not_fit_an_h200():
    """The check applies the real limit: a whole 64-key f32 page over the whole latent asked
    294,912 B of shared memory, more than the 232,448 B a block may have."""
    with pytest.raises(Exception, match="Shared memory size limit exceeded"):
        compile_kernel(F32, F32, 1, 32, 64, block_n=64, block_l=512, block_k=512)


def test_spills_are_read_back():
    """And ptxas's spills come back: f32 at 16-key pages over the whole latent spills."""
    k = compile_kernel(F32, F32, 1, 32, 16, block_l=512, block_k=512)
    assert k.spills > 0 and k.stack > 0, k
