"""What a step hands back to the host: each row's samples (`Sample`), per step (`StepResult`),
and a dispatched decode step not fetched yet (`InFlight`); the batch's sampling mode and the
conversion of fetched picks into samples."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

import numpy as np

from serving.core.prompt_logprobs import Entries
from serving.core.request import Request
from serving.core.sampling import GREEDY_EPS
from serving.core.scheduler_output import SchedulerOutput


class Sample(NamedTuple):
    """One sampled token of a request; logprob and top are None when it did not ask."""

    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


class InFlight(NamedTuple):
    """A dispatched decode step whose picks ([B, S, ...] device arrays) are not fetched yet."""

    output: SchedulerOutput
    picked: tuple
    mode: str


class StepResult(NamedTuple):
    """What a step measured, for the scheduler to apply: each sampling row's samples in
    order, the drafts each verify row proposed (it accepted len(samples) - 1), the prompt
    logprobs of the prefill rows that ask (`prompt_logprobs.entries`), and whether each of a
    row's shadow drafts was the token that followed it, in order (`Drafter.shadow`)."""

    samples: dict[Hashable, list[Sample]]
    num_drafts: dict[Hashable, int]
    prompt_logprobs: dict[Hashable, Entries]
    shadows: dict[Hashable, list[bool]]


def sample_mode(requests: Sequence[Request]) -> str:
    if any(r.params.has_penalty for r in requests):
        return "penalized"
    if any(
        r.params.temperature >= GREEDY_EPS or r.params.logprobs is not None or r.params.has_bias
        for r in requests
    ):
        return "sample"
    return "greedy"


def host_samples(picked, requests: Sequence[Request | None], mode: str) -> list[list[Sample]]:
    """Host-side [B, S] arrays -> per live row, its S samples (logprobs only where asked)."""
    tokens, chosen, top_ids, top_values = (np.asarray(x) for x in picked)
    out = []
    for i, r in enumerate(requests):
        if r is None:
            continue
        n = r.params.logprobs
        row = []
        for s in range(tokens.shape[1]):
            if n is None or mode == "greedy":
                row.append(Sample(int(tokens[i, s])))
            else:
                top = [(int(t), float(v)) for t, v in zip(top_ids[i, s, :n], top_values[i, s, :n])]
                row.append(Sample(int(tokens[i, s]), float(chosen[i, s]), top))
        out.append(row)
    return out
