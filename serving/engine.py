"""Offline engine with vLLM's names: `LLM(...).generate(prompts, sampling_params)`.

Each `generate` call adds its requests to a `Scheduler` (continuous batching, chunked prefill,
preemption by recompute) and loops `schedule -> ModelRunner.run -> update` until all finish.

Invalid input: `generate` validates every prompt and its parameters before anything runs and
raises ValueError naming the prompt's index and the problem (empty prompt, token id outside the
vocabulary, text without a tokenizer, prompt + max_tokens past `max_model_len` or the page
pool, a sampling parameter out of range). Nothing is queued when it raises.

Not done yet: `SamplingParams.stop` strings and logprobs (fields accepted, ignored).
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Sequence

import jax

from kimi_linear_jax.checkpoint import load_model_and_tokenizer
from kimi_linear_jax.model import KimiLinearForCausalLM
from serving.allocator import PageAllocator
from serving.runner import ModelRunner
from serving.sampling import SamplingParams, resolve_seed
from serving.scheduler import Request, Scheduler
from serving.state_pool import StatePool


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str | None
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list | None = None
    num_cached_tokens: int = 0


def _load_model(model, dtype: str, tokenizer):
    """(model, tokenizer) from None (built-in default), a path, or a model instance."""
    if isinstance(model, KimiLinearForCausalLM):
        return model, tokenizer
    if model is None or isinstance(model, str | os.PathLike):
        built, found = load_model_and_tokenizer(model, dtype)
        return built, tokenizer if tokenizer is not None else found
    raise TypeError(f"model must be None, a path or a KimiLinearForCausalLM, got {type(model)}")


class LLM:
    def __init__(
        self,
        model=None,
        *,
        tokenizer=None,
        dtype: str = "float32",
        max_num_seqs: int = 8,
        page_size: int = 16,
        num_pages: int = 256,
        max_num_batched_tokens: int = 256,
        chunk_size: int = 64,
        dcp_size: int = 1,
        seed: int = 0,
        max_model_len: int | None = None,
        batch_buckets: Sequence[int] = (1, 2, 4, 8, 16, 32),
        token_buckets: Sequence[int] = (16, 64, 256),
    ) -> None:
        if dcp_size < 1 or dcp_size > jax.device_count():
            raise ValueError(
                f"dcp_size must be in [1, device count {jax.device_count()}], got {dcp_size}"
            )
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.model, self.tokenizer = _load_model(model, dtype, tokenizer)
        self.config = self.model.config
        tokens_per_page = page_size * dcp_size
        pool_tokens = (num_pages - 1) * tokens_per_page
        limit = min(self.config.model_max_length, pool_tokens)
        self.max_model_len = limit if max_model_len is None else min(max_model_len, limit)
        self.page_size = page_size
        self.num_pages = num_pages
        self.dcp_size = dcp_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunk_size = chunk_size
        self.allocator = PageAllocator(num_pages, page_size, dcp_size)
        self.state_pool = StatePool(max_num_seqs + 1)
        self.runner = ModelRunner(
            self.model,
            num_pages=num_pages,
            page_size=page_size,
            num_slots=max_num_seqs + 1,
            dcp_size=dcp_size,
            max_pages_per_seq=self.allocator.pages_for(self.max_model_len),
            batch_buckets=batch_buckets,
            token_buckets=token_buckets,
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
        )
        self._rng = random.Random(seed)
        self._next_id = 0
        self._metrics = dict(
            requests=0, prompt_tokens=0, generation_tokens=0, steps=0, preemptions=0
        )

    # ---- public API ------------------------------------------------------------------------

    def metrics(self) -> dict[str, int]:
        return dict(self._metrics)

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. Raises ValueError (naming the prompt's index)
        before running anything if any prompt or its parameters are invalid."""
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(params_list)} sampling_params for {len(prompts)} prompts")
        requests = [
            self._make_request(i, p, sp)
            for i, (p, sp) in enumerate(zip(prompts, params_list, strict=True))
        ]
        for request in requests:
            self.scheduler.add(request)  # validated above, so this cannot fail half-way
        self._metrics["requests"] += len(requests)
        self._metrics["prompt_tokens"] += sum(len(r.prompt_token_ids) for r in requests)
        while self.scheduler.has_unfinished():
            output = self.scheduler.schedule()
            if output.is_empty:
                raise RuntimeError("scheduler made no progress")
            sampled = self.runner.run(output, self.allocator, self.state_pool)
            self.scheduler.update(output, sampled)
            self._metrics["steps"] += 1
            self._metrics["preemptions"] += len(output.preempted)
            self._metrics["generation_tokens"] += len(sampled)
        return [self._output(r) for r in requests]

    # ---- helpers ---------------------------------------------------------------------------

    def _make_request(self, index: int, prompt, params: SamplingParams) -> Request:
        where = f"prompt {index}"
        if not isinstance(params, SamplingParams):
            raise ValueError(f"{where}: sampling_params must be SamplingParams, got {params!r}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{where}: a text prompt needs a tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            try:
                ids = [int(t) for t in prompt]
            except (TypeError, ValueError) as e:
                raise ValueError(f"{where}: prompt must be a str or a list of ints") from e
        if not ids:
            raise ValueError(f"{where}: prompt is empty")
        vocab = self.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{where}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        try:
            params.validate(vocab)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"{where}: prompt length {len(ids)} + max_tokens {params.max_tokens} exceeds "
                f"max_model_len {self.max_model_len}"
            )
        if params.seed is None:
            params = dataclasses.replace(params, seed=self._rng.getrandbits(32))
        params = dataclasses.replace(params, seed=resolve_seed(params))
        rid = str(self._next_id)
        self._next_id += 1
        return Request(rid, ids, params)

    def _output(self, request: Request) -> RequestOutput:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(request.output_token_ids)
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            text=text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.finish_reason,
        )
