"""`LLM.metrics()` (`engine_metrics`): the engine's counters since start-up plus its current
load (and speculation, async scheduling and prefix caching, when on). The server exports them
(`serving/metrics.py`)."""

from __future__ import annotations

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


def engine_metrics(counters: dict, core, speculative) -> dict[str, int | float]:
    """Counters since start-up plus the current load (and speculation and async scheduling,
    when on: `overlapped_steps` counts steps dispatched before the previous step's tokens
    reached the host). `core`: the `EngineCore`; `speculative`: its `SpeculativeConfig`."""
    runner, scheduler, cache = core.runner, core.scheduler, core.scheduler.cache
    allocator, state_pool, prefix_cache = cache.allocator, cache.state_pool, cache.prefix_cache
    out = dict(counters)
    if speculative is not None:
        spec = runner.spec_counts
        rows = max(spec["verify_rows"], 1)
        out.update(
            spec_draft_tokens=spec["draft_tokens"],
            spec_accepted_tokens=spec["accepted_tokens"],
            spec_verify_steps=spec["verify_rows"],
            # Tokens a request gains per verify (accepted drafts + the bonus token).
            spec_mean_accepted_length=(spec["accepted_tokens"] + spec["verify_rows"]) / rows,
        )
        if speculative.prompt_lookup_num_tokens:  # of spec_draft_tokens
            out["spec_lookup_draft_tokens"] = runner.drafter.lookup_draft_tokens
        if speculative.corpus is not None:  # of spec_draft_tokens
            out["spec_corpus_draft_tokens"] = runner.drafter.table_draft_tokens
    if core.async_steps is not None:
        out["overlapped_steps"] = core.async_steps.overlapped
    if prefix_cache is not None:
        stats = prefix_cache.stats
        out.update({f"prefix_cache_{k}": v for k, v in stats.items()})
        out["prefix_cache_hit_rate"] = stats["hit_tokens"] / max(stats["query_tokens"], 1)
        out["prefix_cache_pages"] = allocator.num_tree_pages
        out["prefix_cache_free_checkpoints"] = prefix_cache.num_free_slots
    out.update(
        running=scheduler.num_running,
        waiting=scheduler.num_waiting,
        pages_total=allocator.capacity,
        # Held by requests; cached prefix pages no request holds are counted apart (an
        # idle engine with a full prefix cache uses none).
        pages_used=allocator.num_used - allocator.num_evictable,
        pages_cached=allocator.num_evictable,
        slots_total=state_pool.num_slots - 1,
        slots_used=state_pool.num_slots - 1 - state_pool.num_free,
    )
    return out
