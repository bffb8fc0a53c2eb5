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
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
from collections.abc import Sequence

import jax
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

from kimi_linear_jax.checkpoint import BUILTIN_DRAFT, load_model_and_tokenizer, model_config
from kimi_linear_jax.model import KimiLinearForCausalLM, for_serving
from kimi_linear_jax.parallel import distributed as distributed_mod
from kimi_linear_jax.parallel.distributed import Distributed
from kimi_linear_jax.parallel.mesh import SINGLE, Parallel, make_parallel, validate
from kimi_linear_jax.parallel.plan import STATE_MEMORY_RATIO, parse_bytes
from kimi_linear_jax.parallel.rules import shard_model
from kimi_linear_jax.tokenizer import validate_messages
from serving.allocator import PageAllocator
from serving.memory import PoolOptions, plan_pools
from serving.prefix_cache import PrefixCache
from serving.request import Request
from serving.runner import InFlight, ModelRunner
from serving.sampling import SamplingParams, is_int, resolve_seed
from serving.scheduler import Scheduler
from serving.speculative.config import SpeculativeConfig
from serving.speculative.draft_model import DraftModelDrafter
from serving.speculative.ngram import NgramDrafter
from serving.speculative.track import resolve_track_interval
from serving.state_pool import StatePool

log = logging.getLogger("kimi_linear_jax.engine")

# Counters of `LLM.metrics()` (besides the current-load gauges it adds).
COUNTERS = (
    "requests",
    "finished",
    "aborted",
    "rejected",
    "prompt_tokens",
    "prefill_tokens",
    "generation_tokens",
    "steps",
    "step_errors",
    "preemptions",
)


@dataclasses.dataclass
class RequestOutput:
    """A request's result (vLLM's names). `logprobs`, when asked for, has one dict per generated
    token mapping token id -> logprob: the sampled token and the top `logprobs` tokens.
    `prompt_logprobs`, when asked for, has one entry per prompt token: None for the first (it
    has no context), then a dict of the same form for prompt token i given tokens [:i] (the
    token and the top `prompt_logprobs` tokens; `serving/prompt_logprobs.py`). Both are raw
    model logprobs (before penalties, temperature and truncation). Such a request takes no
    prefix-cache hit (the skipped positions would have no logits); it still fills the cache.
    Entries of positions not computed (a request that ended in its prefill) stay None.
    `finish_reason` is "stop", "length", "abort", "error" (then `error` says why) or None while
    the request runs; `stop_reason` is the stop string or stop token id that ended it."""

    request_id: str
    prompt_token_ids: list[int]
    text: str | None
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0
    stop_reason: str | int | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def _iterable(x) -> bool:
    try:
        iter(x)
    except TypeError:
        return False
    return True


def _config_of(model):
    """The model's config without loading weights (None, a path or a model instance)."""
    if isinstance(model, KimiLinearForCausalLM):
        return model.config
    if model is None or isinstance(model, str | os.PathLike):
        return model_config(model)
    raise TypeError(f"model must be None, a path or a KimiLinearForCausalLM, got {type(model)}")


def _load_model(model, dtype: str, tokenizer, par: Parallel = SINGLE):
    """(model, tokenizer) from None (built-in default), a path, or a model instance, built
    for the plan `par` (a given instance is placed onto its mesh). The model is the
    `for_serving` copy: a given instance is not changed."""
    if isinstance(model, KimiLinearForCausalLM):
        if model.par != par:
            model = shard_model(model, par)
        return for_serving(model), tokenizer
    built, found = load_model_and_tokenizer(model, dtype, parallel=par)
    return for_serving(built), tokenizer if tokenizer is not None else found


def _check_draft_pairing(draft, target) -> None:
    """The built-in draft model (`draft=None`) shares only the built-in model's tokenizer."""
    if draft is None and target is not None:
        raise ValueError(
            "speculative method 'draft_model' without 'model' uses the built-in draft model, "
            "which drafts for the built-in default model only: pass 'model' (a draft "
            "checkpoint with the target's vocabulary)"
        )


def _draft_plan(config, par: Parallel) -> Parallel:
    """The draft model shares the target's mesh when its shapes divide by the TP degree;
    otherwise it runs whole on one device (it is small; its caches follow it)."""
    if not par.sharded:
        return par
    try:
        validate(config, par.tp, par.dcp, combine=par.combine)
    except ValueError:
        return SINGLE
    return par


@dataclasses.dataclass
class _Tracked:
    """Engine-side bookkeeping of one request beside the scheduler's `Request`."""

    request: Request
    logprobs: list[dict[int, float]] | None
    cumulative_logprob: float | None
    text: str | None = None  # set when a stop string cut the text
    stop_reason: str | int | None = None
    error: str | None = None  # why the request failed (finish_reason "error")
    prompt_logprobs: list[dict[int, float] | None] | None = None  # filled by position


class LLM:
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
        k = self.speculative.num_draft_tokens if self.speculative else 0
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

    # ---- public API: batches ---------------------------------------------------------------

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. An invalid prompt or parameter fails alone: its
        output has finish_reason "error" and `error` naming the prompt's index and the
        problem; the other prompts run."""
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
        return self._generate(prompts, params_list, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """`generate` on conversations rendered by the tokenizer's chat template. `messages` is
        one conversation (a list of {role, content} dicts) or a list of them."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; this model has none")
        if not isinstance(messages, list) or not messages:
            validate_messages(messages)  # raises with the reason
        one = isinstance(messages[0], dict)
        conversations = [messages] if one else list(messages)
        prompts: list = []
        for c in conversations:
            try:
                # Content is plain text: only the template's markup yields special ids.
                prompts.append(
                    self.tokenizer.encode_chat(c, add_generation_prompt=add_generation_prompt)
                )
            except ValueError as e:
                prompts.append(e)  # this conversation fails alone
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        return self._generate(prompts, list(sampling_params), use_tqdm)

    def metrics(self) -> dict[str, int | float]:
        """Counters since start-up plus the current load (and speculation and async scheduling,
        when on: `overlapped_steps` counts steps dispatched before the previous step's tokens
        reached the host)."""
        out = dict(self._counters)
        if self.speculative is not None:
            spec = self.runner.spec_counts
            rows = max(spec["verify_rows"], 1)
            out.update(
                spec_draft_tokens=spec["draft_tokens"],
                spec_accepted_tokens=spec["accepted_tokens"],
                spec_verify_steps=spec["verify_rows"],
                # Tokens a request gains per verify (accepted drafts + the bonus token).
                spec_mean_accepted_length=(spec["accepted_tokens"] + spec["verify_rows"]) / rows,
            )
        if self.async_scheduling:
            out["overlapped_steps"] = self._overlapped
        if self.prefix_cache is not None:
            stats = self.prefix_cache.stats
            out.update({f"prefix_cache_{k}": v for k, v in stats.items()})
            out["prefix_cache_hit_rate"] = stats["hit_tokens"] / max(stats["query_tokens"], 1)
            out["prefix_cache_pages"] = self.allocator.num_tree_pages
            out["prefix_cache_free_checkpoints"] = self.prefix_cache.num_free_slots
        out.update(
            running=self.scheduler.num_running,
            waiting=self.scheduler.num_waiting,
            pages_total=self.allocator.capacity,
            pages_used=self.allocator.num_used,
            slots_total=self.state_pool.num_slots - 1,
            slots_used=self.state_pool.num_slots - 1 - self.state_pool.num_free,
        )
        return out

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

    # ---- async scheduling: host work of one step overlaps the device work of the next -------

    def _step_async(self, touched: list[str]) -> list[str]:
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
        return done + self._start(self._schedule(), touched + done)

    def _start(self, output, touched: list[str]) -> list[str]:
        """Run a step scheduled with every token known. A plain decode step stays in flight
        (the next call dispatches the following step before fetching its tokens) if it
        compiles to the same program without any of its rows; any other step runs now."""
        try:
            if output.is_plain_decode and self.runner.same_program_for_any_rows(output):
                self._flight = self._launch(output, None)
                return []
            return self._run_step(output, touched)
        except Exception as e:  # noqa: BLE001 - any fault: fail the step, keep the engine
            return self._fail_step(output, e)

    def _step_ahead(self, flight: InFlight, touched: list[str]) -> list[str]:
        """Dispatch the next plain decode step, then collect `flight`'s tokens. Unless the
        step could compile differently without some of its rows: synchronous scheduling runs
        it without the rows that `flight`'s tokens finish or that are aborted before its
        tokens are fetched, and the other rows' results may change in the last bits with
        the batch bucket. Then collect first and start what remains."""
        output = self._schedule()
        if not self.runner.same_program_for_any_rows(output):
            done = self._collect(flight, touched)
            return done + self._start_survivors(output, touched + done)
        try:
            ahead = self._launch(output, flight)
        except Exception as e:  # noqa: BLE001 - as if synchronous: flight's tokens, then this
            done = self._collect(flight, touched)
            return done + self._fail_step(output, e)
        self._overlapped += 1
        done = self._collect(flight, touched, ahead)
        # With nothing left unfinished, every row of `ahead` ended: its tokens would be dropped.
        if self._flight is not None and not self.scheduler.has_unfinished():
            self._flight = None
        return done

    def _start_survivors(self, output, touched: list[str]) -> list[str]:
        """Start the rows of `output` (scheduled ahead) whose requests still run."""
        self.scheduler.drop_finished(output)
        if output.is_empty:
            self._counters["steps"] -= 1  # every row ended: synchronously it is no step
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
            done = self._apply(flight.output, self.runner.collect(flight), touched)
        except Exception as e:  # noqa: BLE001 - any fault: fail the step, keep the engine
            failed = self._fail_step(flight.output, e)
            return failed + (self._fail_step(ahead.output, e) if ahead is not None else [])
        self._flight = ahead
        return done

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
            return NgramDrafter(spec.prompt_lookup_max, spec.prompt_lookup_min)
        return DraftModelDrafter(draft_model, self.layout)

    def _pool_line(self) -> str:
        """The start-up log line: the plan, or the fixed pools and why."""
        if self.memory_plan is not None:
            return self.memory_plan.summary()
        lay = self.layout
        return (
            f"pools fixed: {lay.num_pages} pages = {lay.pool_tokens} tokens, {lay.num_slots} "
            f"state slots, max_num_seqs {lay.max_num_seqs} (num_pages given, or no device "
            "memory known: pass device_memory= to plan)"
        )

    def _generate(self, prompts: list, params_list: list, use_tqdm: bool) -> list[RequestOutput]:
        """Queue every valid prompt (an Exception entry is a prompt that already failed), run
        them all to the end, and return one output per prompt."""
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling_params for {len(prompts)} prompts")
        results: list[RequestOutput | None] = [None] * len(prompts)
        index: dict[str, int] = {}
        for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
            try:
                if isinstance(prompt, Exception):
                    raise prompt
                index[self.add_request(prompt, params)] = i
            except ValueError as e:
                results[i] = self._error_output(prompt, f"prompt {i}: {e}")
        self._run(index, results, use_tqdm)
        return results

    def _run(self, index: dict[str, int], results: list, use_tqdm: bool) -> None:
        bar = tqdm(total=len(index), desc="Processed prompts", disable=not use_tqdm)
        t0, tokens = time.perf_counter(), 0
        try:
            while index and self.scheduler.has_unfinished():
                for out in self.step():
                    i = index.get(out.request_id)
                    if i is None or not out.finished:
                        continue
                    results[i] = out
                    del index[out.request_id]
                    tokens += len(out.token_ids)
                    bar.update(1)
                    bar.set_postfix(out_tok_s=f"{tokens / (time.perf_counter() - t0):.1f}")
        finally:
            bar.close()

    def _record(self, rid: str, samples: list, before: int) -> None:
        """Keep the logprobs of the tokens the scheduler appended; cut at a stop string."""
        tracked = self._tracked[rid]
        request = tracked.request
        appended = len(request.output_token_ids) - before
        self._counters["generation_tokens"] += appended
        if tracked.logprobs is not None:
            for s in samples[:appended]:
                tracked.logprobs.append({s.token: s.logprob, **dict(s.top)})
                tracked.cumulative_logprob += s.logprob
        token = request.output_token_ids[-1] if appended else None
        if request.finish_reason == "stop" and token in request.params.stop_token_ids:
            tracked.stop_reason = token
        if request.params.stop and self.tokenizer is not None and appended:
            self._check_stop_strings(tracked, before)

    def _record_prompt(self, found: dict) -> None:
        """Place a step's prompt logprobs by position: a prefill again after a preemption
        overwrites what it recomputes."""
        for rid, (first, entries) in found.items():
            tracked = self._tracked.get(rid)
            if tracked is not None and tracked.prompt_logprobs is not None:
                tracked.prompt_logprobs[first : first + len(entries)] = entries

    def _check_stop_strings(self, tracked: _Tracked, before: int) -> None:
        """Host-side stop strings (vLLM: the text excludes the stop string; the token ids end
        with the token that completed it)."""
        request = tracked.request
        ids = request.output_token_ids
        for n in range(before + 1, len(ids) + 1):
            text = self.tokenizer.decode(ids[:n])
            hits = [(text.find(s), s) for s in request.params.stop if s in text]
            if not hits:
                continue
            pos, stop = min(hits)
            self.scheduler.stop(request, n)
            if tracked.logprobs is not None:
                del tracked.logprobs[n:]
                tracked.cumulative_logprob = sum(d[t] for d, t in zip(tracked.logprobs, ids))
            tracked.text, tracked.stop_reason = text[:pos], stop
            return

    def _make_request(self, prompt, params: SamplingParams, request_id: str | None) -> Request:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {params!r:.80}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, Sequence) and all(is_int(t) for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            bad = (
                next((t for t in prompt if not is_int(t)), prompt) if _iterable(prompt) else prompt
            )
            raise ValueError(f"prompt must be a str or a list of token ids (ints), got {bad!r:.60}")
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        params.validate(vocab)
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt length {len(ids)} + max_tokens {params.max_tokens} exceeds "
                f"max_model_len {self.max_model_len}"
            )
        if params.seed is None:
            params = dataclasses.replace(params, seed=self._rng.getrandbits(32))
        params = dataclasses.replace(params, seed=resolve_seed(params))
        if request_id is None:
            request_id = str(self._next_id)
            self._next_id += 1
        if request_id in self._tracked:
            raise ValueError(f"request id {request_id!r} is already in use")
        return Request(request_id, ids, params)

    def _error_output(self, prompt, message: str) -> RequestOutput:
        ids = list(prompt) if isinstance(prompt, list | tuple) else []
        return RequestOutput(
            request_id="",
            prompt_token_ids=ids,
            text=None,
            token_ids=[],
            finish_reason="error",
            error=message,
        )

    def _output(self, tracked: _Tracked) -> RequestOutput:
        request, prompt = tracked.request, tracked.prompt_logprobs
        text = tracked.text
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(request.output_token_ids)
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            text=text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.finish_reason,
            logprobs=None if tracked.logprobs is None else list(tracked.logprobs),
            cumulative_logprob=tracked.cumulative_logprob,
            prompt_logprobs=None if prompt is None else list(prompt),
            stop_reason=tracked.stop_reason,
            num_cached_tokens=request.num_cached_tokens,
            error=tracked.error,
        )
