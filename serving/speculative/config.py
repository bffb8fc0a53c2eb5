"""`LLM(speculative={...})`: which drafter, how many drafts, parsed and checked once."""

from __future__ import annotations

import dataclasses

from kimi_linear_jax.checkpoint import BUILTIN_DRAFT
from serving.speculative.draft_model import DraftModelDrafter
from serving.speculative.ngram import NgramDrafter
from serving.speculative.ngram_table import NgramTable, table_from_corpus

METHODS = ("ngram", "draft_model")
WIDTH_POLICIES = ("fixed", "cost")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_draft_tokens: int
    # draft_model: a checkpoint path or a model; None is the built-in draft model, which
    # drafts for the built-in default model only.
    model: str | None = None
    prompt_lookup_max: int = 3
    # 2, not 1: a match of the last token alone proposes too often and too badly. On held-out
    # code with the built-in model, n-gram speculation went from 1.13x to 1.2-1.3x
    # (benchmarks/RESULTS.md, "prompt_lookup_min").
    prompt_lookup_min: int = 2
    # Requests whose recent acceptance falls below this stop drafting (probing now and then);
    # 0 always drafts.
    min_acceptance: float = 0.25
    # draft_model only: where the context recurs, draft up to this many tokens by prompt
    # lookup (the n-gram drafter, `prompt_lookup_min/max`) instead of the model, which
    # drafts `num_draft_tokens` elsewhere; 0: the model always. On code, lookup drafts are
    # long and free and the model's are short, so each gets its own window width
    # (benchmarks/RESULTS.md, "lookup first").
    prompt_lookup_num_tokens: int = 0
    # ngram only: a corpus whose n-grams draft where the request's own tokens do not recur
    # ("stdlib": the interpreter's standard library, training split; a file or directory; or
    # a built `NgramTable`), up to `corpus_num_tokens` drafts; None: prompt lookup alone.
    corpus: object = None
    corpus_num_tokens: int = 2
    # "fixed": every drafting row gets up to num_draft_tokens drafts per window; "cost": each
    # step's width (0 = a plain step) maximises expected tokens per second on a cost curve
    # profiled at start-up and refreshed from the steps' times (`widths.py`), and requests
    # rest below the curve's break-even acceptance instead of `min_acceptance`.
    width_policy: str = "fixed"
    # > 1: one draft tree per request instead of a chain, num_draft_tokens nodes in all, each
    # node with up to topk children (the draft model's top-k at each depth of its chain; the
    # n-gram's several continuations), verified at once and committed by accept index.
    topk: int = 1

    @classmethod
    def parse(cls, spec) -> SpeculativeConfig | None:
        """From None, a SpeculativeConfig or a dict with vLLM-like keys; ValueError naming the
        bad key otherwise."""
        if spec is None or isinstance(spec, cls):
            return spec
        if not isinstance(spec, dict):
            raise ValueError(f"speculative must be a dict, got {type(spec).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"speculative: unknown keys {unknown}; known: {sorted(known)}")
        config = cls(**{"num_draft_tokens": 4, **spec})
        config.validate()
        return config

    @property
    def draft_source(self):
        """The draft model's checkpoint or model (the built-in draft model by default)."""
        return BUILTIN_DRAFT if self.model is None else self.model

    def make_drafter(self, draft_model, layout, tokenizer):
        """The drafter this config names: n-gram (with its corpus table, built from the
        tokenizer's ids) or the loaded `draft_model` (with prompt lookup first, if asked)."""
        if self.method == "ngram":
            table = self.corpus
            if table is not None and not isinstance(table, NgramTable):
                table = table_from_corpus(table, tokenizer)
            corpus_k = min(self.corpus_num_tokens, self.num_draft_tokens)
            lookup = (self.prompt_lookup_max, self.prompt_lookup_min)
            return NgramDrafter(*lookup, table, corpus_k, self.min_acceptance)
        lookup = None
        if self.prompt_lookup_num_tokens:
            lookup = NgramDrafter(self.prompt_lookup_max, self.prompt_lookup_min)
        return DraftModelDrafter(
            draft_model,
            layout,
            num_draft_tokens=self.num_draft_tokens,
            lookup=lookup,
            lookup_tokens=self.prompt_lookup_num_tokens,
            # Cost-aware widths judge every window by the curve's break-even instead.
            min_acceptance=self.min_acceptance if self.width_policy == "fixed" else 0.0,
        )

    @property
    def window_drafts(self) -> int:
        """The most drafts one verify window holds (pages and sampling buffers are sized for it)."""
        return max(self.num_draft_tokens, self.prompt_lookup_num_tokens)

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if self.width_policy not in WIDTH_POLICIES:
            raise ValueError(
                f"speculative width_policy must be one of {WIDTH_POLICIES}, "
                f"got {self.width_policy!r}"
            )
        if not isinstance(self.num_draft_tokens, int) or not 1 <= self.num_draft_tokens <= 16:
            raise ValueError(
                f"speculative num_draft_tokens must be in [1, 16], got {self.num_draft_tokens}"
            )
        if not isinstance(self.topk, int) or not 1 <= self.topk <= 8:
            raise ValueError(f"speculative topk must be in [1, 8], got {self.topk}")
        if self.topk > 1 and self.width_policy == "cost":
            raise ValueError(
                "speculative width_policy 'cost' prices chain windows: use it with topk 1"
            )
        if self.topk > 1 and self.prompt_lookup_num_tokens:
            raise ValueError("speculative topk > 1 (trees) does not take prompt_lookup_num_tokens")
        lookup = self.prompt_lookup_num_tokens
        if not isinstance(lookup, int) or not 0 <= lookup <= 16:
            raise ValueError(
                f"speculative prompt_lookup_num_tokens must be in [0, 16], got {lookup}"
            )
        if lookup and self.method != "draft_model":
            raise ValueError(
                "speculative prompt_lookup_num_tokens is for method 'draft_model' (the n-gram "
                "method drafts num_draft_tokens by lookup)"
            )
        if self.corpus == "":  # "" would read the working directory as the corpus
            raise ValueError("speculative corpus must name a corpus, got ''")
        if self.corpus is not None and self.method != "ngram":
            raise ValueError("speculative corpus is for method 'ngram'")
        corpus_k = self.corpus_num_tokens
        if not isinstance(corpus_k, int) or not 1 <= corpus_k <= 16:
            raise ValueError(f"speculative corpus_num_tokens must be in [1, 16], got {corpus_k}")
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError(
                f"speculative min_acceptance must be in [0, 1], got {self.min_acceptance}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "speculative needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min}, {self.prompt_lookup_max}"
            )
