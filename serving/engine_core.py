"""The engine core: one step is schedule -> run -> update.

    output = scheduler.schedule()      # which rows, their slots, pages and copies
    result = runner.run(output)        # the jitted steps; samples come back
    scheduler.update(output, result)   # tokens appended, requests finished, pages released

plus the host-side rules on the new tokens (`OutputProcessor`: logprobs, stop strings) and what
a failed step leaves (its requests end with an error; the engine goes on). Async scheduling
(`AsyncSteps`) keeps a plain decode step in flight between calls and dispatches the next one
before applying its tokens. `LLM` and the server's loop are fronts over this object.
"""

from __future__ import annotations

import dataclasses
import time

import jax

from kimi_linear_jax.parallel import distributed as distributed_mod
from serving.async_steps import AsyncSteps
from serving.core.scheduler import Scheduler
from serving.core.scheduler_output import SchedulerOutput
from serving.core.step_result import StepResult
from serving.output import OutputProcessor
from serving.runner import ModelRunner


class EngineCore:
    """Scheduler, model runner and output processor, stepped together."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        outputs: OutputProcessor,
        counters: dict,
        *,
        async_scheduling: bool = False,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.outputs = outputs
        self.counters = counters
        self.last_error: str | None = None  # the last step fault (the server's /health shows it)
        self.async_steps = AsyncSteps(self) if async_scheduling else None

    def has_work(self) -> bool:
        in_flight = self.async_steps is not None and self.async_steps.in_flight
        return in_flight or self.scheduler.has_unfinished()

    def step(self) -> list[str]:
        """One step; the ids of the requests that got tokens or finished in it (including
        those aborted since the last step)."""
        touched = self.outputs.finished_ids()
        if self.has_work():
            t0 = time.perf_counter()
            if self.async_steps is not None:
                touched += self.async_steps.step(touched)
            else:
                output = self.schedule()
                touched += self.run(output, touched)
            self.counters["step_seconds"] += time.perf_counter() - t0
        # A request may progress in one step and fail in the next within one call (async).
        return list(dict.fromkeys(touched))

    def schedule(self) -> SchedulerOutput:
        output = self.scheduler.schedule()
        if output.is_empty:
            raise RuntimeError("scheduler made no progress")
        self.counters["steps"] += 1
        return output

    def run(self, output: SchedulerOutput, touched: list[str]) -> list[str]:
        """Run the scheduled step and apply its tokens (a fault fails the step alone)."""
        try:
            result = self.runner.run(output)
            self._rest_below_break_even(output)
            return self.apply(output, result, touched)
        except Exception as e:  # noqa: BLE001 - any fault: fail the step, keep the engine
            return self.fail(output, e)

    def _rest_below_break_even(self, output: SchedulerOutput) -> None:
        """Cost-aware widths: requests rest below the acceptance at which a window stops
        paying, which the refreshed cost curve moves (at the step's batch size)."""
        widths = self.runner.widths
        if widths is None or not output.decode:
            return
        rows = self.runner.buckets.rows(len(output.decode))
        policy = self.scheduler.draft_policy
        threshold = widths.break_even(rows)
        if threshold != policy.min_acceptance:  # a copy is 10 us: most steps keep the prices
            self.scheduler.draft_policy = dataclasses.replace(policy, min_acceptance=threshold)

    def apply(self, output: SchedulerOutput, result: StepResult, touched: list[str]) -> list[str]:
        """Apply a step's tokens (scheduler, logprobs, stop strings); the ids it advanced."""
        # Async scheduling: a row of a request that ended while its step was in flight (an
        # abort, a stop in the step before) drops its tokens; its output may be gone already.
        live = {r.request_id for r in output.rows if not r.is_finished}
        sampled = {rid: s for rid, s in result.samples.items() if rid in live}
        tracked = self.outputs.tracked
        before = {rid: len(tracked[rid].request.output_token_ids) for rid in sampled}
        tokens = {rid: [s.token for s in v] for rid, v in sampled.items()}
        self.scheduler.update(output, tokens, result.num_drafts, result.shadows)
        self.outputs.record_prompt(result.prompt_logprobs)
        for rid, samples in sampled.items():
            self.outputs.record(rid, samples, before[rid])
        self.counters["preemptions"] += len(output.preempted)
        self.counters["prefill_tokens"] += sum(c.length for c in output.prefill)
        return [rid for rid in sampled if rid not in touched]

    def fail(self, output: SchedulerOutput, error: Exception) -> list[str]:
        """A step raised: its requests end with an error output and free what they held; the
        others keep running. If the fault consumed the device caches (a donated buffer of a
        call that failed), they are rebuilt and every running request fails too: their
        state is gone."""
        if distributed_mod.multi_process():
            # The processes may no longer be in step (one may have failed alone): stop rather
            # than run different steps into a collective that hangs.
            where = f"process {jax.process_index()}"
            raise RuntimeError(f"engine step failed on {where}: {error}") from error
        message = f"engine step failed: {type(error).__name__}: {error}"
        failed = self.scheduler.fail_step(output)
        self.counters["step_errors"] += 1
        self.last_error = message
        if self.runner.caches_lost():
            for request in list(self.scheduler.running):
                self.scheduler.abort(request.request_id, "error")
                failed.append(request)
            if self.scheduler.cache.prefix_cache is not None:
                self.scheduler.cache.prefix_cache.clear()  # its pages lived in those caches
            self.runner.reset_caches()
        for request in failed:
            self.outputs.fail(request.request_id, message)
        return [r.request_id for r in failed if r.request_id in self.outputs.tracked]
