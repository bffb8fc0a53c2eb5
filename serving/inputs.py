"""`LLM.add_request`'s input check (`InputProcessor`): a prompt (text or token ids) and its
`SamplingParams` made a `Request`, or a ValueError naming the field and the limit (empty prompt,
token id outside the vocabulary, text without a tokenizer, prompt + max_tokens past
`max_model_len`, a sampling parameter out of range)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Container, Sequence

from serving.core.request import Request
from serving.core.sampling import SamplingParams, is_int, resolve_seed


def _iterable(x) -> bool:
    try:
        iter(x)
    except TypeError:
        return False
    return True


class InputProcessor:
    """Prompts and parameters checked and made `Request`s: ids, a seed drawn where none is
    given (from the engine's seeded generator, so a run is reproducible), a request id."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, seed: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._rng = random.Random(seed)
        self._next_id = 0

    def make_request(
        self, prompt, params: SamplingParams, request_id: str | None, in_use: Container
    ) -> Request:
        """The request, or ValueError; `in_use`: the ids of the requests not finished."""
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
        vocab = self.vocab_size
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
        if request_id in in_use:
            raise ValueError(f"request id {request_id!r} is already in use")
        return Request(request_id, ids, params)
