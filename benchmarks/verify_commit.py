"""The speculative verify's recurrent commit: replay (keep each step's inputs, re-run the
accepted steps) against gather (keep each step's state, pick one), issue 13.

Two parts:

1. **Memory at the release's shapes** (`kimi-linear-48b-a3b`, bf16 weights, fp32 state; k = 4,
   so T = 5; B = 1 / 8 / 32): the bytes a verify keeps for its commit, from the abstract model
   (`jax.eval_shape`: nothing is allocated), next to a plain decode step's (T = 1 states).
2. **Time and XLA temp memory on this machine** (the `small` shapes, random f32 weights, 64
   cached tokens): `verify_step` with each commit, best of N with the two taking turns, and
   the compiled step's temp bytes (`memory_analysis()`).

Run: ``python benchmarks/verify_commit.py [--repeats 5] [--batches 1 8 32]`` (prints two tables,
writes ``results/verify_commit.json``).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import print_table, timeit_interleaved, write_json  # noqa: E402
from flax import nnx  # noqa: E402

from kimi_linear_jax.cache import contiguous_batch, init_cache  # noqa: E402
from kimi_linear_jax.model import HashedGraph, KimiLinearForCausalLM, merge  # noqa: E402
from kimi_linear_jax.presets import preset  # noqa: E402
from kimi_linear_jax.testing import random_model  # noqa: E402
from serving.sampling import SamplingBatch, SamplingParams  # noqa: E402
from serving.speculative.verify import COMMITS, verify_step  # noqa: E402

K = 4  # drafts per window: T = K + 1
MIB = 2**20


def kept_bytes(config, batch: int, t: int, keep: str, dtype=jnp.bfloat16) -> int:
    """Bytes of what `model.verify(keep=...)` returns for the commit, abstractly."""
    model = nnx.eval_shape(lambda: KimiLinearForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    cache = jax.eval_shape(
        functools.partial(
            init_cache, config, num_slots=batch + 1, num_pages=batch + 1, page_size=64, dtype=dtype
        )
    )
    b = contiguous_batch(batch, 64, 64, lengths=np.full(batch, t))
    ids = jax.ShapeDtypeStruct((batch, t), jnp.int32)

    def verify(state, ids, cache):
        return merge(graphdef, state).verify(ids, cache, b, keep=keep)[2]

    kept = jax.eval_shape(verify, state, ids, cache)
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(kept))


def release_memory(batches) -> list[dict]:
    config = preset("kimi-linear-48b-a3b")
    rows = []
    for batch in batches:
        decode = kept_bytes(config, batch, 1, "states")
        gather = kept_bytes(config, batch, K + 1, "states")
        replay = kept_bytes(config, batch, K + 1, "inputs")
        rows.append(
            dict(
                batch=batch,
                decode_MiB=decode / MIB,
                gather_MiB=gather / MIB,
                replay_MiB=replay / MIB,
                gather_over_replay=gather / replay,
            )
        )
    return rows


def _verify_args(graphdef, params, config, batch: int):
    cache = init_cache(config, num_slots=batch + 1, num_pages=batch * 2 + 1, page_size=64,
                       dtype=jnp.float32)  # fmt: skip
    b = contiguous_batch(batch, 128, 64, start=np.full(batch, 64), lengths=np.ones(batch))
    sampling = SamplingBatch.from_params(
        [SamplingParams(temperature=0, seed=0)] * batch, [0] * batch, batch
    )
    rng = np.random.default_rng(0)
    drafts = jnp.asarray(rng.integers(0, config.vocab_size, (batch, K)), jnp.int32)
    zeros = jnp.zeros((batch, 1), jnp.int32)
    none = jnp.full(batch, -1, jnp.int32)
    return (graphdef, params, jnp.ones(batch, jnp.int32), drafts, jnp.full(batch, K, jnp.int32),
            cache, b, sampling, zeros, zeros.astype(bool), none, none)  # fmt: skip


class _Verify:
    """A verify_step call with one commit; the cache is donated, so each call hands the new
    one to the next."""

    def __init__(self, args, commit: str) -> None:
        self.args, self.commit = list(args), commit

    def temp_bytes(self) -> int:
        lowered = verify_step.lower(*self.args, mode="greedy", commit=self.commit)
        return lowered.compile().memory_analysis().temp_size_in_bytes

    def __call__(self):
        out, self.args[5] = verify_step(*self.args, mode="greedy", commit=self.commit)
        return out


def local_time(batches, repeats: int) -> list[dict]:
    config = preset("small")
    graphdef, params = nnx.split(random_model(config))
    graphdef = HashedGraph(graphdef)
    rows = []
    for batch in batches:
        args = _verify_args(graphdef, params, config, batch)
        calls = {c: _Verify([args[0], *jax.tree.map(jnp.copy, args[1:])], c) for c in COMMITS}
        temp = {c: call.temp_bytes() for c, call in calls.items()}
        times = timeit_interleaved(calls, repeats=repeats)
        rows.append(
            dict(
                batch=batch,
                gather_ms=times["gather"]["min_s"] * 1e3,
                replay_ms=times["replay"]["min_s"] * 1e3,
                replay_over_gather=times["replay"]["min_s"] / times["gather"]["min_s"],
                gather_temp_MiB=temp["gather"] / MIB,
                replay_temp_MiB=temp["replay"] / MIB,
            )
        )
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    a = p.parse_args(argv)
    memory = release_memory(a.batches)
    print("kept for the commit, kimi-linear-48b-a3b (bf16, fp32 state), k = 4:")
    cols = ["batch", "decode_MiB", "gather_MiB", "replay_MiB", "gather_over_replay"]
    print_table(memory, cols)
    timing = local_time(a.batches, a.repeats)
    print("\nverify_step, small shapes, f32, this machine (best of N, interleaved):")
    cols = ["batch", "gather_ms", "replay_ms", "replay_over_gather"]
    print_table(timing, [*cols, "gather_temp_MiB", "replay_temp_MiB"])
    rows = [{"part": "release_memory", **r} for r in memory]
    rows += [{"part": "local_time", **r} for r in timing]
    path = write_json("verify_commit", rows, {"k": K, "repeats": a.repeats})
    print(f"\nwrote {path}")
    return {"memory": memory, "timing": timing}


if __name__ == "__main__":
    main()
