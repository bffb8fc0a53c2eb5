"""The serving engine's compiled steps lower for a GPU.

No GPU runs in CI, and the lent one comes for minutes at a time, so a step that fails to lower
for CUDA would first show there. Here an engine serves the built-in models on the CPU while
every distinct call of its jitted steps is also lowered for CUDA, as a GPU would trace it:
`jax.default_backend()` reports "gpu" (so the trace takes the GPU's paths: the Pallas MLA
kernel, the ragged MoE product, the chunked KDA prefill, bfloat16 products as they are) and
the model's attention is the kernel. Then the call runs on the CPU as usual, so the engine
goes on through prefill, decode, verify windows, draft steps and prefix hits.

Lowering checks that every op has a CUDA lowering and that the Pallas kernel lowers to Triton
at these shapes; compiling it (Triton to PTX) needs the GPU (`benchmarks/gpu_check.sh`).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import pytest
from flax import nnx

import serving.runner as runner_mod
import serving.speculative.draft_model as draft_mod
import serving.speculative.steps as steps_mod
import serving.state_pool as state_pool_mod
from kimi_linear_jax.model import HashedGraph, merge, split_flat
from serving.engine import LLM
from serving.sampling import SamplingParams
from tests.helpers import JAX_0_11, abstract_gpu

# The Pallas kernel lowered for a GPU: a call of the Triton custom call.
TRITON = "__gpu$xla.gpu.triton"

# Module-level jitted functions the engine calls (by their importers' names).
STEPS = {
    runner_mod: ("prefill_step", "decode_steps", "pick_jit", "_next_ids"),
    steps_mod: ("decode_until_recurs", "verify_step"),
    draft_mod: ("prefill_step", "decode_steps", "_write_lag", "_catch_up", "_rollback"),
    state_pool_mod: ("copy_slots", "reset_cache_slots"),
}


@contextlib.contextmanager
def gpu_backend():
    """`jax.default_backend()` says "gpu": the trace-time choices of the model's ops follow."""
    real = jax.default_backend
    jax.default_backend = lambda: "gpu"
    try:
        yield
    finally:
        jax.default_backend = real


class CudaLowering:
    """Wraps the engine's steps: each distinct call (by function, static arguments and shapes)
    is lowered for CUDA first, then runs as it would. `lowered[name]` holds the StableHLO text
    of each lowering; `failures` the calls that did not lower."""

    def __init__(self, monkeypatch):
        self.lowered: dict[str, list[str]] = {}
        self.failures: list[tuple[str, str]] = []
        self._seen: set = set()
        self._gpu_graphs: dict = {}
        for module, names in STEPS.items():
            for name in names:
                monkeypatch.setattr(module, name, self._wrap(name, getattr(module, name)))

    def _wrap(self, name, step):
        def call(*args, **kwargs):
            self._lower(name, step, args, kwargs)
            return step(*args, **kwargs)

        return call

    def _lower(self, name, step, args, kwargs):
        shapes = jax.tree.map(lambda x: (x.shape, x.dtype) if hasattr(x, "shape") else x, args)
        key = (name, str(shapes), str(sorted(kwargs.items(), key=str)))
        if key in self._seen:
            return
        self._seen.add(key)
        if args and isinstance(args[0], HashedGraph):
            # The step traced for a GPU: another graph (attention = the kernel), so the trace
            # is not cached for the CPU's calls.
            args = (self._gpu_graph(args[0], args[1]), *args[1:])
        try:
            with abstract_gpu(), gpu_backend():
                traced = step.trace(*args, **kwargs)
                text = traced.lower(lowering_platforms=("cuda",)).as_text()
        except Exception as e:  # noqa: BLE001 - every failure is collected and reported
            self.failures.append((name, f"{type(e).__name__}: {e}"[:2000]))
            return
        self.lowered.setdefault(name, []).append(text)

    def _gpu_graph(self, graphdef, params):
        """The graph of the same model built for a GPU (par.attention = "kernel")."""
        if graphdef not in self._gpu_graphs:
            model = merge(graphdef, params)
            for _, module in nnx.iter_graph(model):
                if hasattr(module, "par"):
                    module.par = dataclasses.replace(module.par, attention="kernel")
            self._gpu_graphs[graphdef] = split_flat(model)[0]
        return self._gpu_graphs[graphdef]


# Long enough to pass a recurrent-state checkpoint, so that a prompt after it hits the prefix
# cache (a hybrid model resumes only from a checkpoint of its KDA state).
PREFIX = "import os\nimport sys\n\n\ndef main(argv):\n" + "".join(
    f"    parser.add_argument('--option-{i}', type=int, default={i})\n" for i in range(12)
)
PROMPTS = [PREFIX + "    parser.add_argument(", PREFIX + "    args = parser.parse_args("]


NGRAM = {"method": "ngram", "num_draft_tokens": 3}
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
    ],
    ids=["plain", "ngram", "draft-bf16", "ngram-tp4-dcp2"],
)
def test_engine_steps_lower_for_cuda(monkeypatch, speculative, dtype, parallel):
    """Greedy and sampled requests, a prefix hit: every step the engine ran lowers for CUDA,
    and the decode and verify steps and the prefill over a cached prefix call the kernel (on
    a mesh too: the kernel inside the model's shard_map, the lse merge over DCP ranks)."""
    lowering = CudaLowering(monkeypatch)
    # One batch bucket: each step compiles (on the CPU) and lowers once, not once per batch
    # size (70 -> 49 s); the shapes a GPU would serve are these steps' too.
    llm = LLM(max_num_seqs=2, batch_buckets=(2,), dtype=dtype, speculative=speculative, **parallel)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seed=1)
    llm.generate(PROMPTS[:1], greedy, use_tqdm=False)
    llm.generate(PROMPTS, [greedy, sampled], use_tqdm=False)  # the first: a prefix hit
    assert llm.metrics()["prefix_cache_hit_tokens"] > 0

    assert not lowering.failures, lowering.failures
    targets = ["verify_step"] if speculative else ["decode_steps"]
    if speculative == NGRAM:
        # Draftless runs, and the decode program of steps where no row drafts (sampled rows
        # step one call at a time): the plain engine's steps, so that case can be heavy.
        targets += ["decode_until_recurs", "decode_steps"]
    for target in targets:
        assert lowering.lowered.get(target) and all(TRITON in t for t in lowering.lowered[target])
    with_kernel = [t for t in lowering.lowered["prefill_step"] if TRITON in t]
    assert with_kernel, "no prefill over a cached prefix was lowered"
