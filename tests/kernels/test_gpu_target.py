"""The deviceless compile's readers (`kernels/gpu_target.py`) on text in the formats XLA's
thunk-sequence dump and `ptxas -v` print, and the occupancy arithmetic."""

from __future__ import annotations

import pytest

from kernels.gpu_target import KernelStats, Target, parse_ptxas, parse_thunks

THUNKS = """\
001: kCustomKernel [source       | next=002 (1)] loop_broadcast_fusion grid: [1, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
002: kCustomKernel [prev=001 (1) | sink        ] mla_paged_attention_32_64_512_512 grid: [1, 16, 4] threads: [256, 1, 1]  shared_memory: 114688 bytes
"""  # noqa: E501

PTXAS = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'loop_broadcast_fusion' for 'sm_90a'
ptxas info    : Function properties for loop_broadcast_fusion
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, used 0 barriers
ptxas info    : Compiling entry function 'mla_paged_attention_32_16_512_512' for 'sm_90a'
ptxas info    : Function properties for mla_paged_attention_32_16_512_512
    9576 bytes stack frame, 13528 bytes spill stores, 15248 bytes spill loads
ptxas info    : Used 32 registers, used 1 barriers, 9576 bytes cumulative stack size
"""


def test_parse_thunks():
    first, mla = parse_thunks(THUNKS)
    assert (first.name, first.grid, first.threads, first.smem) == (
        "loop_broadcast_fusion",
        (1, 1, 1),
        128,
        0,
    )
    assert (mla.name, mla.grid, mla.threads, mla.smem) == (
        "mla_paged_attention_32_64_512_512",
        (1, 16, 4),
        256,
        114688,
    )


def test_parse_ptxas_keeps_each_entry_its_own_frame():
    stats = parse_ptxas(PTXAS)
    assert stats == {
        "loop_broadcast_fusion": (10, 0, 0, 0),
        "mla_paged_attention_32_16_512_512": (32, 13528, 15248, 9576),
    }


H200 = Target.load("h200")


def test_h200_target_fields():
    assert (H200.sms, H200.smem_per_block, H200.smem_per_sm) == (132, 232448, 233472)
    assert (H200.regs_per_sm, H200.threads_per_sm, H200.bandwidth) == (65536, 2048, 4.8e12)


@pytest.mark.parametrize(
    ("threads", "regs", "smem", "blocks"),
    [
        (256, 178, 114688, 1),  # registers: 8 warps x 184 x 32 = 47,104 of 65,536
        (256, 128, 56320, 2),  # registers: 2 x 32,768; shared memory would allow 4
        (128, 150, 37376, 3),  # registers (152 x 32 x 4 = 19,456 a block): 3
        (256, 32, 0, 8),  # threads: 2,048 / 256
        (128, 32, 232448, 1),  # shared memory: one block of 227 KiB (+1 KiB reserved)
    ],
)
def test_blocks_per_sm(threads, regs, smem, blocks):
    k = KernelStats("k", (1,), threads, smem, registers=regs)
    assert k.blocks_per_sm(H200) == blocks
    assert k.occupancy(H200) == blocks * threads / 32 / 64


def test_unknown_target_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown GPU target 'h100'; known: \['h200'\]"):
        Target.load("h100")
