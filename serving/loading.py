"""The models `LLM` runs: the target's config read before its weights (so option errors come
before a slow load), the target and draft loaded for a parallel plan, and the draft's plan
and pairing rules."""

from __future__ import annotations

import os

from kimi_linear_jax.checkpoint import load_model_and_tokenizer, model_config
from kimi_linear_jax.model import KimiLinearForCausalLM, for_serving
from kimi_linear_jax.parallel.mesh import SINGLE, Parallel, validate
from kimi_linear_jax.parallel.rules import shard_model


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
