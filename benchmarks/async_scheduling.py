"""Async scheduling against synchronous scheduling (issue 13, "host work off the critical
path"): the built-in default model, greedy, unfused decode, batch 1 and 8, both engines
taking turns call by call (best of N).

Per run it records when each decode step is dispatched and when its tokens are fetched
(wrapping the runner's `dispatch_decode` and `collect`), and reports:

- ms per token: wall time of `generate` over the tokens per request;
- host ms per step: the host's time outside the token fetches (scheduling, building and
  dispatching the batch, applying tokens), on or off the critical path;
- host gap: mean time from a step's tokens reaching the host until the next step is
  dispatched (the dispatch call returned): host work on the critical path, 0 when the next
  step was dispatched before the fetch;
- device ms per step: the same compiled decode step run back to back with nothing else
  (the device's share of a step, measured in the same run);
- device idle: 1 - steps * device ms / the decode steps' wall time;
- vs sync: the fastest async call over the fastest sync call, and the median over repeats of
  async over the sync call just before it (the two ran under about the same load).

On a CPU the "device" is the same cores as the host, so the host's work competes with XLA's
threads: expect small gains there.

Run: ``python benchmarks/async_scheduling.py [--repeats 5] [--tokens 64]`` (prints a table,
writes ``results/async_scheduling.json``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import print_table, timeit_interleaved, write_json  # noqa: E402

from serving import LLM, SamplingParams  # noqa: E402
from serving.decode import decode_steps  # noqa: E402
from serving.scheduler import Placement  # noqa: E402

DEVICE_STEPS = 32  # back-to-back steps of the device-only loop
CONTEXT = 40  # the device loop's position: about the middle of a 3 + 64-token run


class Probe:
    """Times the decode dispatches and token fetches of one engine's runner."""

    def __init__(self, runner) -> None:
        self.dispatches: list[tuple[float, float]] = []
        self.collects: list[tuple[float, float]] = []
        for name, log in (("dispatch_decode", self.dispatches), ("collect", self.collects)):
            setattr(runner, name, self._timed(getattr(runner, name), log))

    @staticmethod
    def _timed(fn, log):
        def timed(*args):
            t0 = time.perf_counter()
            out = fn(*args)
            log.append((t0, time.perf_counter()))
            return out

        return timed

    def reset(self) -> None:
        self.dispatches.clear()
        self.collects.clear()

    def stats(self) -> dict:
        """Steps, their wall time, the host time outside fetches and the mean host gap
        (fetch of step n done -> dispatch of step n + 1 done)."""
        d, c = self.dispatches, self.collects
        gaps = [max(0.0, d[n + 1][1] - c[n][1]) for n in range(min(len(c), len(d) - 1))]
        wall = c[-1][1] - d[0][0]
        return dict(
            steps=len(d),
            decode_wall_s=wall,
            host_ms_per_step=(wall - sum(b - a for a, b in c)) / len(d) * 1e3,
            host_gap_ms=statistics.mean(gaps) * 1e3 if gaps else 0.0,
        )


def generate_run(llm: LLM, probe: Probe, batch: int, tokens: int, log: list):
    """One timed `generate` of `batch` 3-token prompts; appends the probe's stats to `log`."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    prompts = [[5 + len(log), 6 + b, 7] for b in range(batch)]

    def run():
        probe.reset()
        before = llm.metrics().get("overlapped_steps", 0)
        llm.generate(prompts, params, use_tqdm=False)
        overlapped = llm.metrics().get("overlapped_steps", 0) - before
        log.append({**probe.stats(), "overlapped_steps": overlapped})

    return run


def device_loop(llm: LLM, batch: int):
    """The engine's compiled greedy decode step, `DEVICE_STEPS` times back to back, each
    feeding the next on the device: the device time of a step with no host work between.
    It writes garbage into slots 1..batch and the first pages (the prefix cache is emptied
    first; a later request zeroes its slot and writes its KV before reading it)."""
    runner = llm.runner
    pages_each = llm.allocator.pages_for(CONTEXT + 1)
    rows = [
        Placement(1 + i, tuple(range(1 + i * pages_each, 1 + (i + 1) * pages_each)), CONTEXT, 1)
        for i in range(batch)
    ]

    def run():
        llm.reset_prefix_cache()
        b, placed = runner._batch(rows)
        sampling = runner._sampling_inputs([None] * batch, b, "greedy")
        ids, steps_left = jnp.zeros(b, jnp.int32), jnp.ones(b, jnp.int32)
        for _ in range(DEVICE_STEPS):
            picked, _, runner.cache = decode_steps(
                runner.graphdef,
                runner.params,
                ids,
                runner.cache,
                placed,
                steps_left,
                *sampling,
                num_steps=1,
                mode="greedy",
            )
            ids = picked[0][:, 0]
        return jax.block_until_ready(ids)

    return run


def best(timing: dict, log: list) -> tuple[float, dict]:
    """The fastest call's seconds and the probe stats of that call."""
    i = min(range(len(timing["all"])), key=timing["all"].__getitem__)
    return timing["all"][i], log[i]


def measure(batch: int, tokens: int, repeats: int) -> list[dict]:
    engines = {on: LLM(batch_buckets=(batch,), async_scheduling=on) for on in (False, True)}
    probes = {on: Probe(llm.runner) for on, llm in engines.items()}
    logs: dict = {False: [], True: []}
    fns = {on: generate_run(engines[on], probes[on], batch, tokens, logs[on]) for on in engines}
    fns["device"] = device_loop(engines[False], batch)
    timings = timeit_interleaved(fns, warmup=1, repeats=repeats)
    for log in logs.values():
        del log[0]  # the warm-up call
    device_ms = timings["device"]["min_s"] / DEVICE_STEPS * 1e3
    base = None
    rows = []
    paired = [a / s for s, a in zip(timings[False]["all"], timings[True]["all"], strict=True)]
    for on in (False, True):
        wall, stats = best(timings[on], logs[on])
        ms_token = wall / tokens * 1e3
        base = base or ms_token
        step_ms = stats["decode_wall_s"] / stats["steps"] * 1e3
        rows.append(
            dict(
                batch=batch,
                scheduling="async" if on else "sync",
                ms_per_token=ms_token,
                vs_sync=ms_token / base,
                vs_sync_paired=statistics.median(paired) if on else 1.0,
                ms_per_step=step_ms,
                device_ms_per_step=device_ms,
                device_idle_pct=max(0.0, 100 * (1 - device_ms / step_ms)),
                host_ms_per_step=stats["host_ms_per_step"],
                host_gap_ms=stats["host_gap_ms"],
                decode_steps=stats["steps"],
                overlapped_steps=stats["overlapped_steps"],
            )
        )
    return rows


COLUMNS = [
    "batch",
    "scheduling",
    "ms_per_token",
    "vs_sync",
    "vs_sync_paired",
    "ms_per_step",
    "device_ms_per_step",
    "device_idle_pct",
    "host_ms_per_step",
    "host_gap_ms",
    "decode_steps",
    "overlapped_steps",
]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    a = p.parse_args(argv)
    rows = [row for batch in a.batches for row in measure(batch, a.tokens, a.repeats)]
    print_table(rows, COLUMNS)
    meta = {"tokens": a.tokens, "repeats": a.repeats, "device_steps": DEVICE_STEPS}
    path = write_json("async_scheduling", rows, meta)
    print(f"\nwrote {path}")
    return rows


if __name__ == "__main__":
    main()
