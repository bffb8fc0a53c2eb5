"""`LLM.generate` and `LLM.chat`: batches of prompts (or conversations) queued with the
engine's `add_request` and run with its `step` to the end, over that public step API alone.
An invalid prompt fails alone: its output has finish_reason "error" and the message; the
others run."""

from __future__ import annotations

import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from kimi_linear_jax.tokenizer import validate_messages
from serving.core.sampling import SamplingParams, is_int
from serving.output import RequestOutput, error_output


def generate(
    llm,
    prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    use_tqdm: bool = True,
) -> list[RequestOutput]:
    """Outputs in the order of `prompts`. An invalid prompt or parameter fails alone: its
    output has finish_reason "error" and `error` naming the prompt's index and the
    problem; the other prompts run."""
    # One prompt: a string, or token ids (all ints). A list that mixes in anything else is a
    # list of prompts, each checked alone ([0, []] is two bad prompts, not one).
    if isinstance(prompts, str) or (
        isinstance(prompts, Sequence) and prompts and all(is_int(p) for p in prompts)
    ):
        prompts = [prompts]
    prompts = list(prompts)
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        params_list = [sampling_params] * len(prompts)
    else:
        params_list = list(sampling_params)
    return _generate(llm, prompts, params_list, use_tqdm)


def chat(
    llm,
    messages: list[dict] | list[list[dict]],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    use_tqdm: bool = True,
    add_generation_prompt: bool = True,
) -> list[RequestOutput]:
    """`generate` on conversations rendered by the tokenizer's chat template. `messages` is
    one conversation (a list of {role, content} dicts) or a list of them."""
    if llm.tokenizer is None:
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
                llm.tokenizer.encode_chat(c, add_generation_prompt=add_generation_prompt)
            )
        except ValueError as e:
            prompts.append(e)  # this conversation fails alone
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        sampling_params = [sampling_params] * len(prompts)
    return _generate(llm, prompts, list(sampling_params), use_tqdm)


def _generate(llm, prompts: list, params_list: list, use_tqdm: bool) -> list[RequestOutput]:
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
            index[llm.add_request(prompt, params)] = i
        except ValueError as e:
            results[i] = error_output(prompt, f"prompt {i}: {e}")
    _run(llm, index, results, use_tqdm)
    return results


def _run(llm, index: dict[str, int], results: list, use_tqdm: bool) -> None:
    bar = tqdm(total=len(index), desc="Processed prompts", disable=not use_tqdm)
    t0, tokens = time.perf_counter(), 0
    try:
        while index and llm.has_unfinished_requests():
            for out in llm.step():
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
