"""The serving engine's compiled steps lower for a GPU.

No GPU runs in CI, and the lent one comes for minutes at a time, so a step that fails to lower
for CUDA would first show there. Here an engine serves the built-in models on the CPU while
every distinct call of its jitted steps is also lowered for CUDA, as a GPU would trace it:
`jax.default_backend()` reports "gpu" (so the trace takes the GPU's paths: the Pallas MLA
kernel, the ragged MoE product, the chunked KDA prefill, bfloat16 products as they are) and
the model's attention is the kernel. Then the call runs on the CPU as usual, so the engine
goes on through prefill, decode, verify windows, draft steps and prefix hits.

Lowering checks that every op has a CUDA lowering and that the Pallas kernel lowers to Triton
at these shapes; `make gpu-compile` compiles the same steps for an H200 without one
(`benchmarks/gpu_compile.py`), and `benchmarks/gpu_check.sh` runs them on a lent GPU.
"""

from __future__ import annotations

import pytest

from serving.engine import LLM
from serving.step_compile import StepCapture, exercise
from tests.helpers import JAX_0_11, abstract_gpu

# The Pallas kernel lowered for a GPU: a call of the Triton custom call.
TRITON = "__gpu$xla.gpu.triton"


NGRAM = {"method": "ngram", "num_draft_tokens": 3}
DRAFT_TREE = {"method": "draft_model", "num_draft_tokens": 4, "topk": 2}
# TP x DCP: jax >= 0.11 lowers the Triton call only under an abstract GPU mesh, and shard_map
# then refuses the engine's concrete (CPU) mesh; jax 0.10 lowers it as it is.
SHARDED_NEEDS_JAX_0_10 = pytest.mark.skipif(
    JAX_0_11,
    reason="a sharded step lowers for CUDA on a CPU-only machine with jax 0.10 only",
)


@pytest.mark.parametrize(
    ("speculative", "dtype", "parallel"),
    [
        # 55 s; the n-gram engine's steps include the plain engine's (asserted below).
        pytest.param(None, "auto", {}, marks=pytest.mark.heavy),
        (NGRAM, "auto", {}),
        # 25 s each (bfloat16 compiles every step anew; the mesh): with the heavy tests.
        pytest.param(
            {"method": "draft_model", "num_draft_tokens": 3},
            "bfloat16",
            {},
            marks=pytest.mark.heavy,
        ),
        pytest.param(
            NGRAM,
            "auto",
            {"tensor_parallel_size": 4, "dcp_size": 2},
            marks=[pytest.mark.heavy, SHARDED_NEEDS_JAX_0_10],
        ),
        # Draft trees: the tree verify (the kernel over the prefix) and the draft's top-k.
        pytest.param(DRAFT_TREE, "auto", {}, marks=pytest.mark.heavy),
    ],
    ids=["plain", "ngram", "draft-bf16", "ngram-tp4-dcp2", "draft-tree"],
)
def test_engine_steps_lower_for_cuda(speculative, dtype, parallel):
    """Greedy and sampled requests, a prefix hit: every step the engine ran lowers for CUDA,
    and the decode and verify steps and the prefill over a cached prefix call the kernel (on
    a mesh too: the kernel inside the model's shard_map, the lse merge over DCP ranks)."""
    # One batch bucket: each step compiles (on the CPU) and lowers once, not once per batch
    # size (70 -> 49 s); the shapes a GPU would serve are these steps' too.
    with StepCapture(lowering_context=abstract_gpu) as lowering:
        llm = LLM(
            max_num_seqs=2, batch_buckets=(2,), dtype=dtype, speculative=speculative, **parallel
        )
        exercise(llm)
    assert llm.metrics()["prefix_cache_hit_tokens"] > 0

    assert not lowering.failures, lowering.failures
    targets = ["verify_step"] if speculative else ["decode_steps"]
    if speculative == DRAFT_TREE:
        targets = ["verify_tree_step"]
    if speculative == NGRAM:
        # Draftless runs, and the decode program of steps where no row drafts (sampled rows
        # step one call at a time): the plain engine's steps, so that case can be heavy.
        targets += ["decode_until_recurs", "decode_steps"]
    for target in targets:
        texts = lowering.lowered(target)
        assert texts and all(TRITON in t for t in texts), target
    with_kernel = [t for t in lowering.lowered("prefill_step") if TRITON in t]
    assert with_kernel, "no prefill over a cached prefix was lowered"
