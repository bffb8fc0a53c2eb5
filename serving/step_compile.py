"""The engine's jitted steps, as a GPU would trace them, lowered or compiled for a GPU target.

An engine serves on the CPU while `StepCapture` wraps its jitted steps: each distinct call (by
step, shapes and static arguments) is first traced as a GPU would trace it (`default_backend()`
says "gpu", so the model takes its GPU paths, and its attention is the Pallas kernel), then
either lowered for CUDA (`compile=False`: every op has a CUDA lowering) or compiled deviceless
for a GPU target (`kernels.gpu_target`: XLA's GPU pipeline, Triton, ptxas), then runs on the CPU
as usual, so the engine goes on through prefill, decode, verify windows and draft steps.

A mesh of CPU devices maps onto the target topology's devices in the same shape and axis
names: the arrays' shardings and the model's shard_map follow the step onto the GPU devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import serving.core.prompt_logprobs as prompt_logprobs_mod
import serving.core.state_pool as state_pool_mod
import serving.runner as runner_mod
import serving.speculative.draft_model as draft_mod
import serving.speculative.steps as steps_mod
from kimi_linear_jax.model import HashedGraph, merge, split_flat
from kimi_linear_jax.parallel.target_plan import gpu_backend

# Module-level jitted functions the engine calls (by their importers' names).
STEPS = {
    runner_mod: ("prefill_step", "decode_steps", "pick_jit", "_next_ids", "prompt_logprobs_step"),
    steps_mod: ("decode_until_recurs", "verify_step", "verify_tree_step"),
    # The draft's decode steps run inside `draft_steps` (wrapped, they would be traced there).
    draft_mod: ("prefill_step", "draft_steps", "write_lag", "catch_up", "commit_window"),
    state_pool_mod: ("copy_slots", "reset_cache_slots"),
}
assert hasattr(prompt_logprobs_mod, "prompt_logprobs_step")  # imported by the runner

# Long enough to pass a recurrent-state checkpoint, so that a prompt after it hits the prefix
# cache (a hybrid model resumes only from a checkpoint of its KDA state).
PREFIX = "import os\nimport sys\n\n\ndef main(argv):\n" + "".join(
    f"    parser.add_argument('--option-{i}', type=int, default={i})\n" for i in range(12)
)
PROMPTS = [PREFIX + "    parser.add_argument(", PREFIX + "    args = parser.parse_args("]


def exercise(llm, prompt_logprobs: int | None = None) -> None:
    """Requests that reach every step: a greedy one, then a prefix hit beside a sampled one
    (top-p, seeded, with prompt logprobs if asked)."""
    from serving.core.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    sampled = SamplingParams(
        temperature=0.8, top_p=0.9, max_tokens=8, seed=1, prompt_logprobs=prompt_logprobs
    )
    llm.generate(PROMPTS[:1], greedy, use_tqdm=False)
    llm.generate(PROMPTS, [greedy, sampled], use_tqdm=False)  # the first: a prefix hit


@dataclasses.dataclass
class StepCall:
    """One distinct call of a step: its lowered text or compile report, or why it failed."""

    name: str
    shapes: str
    text: str | None = None  # StableHLO (lowering only)
    report: object = None  # kernels.gpu_target.CompileReport (compiling)
    error: str | None = None


class StepCapture:
    """Wraps the engine's steps while active (`with capture:`); `calls` lists each distinct
    call. `devices`: the target's compile-only devices (compile), None: lower for CUDA only;
    `lowering_context`: a context to trace in (jax >= 0.11 lowers a GPU kernel on a CPU-only
    machine only under an abstract GPU mesh)."""

    def __init__(self, devices=None, lowering_context: Callable = contextlib.nullcontext):
        self.devices = devices
        self.lowering_context = lowering_context
        self.calls: list[StepCall] = []
        self._seen: set = set()
        self._graphs: dict = {}
        self._meshes: dict = {}
        self._stack = contextlib.ExitStack()

    @property
    def failures(self) -> list[tuple[str, str]]:
        return [(c.name, c.error) for c in self.calls if c.error]

    def lowered(self, name: str) -> list[str]:
        return [c.text for c in self.calls if c.name == name and c.text]

    def __enter__(self):
        for module, names in STEPS.items():
            for name in names:
                real = getattr(module, name)
                self._stack.callback(setattr, module, name, real)
                setattr(module, name, self._wrap(name, real))
        return self

    def __exit__(self, *exc):
        self._stack.close()

    def _wrap(self, name, step):
        def call(*args, **kwargs):
            self._capture(name, step, args, kwargs)
            return step(*args, **kwargs)

        return call

    def _capture(self, name, step, args, kwargs):
        shapes = str(jax.tree.map(lambda x: (x.shape, x.dtype) if hasattr(x, "shape") else x, args))
        key = (name, shapes, str(sorted(kwargs.items(), key=str)))
        if key in self._seen:
            return
        self._seen.add(key)
        call = StepCall(name, shapes)
        self.calls.append(call)
        if args and isinstance(args[0], HashedGraph):
            args = (self._gpu_graph(args[0], args[1]), *args[1:])
        try:
            if self.devices is None:
                with self.lowering_context(), gpu_backend():
                    lowered = step.trace(*args, **kwargs).lower(lowering_platforms=("cuda",))
                    call.text = lowered.as_text()
            else:
                from kernels.gpu_target import compile_deviceless

                args, kwargs = jax.tree.map(self._abstract, (args, kwargs))
                with gpu_backend():
                    call.report = compile_deviceless(step, *args, device=self.devices[0], **kwargs)
        except Exception as e:  # noqa: BLE001 - every failure is collected and reported
            call.error = f"{type(e).__name__}: {e}"[:2000]

    # ---- the GPU's view of a step ----------------------------------------------------------
    def _gpu_graph(self, graphdef, params):
        """The graph of the same model built for a GPU: attention = the kernel, and its mesh
        (if any) on the target's devices."""
        if graphdef not in self._graphs:
            model = merge(graphdef, params)
            for _, module in nnx.iter_graph(model):
                if hasattr(module, "par"):
                    mesh = module.par.mesh
                    if mesh is not None and self.devices is not None:
                        mesh = self._mesh(mesh)
                    module.par = dataclasses.replace(module.par, attention="kernel", mesh=mesh)
            self._graphs[graphdef] = split_flat(model)[0]
        return self._graphs[graphdef]

    def _mesh(self, mesh: Mesh) -> Mesh:
        """The target's devices in the shape and axis names of a CPU mesh."""
        if mesh not in self._meshes:
            if mesh.size > len(self.devices):
                raise ValueError(
                    f"a {mesh.size}-device mesh on a {len(self.devices)}-device target"
                )
            devices = np.array(self.devices[: mesh.size]).reshape(mesh.devices.shape)
            self._meshes[mesh] = Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types)
        return self._meshes[mesh]

    def _abstract(self, x):
        """An array argument as the target sees it: its shape and dtype, sharded alike."""
        if not isinstance(x, jax.Array):
            return x
        sharding = x.sharding
        if isinstance(sharding, NamedSharding):
            sharding = NamedSharding(self._mesh(sharding.mesh), sharding.spec)
        else:
            one = Mesh(np.array(self.devices[:1]), ("one",))
            sharding = NamedSharding(one, PartitionSpec())
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
