"""Prompt logprobs (vLLM's `SamplingParams(prompt_logprobs=N)`): for every prompt token after the
first, its logprob given the tokens before it, and the top N tokens at that position.

A prefill step with a row that asks keeps the logits of every position (`prefill_step` with
`last_only=False`, for the whole step: one compiled variant more per shape, used only then).
`prompt_logprobs_step` takes, on the device, each row's last-position logits (what the step
samples from, as `last_only=True` gives them) and the log_softmax of the next prompt token and
of the top `MAX_LOGPROBS` tokens at every position; only those small arrays reach the host.

Position p predicts token p + 1, so the last position of a chunk predicts the first token of
the next chunk, and the last prompt position predicts the first generated token, which is not a
prompt logprob. The values are the raw model distribution (the log_softmax of the logits,
before penalties, temperature and truncation), vLLM's default.

Reference: `model(ids)` (the no-cache forward) and a log_softmax; tests/serving/
test_prompt_logprobs.py compares the two at every position.

Dimension letters: B batch rows, T chunk tokens, V vocab, N top-logprob count (static).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from serving.core.sampling import MAX_LOGPROBS, token_logprobs
from serving.core.scheduler_output import PrefillChunk

# A request's prompt logprobs from one chunk: (index of the first entry, its entries).
Entries = tuple[int, list[dict[int, float]]]


def positions(chunk: PrefillChunk) -> range:
    """The chunk's positions whose logits give a prompt logprob (position p gives entry p + 1,
    the logprob of prompt token p + 1): none unless the request asks. A prefill after a
    preemption recomputes the outputs too; their positions give none."""
    request = chunk.request
    if request.params.prompt_logprobs is None:
        return range(0)
    return range(chunk.start, min(chunk.end, len(request.prompt_token_ids) - 1))


def targets(chunks: Sequence[PrefillChunk], b: int, t: int) -> np.ndarray | None:
    """Next prompt tokens [b, t] (column j: token start + j + 1) of the rows that ask, 0
    elsewhere; None when no row of the step asks (it then keeps only the last logits)."""
    out = np.zeros((b, t), np.int32)
    asked = False
    for i, chunk in enumerate(chunks):
        span = positions(chunk)
        if span:
            out[i, : len(span)] = chunk.request.prompt_token_ids[span.start + 1 : span.stop + 1]
            asked = True
    return out if asked else None


@jax.jit
def prompt_logprobs_step(logits, next_ids, lengths):
    """(last logits [B, V], (next-token logprob [B, T], top ids [B, T, N], top values
    [B, T, N])) from the logits of every position [B, T, V] f32, N = MAX_LOGPROBS (one
    compiled N for any request's count; the host keeps each request's first N)."""
    last = jnp.take_along_axis(logits, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)
    return last[:, 0], token_logprobs(logits.astype(jnp.float32), next_ids, MAX_LOGPROBS)


def entries(host, chunks: Sequence[PrefillChunk]) -> dict[Hashable, Entries]:
    """Per request that asks: `RequestOutput.prompt_logprobs` entries of this chunk, in the
    format of `logprobs` (token id -> logprob: the prompt token, then the top N)."""
    chosen, top_ids, top_values = (np.asarray(x) for x in host)
    out = {}
    for i, chunk in enumerate(chunks):
        span = positions(chunk)
        if not span:
            continue
        request = chunk.request
        n = request.params.prompt_logprobs
        rows = []
        for j, p in enumerate(span):
            top = zip(top_ids[i, j, :n].tolist(), top_values[i, j, :n].tolist(), strict=True)
            rows.append({request.prompt_token_ids[p + 1]: float(chosen[i, j]), **dict(top)})
        out[request.request_id] = (span.start + 1, rows)
    return out
