"""A generation request: its tokens and the scheduler's bookkeeping of it.

Only the scheduler changes a request once it is added (nano-vllm's `Sequence`): the engine and
the runner read it, the runner reports what it measured and the scheduler's `update` applies it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Hashable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # sampling imports JAX; a request only holds its parameters
    from serving.core.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


def acceptance_ema(previous: float, rate: float) -> float:
    """A draft acceptance EMA after one more window that accepted `rate` of its drafts."""
    return 0.7 * previous + 0.3 * rate


# Decay of `spec_hits` and `spec_trials` per window: about the last five windows count.
ALPHA_DECAY = 0.8


# Trials a per-draft estimate's prior is worth unless the engine's requests are measured alike
# (`AcceptancePool.weight`): a few windows outweigh it.
PRIOR_TRIALS = 2.0


def window_trials(accepted: int, drafts: int) -> float:
    """A window's trials: one per accepted draft, and one for the draft that was rejected."""
    return accepted + (1.0 if accepted < drafts else 0.0)


def alpha_counts(hits: float, trials: float, accepted: int, drafts: int) -> tuple[float, float]:
    """(hits, trials) of a per-draft acceptance estimate after one more window that accepted
    `accepted` of its `drafts` drafts."""
    return ALPHA_DECAY * hits + accepted, ALPHA_DECAY * trials + window_trials(accepted, drafts)


def alpha_estimate(hits: float, trials: float, prior: float, weight: float = PRIOR_TRIALS) -> float:
    """P(a draft is accepted | the one before it was): the truncated-geometric estimate
    hits / trials with a prior worth `weight` trials at `prior`."""
    return (hits + weight * prior) / (trials + weight)


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request; the scheduler owns its mutable fields once added."""

    request_id: Hashable
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # Tokens of all_token_ids whose KV and recurrent state are in the cache.
    num_computed_tokens: int = 0
    # Async scheduling: tokens a dispatched decode step samples that are not appended yet (they
    # stay on the device as the next step's inputs). They count as tokens of the sequence for
    # scheduling; always 0 with synchronous scheduling.
    num_pending: int = 0
    finish_reason: str | None = None  # None | "stop" | "length" | "abort"
    arrival: int = -1  # set by Scheduler.add
    num_preemptions: int = 0
    # Prefix caching: tokens skipped by the last admission's hit, and the depths where this
    # prefill donates a recurrent-state checkpoint (a chunk ends at each).
    num_cached_tokens: int = 0
    donate_depths: tuple[int, ...] = ()
    # Speculative decoding: recent draft acceptance (EMA), verifies without drafts since the
    # last probe, and the verifies until the next probe (0: the scheduler's interval).
    spec_acceptance: float = 1.0
    spec_skipped: int = 0
    spec_probe_after: int = 0
    # The per-draft acceptance estimate of cost-aware widths (`spec_alpha`): accepted drafts
    # and trials (a trial per accepted draft, plus one for the draft that was rejected), each
    # an EMA over the request's windows.
    spec_hits: float = 0.0
    spec_trials: float = 0.0
    # The sum of the trials' squared decay weights: its trials count as trials**2 / this
    # independent ones (the pool's test of whether requests differ).
    spec_square: float = 0.0
    # The estimate's prior: the engine's recent acceptance (`policy.AcceptancePool`), when
    # the request arrived and after each of its windows, so that a new request starts where
    # the workload's are; worth `spec_prior_weight` trials (more when requests measure alike).
    spec_prior: float = 0.5
    spec_prior_weight: float = PRIOR_TRIALS
    # What a drafter keeps per request (its own record of drafts it judges apart: the n-gram
    # drafter's corpus table, the draft model's windows with lookup first).
    drafter_state: object = None

    @property
    def spec_alpha(self) -> float:
        """P(a draft is accepted | the one before it was), from `spec_prior`: a new request
        starts where the engine's requests are (`alpha_estimate`)."""
        return alpha_estimate(
            self.spec_hits, self.spec_trials, self.spec_prior, self.spec_prior_weight
        )

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens + self.num_pending - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
