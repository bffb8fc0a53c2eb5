"""Offline engine with vLLM's names: `LLM(...).generate(prompts, sampling_params)`, `chat`,
and the step API (`add_request`, `step`, `abort_request`) that a server loop drives.

`LLM` is a front: it checks the options, loads the model (and a draft model), plans the pools
and builds the parts, then forwards to them. `EngineCore` (`engine_core.py`) steps
`schedule -> run -> update` over the `Scheduler` (requests and queues), the `CacheManager`
(pages, state slots, prefix tree), the `ModelRunner` (device state, jitted steps, the drafter)
and the `OutputProcessor` (logprobs, stop strings, outputs).

Invalid input: `add_request` raises ValueError naming the field and the limit (empty prompt,
token id outside the vocabulary, text without a tokenizer, prompt + max_tokens past
`max_model_len` or the page pool, a sampling parameter out of range) and queues nothing. In
`generate` / `chat` an invalid prompt fails alone: its output has finish_reason "error" and the
message; the others run.

Beside it: `batch.py` (`generate`, `chat` over the step API), `inputs.py` (`add_request`'s
check), `engine_metrics.py` (`metrics`) and `loading.py` (the target and draft models).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from jax.experimental import multihost_utils

import serving.batch as batch
from kimi_linear_jax.parallel import distributed as distributed_mod
from kimi_linear_jax.parallel.distributed import Distributed
from kimi_linear_jax.parallel.mesh import make_parallel
from kimi_linear_jax.parallel.plan import STATE_MEMORY_RATIO, parse_bytes
from kimi_linear_jax.parallel.pools import PoolOptions, plan_pools, pool_line
from serving.core.cache_manager import CacheManager
from serving.core.policy import DraftPolicy
from serving.core.sampling import SamplingParams, is_int
from serving.core.scheduler import Scheduler
from serving.core.track import resolve_track_interval
from serving.engine_core import EngineCore
from serving.engine_metrics import COUNTERS, engine_metrics
from serving.inputs import InputProcessor
from serving.loading import _check_draft_pairing, _config_of, _draft_plan, _load_model
from serving.output import OutputProcessor, RequestOutput
from serving.runner import ModelRunner
from serving.speculative.config import SpeculativeConfig
from serving.speculative.widths import WidthPolicy

log = logging.getLogger("kimi_linear_jax.engine")


class LLM:
    """Offline engine. `generate` / `chat` run batches to completion; `add_request`, `step`
    and `abort_request` drive it one step at a time (the server's loop does).

    Pools (`parallel/pools.py`): `num_pages` given: that many pages and `max_num_seqs`
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
    device's next step; outputs do not change (docs/architecture.md, "Async scheduling")."""

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
        log.info(pool_line(self.layout, self.memory_plan))
        limit = min(self.config.model_max_length, self.layout.pool_tokens)
        self.max_model_len = limit if max_model_len is None else min(max_model_len, limit)
        self.max_num_seqs = self.layout.max_num_seqs
        self.cache = CacheManager.from_layout(
            self.layout, track_interval=self.track_interval, speculative=bool(self.speculative)
        )
        options = dict(
            batch_buckets=batch_buckets,
            token_buckets=token_buckets,
            num_scheduler_steps=num_scheduler_steps,
            max_num_batched_tokens=max_num_batched_tokens,
            chunk_size=chunk_size,
        )
        self.core = self._build_core(drafter, draft_model, seed, async_scheduling, options)

    def _build_core(self, drafter, draft_model, seed: int, async_scheduling: bool, options):
        """The runner, the scheduler and the input and output processors, as one core."""
        spec = self.speculative
        k = spec.window_drafts if spec else 0
        if drafter is None and spec is not None:
            drafter = spec.make_drafter(draft_model, self.layout, self.tokenizer)
        runner = ModelRunner(
            self.model,
            layout=self.layout,
            max_pages_per_seq=self.cache.pages_for(self.max_model_len),
            batch_buckets=options["batch_buckets"],
            token_buckets=options["token_buckets"],
            num_decode_steps=options["num_scheduler_steps"],
            drafter=drafter,
            num_draft_tokens=k,
            widths=WidthPolicy(k) if spec and spec.width_policy == "cost" else None,
            topk=spec.topk if spec else 1,
        )
        policy = DraftPolicy(spec.min_acceptance) if spec else None
        if runner.widths is not None:
            # The curve at start-up, at every batch bucket a step may take: each width's
            # programs compile here rather than in the middle of serving.
            top = runner.buckets.rows(self.max_num_seqs)
            rows = [b for b in runner.buckets.batch_buckets if b <= top]
            runner.verifier.profile(rows)
            # A drafter that shadows measures resting requests for free: no probes.
            policy = DraftPolicy(
                runner.widths.break_even(1), by="alpha", probes=not drafter.shadows
            )
        if self.tokenizer is not None and getattr(self.tokenizer, "eos_token_ids", None):
            eos = tuple(self.tokenizer.eos_token_ids)
        else:
            eos = self.config.eos_token_ids
        scheduler = Scheduler(
            self.cache,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=options["max_num_batched_tokens"],
            chunk_size=options["chunk_size"],
            max_model_len=self.max_model_len,
            eos_token_ids=eos,
            # Speculative rows reserve their whole window: the last token plus k drafts.
            num_decode_steps=k + 1 if spec else options["num_scheduler_steps"],
            draft_policy=policy,
        )
        counters = dict.fromkeys(COUNTERS, 0)
        counters["step_seconds"] = 0.0
        vocab = self.config.vocab_size
        self.inputs = InputProcessor(self.tokenizer, vocab, self.max_model_len, seed)
        outputs = OutputProcessor(self.tokenizer, scheduler.stop, counters)
        return EngineCore(scheduler, runner, outputs, counters, async_scheduling=async_scheduling)

    # ---- the parts ---------------------------------------------------------------------------

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def runner(self) -> ModelRunner:
        return self.core.runner

    @property
    def last_error(self) -> str | None:
        """The last step fault the engine recovered from (the server's /health shows it)."""
        return self.core.last_error

    @property
    def async_scheduling(self) -> bool:
        return self.core.async_steps is not None

    # ---- public API: one step at a time ----------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Validate and queue one request; return its id. Raises ValueError naming the field and
        the limit for bad input; nothing is queued then."""
        counters, outputs = self.core.counters, self.core.outputs
        try:
            params = params or SamplingParams()
            request = self.inputs.make_request(prompt, params, request_id, outputs.tracked)
            self.scheduler.add(request)
        except ValueError:
            counters["rejected"] += 1
            raise
        outputs.track(request)
        counters["requests"] += 1
        counters["prompt_tokens"] += len(request.prompt_token_ids)
        return request.request_id

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its pages and slot; False if it is unknown or finished."""
        if self.scheduler.abort(request_id) is None:
            return False
        self.core.counters["aborted"] += 1
        return True

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step. Returns the output (cumulative so far) of every request that
        got tokens or finished in it, including requests aborted since the last step."""
        return self.core.outputs.outputs(self.core.step())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> bool:
        """Evict every prefix-cache entry no running request uses; True if the tree is empty."""
        if self.cache.prefix_cache is None:
            return True
        self.cache.prefix_cache.clear()
        return self.cache.allocator.num_tree_pages == 0

    def metrics(self) -> dict[str, int | float]:
        """Counters since start-up plus the current load (`engine_metrics`)."""
        return engine_metrics(self.core.counters, self.core, self.speculative)

    # ---- the batch API (`batch.py`) --------------------------------------------------------

    def generate(self, prompts, sampling_params=None, *, use_tqdm: bool = True):
        """Outputs in the order of `prompts` (`batch.generate`); a bad prompt fails alone."""
        return batch.generate(self, prompts, sampling_params, use_tqdm=use_tqdm)

    def chat(self, messages, sampling_params=None, *, use_tqdm=True, add_generation_prompt=True):
        """`generate` on conversations rendered by the chat template (`batch.chat`)."""
        return batch.chat(
            self,
            messages,
            sampling_params,
            use_tqdm=use_tqdm,
            add_generation_prompt=add_generation_prompt,
        )

    # ---- loading -----------------------------------------------------------------------------

    def _load_draft(self, dtype: str):
        """The draft model of speculative={'method': 'draft_model'} (None otherwise), loaded
        before the pools are sized: its weights and caches take their share."""
        spec = self.speculative
        if spec is None or spec.method == "ngram":
            return None
        source = spec.draft_source
        draft, _ = _load_model(source, dtype, None, _draft_plan(_config_of(source), self.parallel))
        if draft.config.vocab_size != self.config.vocab_size:
            raise ValueError(
                f"speculative draft model vocab_size {draft.config.vocab_size} != target "
                f"vocab_size {self.config.vocab_size}"
            )
        return draft
