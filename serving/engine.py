"""Offline engine with vLLM's names: `LLM(...).generate(prompts, sampling_params)`, `chat`,
and the step API (`add_request`, `step`, `abort_request`) that a server loop drives.

Each request goes to a `Scheduler` (continuous batching, chunked prefill, preemption by
recompute, fused decode steps); `step` runs `schedule -> ModelRunner.run -> update` once and
applies the host-side rules: stop strings (the text is cut before the stop string, the token
ids end with the token that completed it; the scheduler truncates and finishes the request,
since only the scheduler changes a request) and logprob bookkeeping. With
`async_scheduling=True` a plain decode step stays in flight between calls and the next call
dispatches the following step before applying its tokens (`LLM._step_async`).

Invalid input: `add_request` raises ValueError naming the field and the limit (empty prompt,
token id outside the vocabulary, text without a tokenizer, prompt + max_tokens past
`max_model_len` or the page pool, a sampling parameter out of range) and queues nothing. In
`generate` / `chat` an invalid prompt fails alone: its output has finish_reason "error" and the
message; the others run.

Parts of `LLM` live beside it, one concern a module: `batch.py` (`generate`, `chat`),
`inputs.py` (the check of `add_request`'s input), `output.py` (`RequestOutput`, logprobs, stop
strings), `async_steps.py` (async scheduling), `engine_metrics.py` (`metrics`) and `loading.py`
(the target and draft models).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence

import jax
from jax.experimental import multihost_utils

from kimi_linear_jax.checkpoint import BUILTIN_DRAFT
from kimi_linear_jax.parallel import distributed as distributed_mod
from kimi_linear_jax.parallel.distributed import Distributed
from kimi_linear_jax.parallel.mesh import make_parallel
from kimi_linear_jax.parallel.plan import STATE_MEMORY_RATIO, parse_bytes
from serving.allocator import PageAllocator
from serving.async_steps import AsyncStepsMixin
from serving.batch import BatchMixin
from serving.engine_metrics import COUNTERS, MetricsMixin
from serving.inputs import InputsMixin
from serving.loading import _check_draft_pairing, _config_of, _draft_plan, _load_model
from serving.memory import PoolOptions, plan_pools
from serving.output import OutputsMixin, RequestOutput, _Tracked
from serving.prefix_cache import PrefixCache
from serving.runner import ModelRunner
from serving.sampling import SamplingParams, is_int
from serving.scheduler import Scheduler
from serving.speculative.config import SpeculativeConfig
from serving.speculative.draft_model import DraftModelDrafter
from serving.speculative.ngram import NgramDrafter
from serving.speculative.ngram_table import NgramTable, table_from_corpus
from serving.speculative.track import resolve_track_interval
from serving.state_pool import StatePool
from serving.step_result import InFlight

log = logging.getLogger("kimi_linear_jax.engine")


class LLM(BatchMixin, AsyncStepsMixin, InputsMixin, OutputsMixin, MetricsMixin):
    """Offline engine. `generate` / `chat` run batches to completion; `add_request`, `step`
    and `abort_request` drive it one step at a time (the server's loop does).

    Pools (`serving/memory.py`): `num_pages` given: that many pages and `max_num_seqs`
    (default 8) slots. Else, where the device memory is known (a GPU's `bytes_limit`, or
    `device_memory=` bytes or "80GiB" on a backend that reports none), they are planned:
    `gpu_memory_utilization` of it, minus the weights placed and the largest compiled step,
    split between state slots and pages by `state_memory_ratio` (sglang's ratio);
    `max_num_seqs` then caps the planned count. Else fixed defaults (256 pages, 8 slots).
    `self.memory_plan` holds the plan (None for fixed pools). `dtype="auto"`: the checkpoint's
    torch_dtype, float32 for the built-in model; the KDA state is fp32 whatever the dtype.

    Several processes: `distributed={"coordinator_address": "HOST:PORT", "num_processes": N,
    "process_id": I}` (or the KIMI_COORDINATOR_ADDRESS / KIMI_NUM_PROCESSES / KIMI_PROCESS_ID
    environment variables) joins the group before anything touches a device; every process
    then builds the same engine over one mesh of all their devices and must be given the same
    requests in the same order (`parallel/distributed.py`). A step fault then raises instead
    of failing only its requests: the processes could no longer stay in step.

    `async_scheduling=True` overlaps the host's work on a decode step's tokens with the
    device's next step; outputs do not change (README, "Async scheduling")."""

    def __init__(
        self,
        model=None,
        *,
        tokenizer=None,
        dtype: str = "auto",
        max_num_seqs: int | None = None,
        page_size: int = 16,
        num_pages: int | None = None,
        gpu_memory_utilization: float = 0.9,
        device_memory: int | str | None = None,
        state_memory_ratio: float = STATE_MEMORY_RATIO,
        max_num_batched_tokens: int = 256,
        chunk_size: int = 64,
        tensor_parallel_size: int | None = None,
        dcp_size: int | None = None,
        replicate_q_proj: bool = False,
        dcp_combine: str = "ag_rs",
        seed: int = 0,
        max_model_len: int | None = None,
        num_scheduler_steps: int = 1,
        speculative: dict | None = None,
        drafter=None,
        enable_prefix_caching: bool = True,
        num_checkpoint_slots: int | None = None,
        track_interval: int | None = None,
        batch_buckets: Sequence[int] = (1, 2, 4, 8, 16, 32),
        token_buckets: Sequence[int] = (16, 64, 256),
        distributed: dict | Distributed | None = None,
        async_scheduling: bool = False,
    ) -> None:
        # Join the process group first: nothing may touch a device before (see
        # `parallel/distributed.py`; None reads the KIMI_* environment variables).
        distributed_mod.initialize(Distributed.parse(distributed))
        for name, value, low in (
            ("max_num_seqs", max_num_seqs, 1),
            ("num_scheduler_steps", num_scheduler_steps, 1),
            ("page_size", page_size, 1),
            ("num_pages", num_pages, 2),  # page 0 is reserved
            ("max_num_batched_tokens", max_num_batched_tokens, 1),
            ("chunk_size", chunk_size, 1),
            ("num_checkpoint_slots", num_checkpoint_slots, 0),
            ("max_model_len", max_model_len, 1),
        ):
            if value is not None and (not is_int(value) or value < low):
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not isinstance(gpu_memory_utilization, int | float) or not (
            0 < gpu_memory_utilization <= 1
        ):
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}"
            )
        if not isinstance(state_memory_ratio, int | float) or not 0 < state_memory_ratio < 1e9:
            raise ValueError(f"state_memory_ratio must be a number > 0, got {state_memory_ratio!r}")
        if device_memory is not None:
            parse_bytes(device_memory)  # a bad size fails before the load
        if not isinstance(async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True or False, got {async_scheduling!r}")
        # Option errors before the (possibly slow) model load; the parallel plan is checked
        # against the config alone (heads, experts, vocab vs the TP degree, devices present).
        self.speculative = SpeculativeConfig.parse(speculative)
        par = make_parallel(
            _config_of(model),
            tensor_parallel_size,
            dcp_size,
            replicate_q_proj=replicate_q_proj,
            combine=dcp_combine,
        )
        self.parallel = par
        # The track interval is resolved once, here, on the checkpoint grid, for the
        # scheduler's decode snapshots and the verify.
        self.track_interval = resolve_track_interval(track_interval, page_size, par.dcp)
        if drafter is not None and self.speculative is None:
            raise ValueError("drafter= needs speculative={'num_draft_tokens': k, ...}")
        if self.speculative and self.speculative.method == "draft_model":
            _check_draft_pairing(self.speculative.model, model)
        self.model, self.tokenizer = _load_model(model, dtype, tokenizer, par)
        self.config = self.model.config
        draft_model = self._load_draft(dtype) if drafter is None else None
        # Several processes on a CPU: every collective group opens now, all together.
        draft_mesh = draft_model.par.mesh if draft_model is not None else None
        distributed_mod.open_groups(par.mesh, draft_mesh)
        k = self.speculative.window_drafts if self.speculative else 0
        # Prefix caching: checkpoint slots follow the request slots in the same KDA arrays, so
        # a restore or snapshot is one on-device copy (the layout says where each slot is).
        # The pools: num_pages if given, else planned from the device's memory, else fixed.
        pools = PoolOptions(
            page_size=page_size,
            num_pages=num_pages,
            max_num_seqs=max_num_seqs,
            num_checkpoint_slots=num_checkpoint_slots,
            enable_prefix_caching=enable_prefix_caching,
            num_draft_tokens=k,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            chunk_size=chunk_size,
            batch_buckets=batch_buckets,
            token_buckets=token_buckets,
            gpu_memory_utilization=gpu_memory_utilization,
            device_memory=device_memory,
            state_memory_ratio=state_memory_ratio,
        )
        self.layout, self.memory_plan = plan_pools(self.model, draft_model, pools)
        if distributed_mod.multi_process():
            # Each process plans from its own devices; the lockstep needs one plan.
            plan = (self.layout.num_pages, self.layout.num_slots, self.layout.max_num_seqs)
            multihost_utils.assert_equal(plan, "processes planned different pools")
        log.info(self._pool_line())
        max_num_seqs = self.layout.max_num_seqs
        n_ckpt = self.layout.num_checkpoint_slots
        limit = min(self.config.model_max_length, self.layout.pool_tokens)
        self.max_model_len = limit if max_model_len is None else min(max_model_len, limit)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunk_size = chunk_size
        self.num_scheduler_steps = num_scheduler_steps
        self.allocator = PageAllocator.from_layout(self.layout)
        self.state_pool = StatePool(self.layout.request_slots.stop)
        self.prefix_cache = None
        if n_ckpt > 0:
            self.prefix_cache = PrefixCache(self.allocator, self.layout.checkpoint_slots)
        drafter = drafter or self._make_drafter(draft_model)
        self.runner = ModelRunner(
            self.model,
            layout=self.layout,
            max_pages_per_seq=self.allocator.pages_for(self.max_model_len),
            batch_buckets=batch_buckets,
            token_buckets=token_buckets,
            num_decode_steps=num_scheduler_steps,
            drafter=drafter,
            num_draft_tokens=k,
        )
        if self.tokenizer is not None and getattr(self.tokenizer, "eos_token_ids", None):
            eos = tuple(self.tokenizer.eos_token_ids)
        else:
            eos = self.config.eos_token_ids
        self.scheduler = Scheduler(
            self.allocator,
            self.state_pool,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            chunk_size=chunk_size,
            max_model_len=self.max_model_len,
            eos_token_ids=eos,
            # Speculative rows reserve their whole window: the last token plus k drafts.
            num_decode_steps=k + 1 if self.speculative else num_scheduler_steps,
            speculative=self.speculative is not None,
            spec_min_acceptance=self.speculative.min_acceptance if self.speculative else 0.0,
            prefix_cache=self.prefix_cache,
            track_interval=self.track_interval,
        )
        self._rng = random.Random(seed)
        self._next_id = 0
        self._tracked: dict[str, _Tracked] = {}
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._counters["step_seconds"] = 0.0
        self.last_error: str | None = None  # the last step fault (the server's /health shows it)
        self.async_scheduling = async_scheduling
        self._flight: InFlight | None = None  # async: the dispatched step not yet collected
        self._overlapped = 0  # async: steps dispatched before their predecessor's tokens came

    # ---- public API: one step at a time ----------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Validate and queue one request; return its id. Raises ValueError naming the field and
        the limit for bad input; nothing is queued then."""
        try:
            request = self._make_request(prompt, params or SamplingParams(), request_id)
            self.scheduler.add(request)
        except ValueError:
            self._counters["rejected"] += 1
            raise
        rid = request.request_id
        wants = request.params.logprobs is not None
        tracked = _Tracked(request, [] if wants else None, 0.0 if wants else None)
        if request.params.prompt_logprobs is not None:
            tracked.prompt_logprobs = [None] * len(request.prompt_token_ids)
        self._tracked[rid] = tracked
        self._counters["requests"] += 1
        self._counters["prompt_tokens"] += len(request.prompt_token_ids)
        return rid

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its pages and slot; False if it is unknown or finished."""
        if self.scheduler.abort(request_id) is None:
            return False
        self._counters["aborted"] += 1
        return True

    def reset_prefix_cache(self) -> bool:
        """Evict every prefix-cache entry no running request uses; True if the tree is empty."""
        if self.prefix_cache is None:
            return True
        self.prefix_cache.clear()
        return self.allocator.num_tree_pages == 0

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step. Returns the output (cumulative so far) of every request that
        got tokens or finished in it, including requests aborted since the last step."""
        touched = [rid for rid, t in self._tracked.items() if t.request.is_finished]
        if self._flight is not None or self.scheduler.has_unfinished():
            t0 = time.perf_counter()
            if self.async_scheduling:
                touched += self._step_async(touched)
            else:
                touched += self._step_sync(touched)
            self._counters["step_seconds"] += time.perf_counter() - t0
        # A request may progress in one step and fail in the next within one call (async).
        touched = list(dict.fromkeys(touched))
        outputs = [self._output(self._tracked[rid]) for rid in touched]
        for out in outputs:
            if out.finished:
                del self._tracked[out.request_id]
                self._counters["finished"] += 1
        return outputs

    # ---- helpers ---------------------------------------------------------------------------

    def _schedule(self):
        output = self.scheduler.schedule()
        if output.is_empty:
            raise RuntimeError("scheduler made no progress")
        self._counters["steps"] += 1
        return output

    def _step_sync(self, touched: list[str]) -> list[str]:
        output = self._schedule()
        try:
            return self._run_step(output, touched)
        except Exception as e:  # noqa: BLE001 - any fault: fail the step, keep the engine
            return self._fail_step(output, e)

    def _run_step(self, output, touched: list[str]) -> list[str]:
        """Run the scheduled step and apply its tokens; the ids of the requests it advanced."""
        return self._apply(output, self.runner.run(output), touched)

    def _apply(self, output, result, touched: list[str]) -> list[str]:
        """Apply a step's tokens (scheduler, logprobs, stop strings); the ids it advanced."""
        # Async scheduling: a row of a request that ended while its step was in flight (an
        # abort, a stop in the step before) drops its tokens; its output may be gone already.
        live = {r.request_id for r in output.rows if not r.is_finished}
        sampled = {rid: s for rid, s in result.samples.items() if rid in live}
        before = {rid: len(self._tracked[rid].request.output_token_ids) for rid in sampled}
        tokens = {rid: [s.token for s in v] for rid, v in sampled.items()}
        self.scheduler.update(output, tokens, result.num_drafts)
        self._record_prompt(result.prompt_logprobs)
        for rid, samples in sampled.items():
            self._record(rid, samples, before[rid])
        self._counters["preemptions"] += len(output.preempted)
        self._counters["prefill_tokens"] += sum(c.length for c in output.prefill)
        return [rid for rid in sampled if rid not in touched]

    def _fail_step(self, output, error: Exception) -> list[str]:
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
        self._counters["step_errors"] += 1
        self.last_error = message
        if self.runner.caches_lost():
            for request in list(self.scheduler.running):
                self.scheduler.abort(request.request_id, "error")
                failed.append(request)
            if self.prefix_cache is not None:
                self.prefix_cache.clear()  # its pages and checkpoints lived in those caches
            self.runner.reset_caches()
        for request in failed:
            tracked = self._tracked.get(request.request_id)
            if tracked is not None:
                tracked.error = message
        return [r.request_id for r in failed if r.request_id in self._tracked]

    def _load_draft(self, dtype: str):
        """The draft model of speculative={'method': 'draft_model'} (None otherwise), loaded
        before the pools are sized: its weights and caches take their share."""
        spec = self.speculative
        if spec is None or spec.method == "ngram":
            return None
        source = BUILTIN_DRAFT if spec.model is None else spec.model
        draft_par = _draft_plan(_config_of(source), self.parallel)
        draft, _ = _load_model(source, dtype, None, draft_par)
        if draft.config.vocab_size != self.config.vocab_size:
            raise ValueError(
                f"speculative draft model vocab_size {draft.config.vocab_size} != target "
                f"vocab_size {self.config.vocab_size}"
            )
        return draft

    def _make_drafter(self, draft_model):
        spec = self.speculative
        if spec is None:
            return None
        if spec.method == "ngram":
            table = spec.corpus
            if table is not None and not isinstance(table, NgramTable):
                table = table_from_corpus(table, self.tokenizer)
            return NgramDrafter(
                spec.prompt_lookup_max,
                spec.prompt_lookup_min,
                table,
                min(spec.corpus_num_tokens, spec.num_draft_tokens),
                spec.min_acceptance,
            )
        lookup = None
        if spec.prompt_lookup_num_tokens:
            lookup = NgramDrafter(spec.prompt_lookup_max, spec.prompt_lookup_min)
        return DraftModelDrafter(
            draft_model,
            self.layout,
            num_draft_tokens=spec.num_draft_tokens,
            lookup=lookup,
            lookup_tokens=spec.prompt_lookup_num_tokens,
        )

    def _pool_line(self) -> str:
        """The start-up log line: the plan, or the fixed pools and why."""
        if self.memory_plan is not None:
            return self.memory_plan.summary()
        lay = self.layout
        return (
            f"pools fixed: {lay.num_pages} pages = {lay.pool_tokens} tokens, {lay.num_slots} "
            f"state slots, max_num_seqs {lay.max_num_seqs} (num_pages given, or no device "
            "memory known: pass --device-memory, or device_memory= in Python, to plan)"
        )
