"""Async scheduling (`async_scheduling=True`): a plain decode step stays in flight between
calls of `EngineCore.step`, and the next call dispatches the following step before it applies
the in-flight step's tokens, so the host's work on one step overlaps the device's work on the
next. Outputs do not change (docs/architecture.md, "Async scheduling")."""

from __future__ import annotations

from serving.core.step_result import InFlight


class AsyncSteps:
    """The core's step under async scheduling: it holds the step in flight and drives the
    core's schedule / run / apply / fail and the runner's dispatch and collect."""

    def __init__(self, core) -> None:  # the `EngineCore` (engine_core.py imports this module)
        self.core = core
        self.scheduler, self.runner = core.scheduler, core.runner
        self._flight: InFlight | None = None  # the dispatched step not yet collected
        self.overlapped = 0  # steps dispatched before their predecessor's tokens came

    @property
    def in_flight(self) -> bool:
        return self._flight is not None

    def step(self, touched: list[str]) -> list[str]:
        """One call of async scheduling. With a plain decode step in flight, the next one is
        scheduled and dispatched before the in-flight step's tokens are fetched: its rows read
        them on the device, and the host applies them (stops, logprobs, outputs) while the
        device runs the next step. Other steps (prefill chunks, verifies, snapshots, a step
        after which a request waits for admission) first collect what is in flight and start
        as in synchronous scheduling (`_start`)."""
        flight, self._flight = self._flight, None
        if flight is not None and self.scheduler.can_schedule_ahead():
            return self._step_ahead(flight, touched)
        done = self._collect(flight, touched) if flight is not None else []
        if not self.scheduler.has_unfinished():
            return done
        return done + self._start(self.core.schedule(), touched + done)

    def _start(self, output, touched: list[str]) -> list[str]:
        """Run a step scheduled with every token known. A plain decode step stays in flight
        (the next call dispatches the following step before fetching its tokens) if it
        compiles to the same program without any of its rows; any other step runs now."""
        if not (output.is_plain_decode and self.runner.same_program_for_any_rows(output)):
            return self.core.run(output, touched)  # fails the step itself on a fault
        try:
            self._flight = self._launch(output, None)
        except Exception as e:  # noqa: BLE001 - any fault: fail the step, keep the engine
            return self.core.fail(output, e)
        return []

    def _step_ahead(self, flight: InFlight, touched: list[str]) -> list[str]:
        """Dispatch the next plain decode step, then collect `flight`'s tokens. Unless the
        step could compile differently without some of its rows: synchronous scheduling runs
        it without the rows that `flight`'s tokens finish or that are aborted before its
        tokens are fetched, and the other rows' results may change in the last bits with
        the batch bucket. Then collect first and start what remains."""
        output = self.core.schedule()
        if not self.runner.same_program_for_any_rows(output):
            done = self._collect(flight, touched)
            return done + self._start_survivors(output, touched + done)
        try:
            ahead = self._launch(output, flight)
        except Exception as e:  # noqa: BLE001 - as if synchronous: flight's tokens, then this
            done = self._collect(flight, touched)
            return done + self.core.fail(output, e)
        self.overlapped += 1
        done = self._collect(flight, touched, ahead)
        # With nothing left unfinished, every row of `ahead` ended: its tokens would be dropped.
        if self._flight is not None and not self.scheduler.has_unfinished():
            self._flight = None
        return done

    def _start_survivors(self, output, touched: list[str]) -> list[str]:
        """Start the rows of `output` (scheduled ahead) whose requests still run."""
        self.scheduler.drop_finished(output)
        if output.is_empty:
            self.core.counters["steps"] -= 1  # every row ended: synchronously it is no step
            return []
        return self._start(output, touched)

    def _launch(self, output, prev: InFlight | None) -> InFlight:
        flight = self.runner.dispatch_decode(output, prev)
        self.scheduler.advance(output)
        return flight

    def _collect(self, flight: InFlight, touched: list[str], ahead: InFlight | None = None):
        """Fetch and apply `flight`'s tokens; `ahead` (dispatched after it) stays in flight.
        If the fetch fails (a device fault surfaces there), `ahead` fails too: it ran on the
        failed step's cache and tokens."""
        try:
            done = self.core.apply(flight.output, self.runner.collect(flight), touched)
        except Exception as e:  # noqa: BLE001 - any fault: fail the step, keep the engine
            failed = self.core.fail(flight.output, e)
            return failed + (self.core.fail(ahead.output, e) if ahead is not None else [])
        self._flight = ahead
        return done
