"""lm-eval 0.4.13's `local-completions`, the real package, end to end against the server
(issue 36, defect 1): a tiny local multiple-choice task and a generate_until task, no
downloads. Its loglikelihoods must be the offline engine's prompt logprobs summed over each
continuation, its accuracy the one those give, and its generations the offline greedy text.

lm-eval finds the server's tokenizer through vLLM's /tokenizer_info and /tokenize (its
"remote" backend), so its context lengths are the server's own token counts.
"""

from __future__ import annotations

import json
import math
import os

import pytest

# No hub: the task's data is a local JSON file, and nothing may reach for the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import lm_eval  # noqa: E402  (the test extra installs it)
from lm_eval.tasks import TaskManager  # noqa: E402

from kimi_linear_jax.presets import preset  # noqa: E402
from kimi_linear_jax.testing import random_model  # noqa: E402
from kimi_linear_jax.tokenizer import ByteTokenizer  # noqa: E402
from serving.core.sampling import SamplingParams  # noqa: E402
from serving.engine import LLM  # noqa: E402
from serving.server import BackgroundServer, build_app  # noqa: E402
from tests.serving.test_server import SHAPES  # noqa: E402  (one compile for both modules)

NAME = "tiny-lm-eval"
DOCS = [
    {"question": "The sky is", "choices": ["blue", "green", "made of cheese"], "answer": 0},
    {"question": "Two plus two is", "choices": ["four", "five"], "answer": 0},
    {"question": "Water is", "choices": ["dry", "wet", "loud", "cold"], "answer": 1},
    {"question": "Cats say", "choices": ["moo", "meow"], "answer": 1},
]
MC_TASK = """
task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_TASK = """
task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[0]}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 6
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = random_model(preset("tiny"))
    tokenizer = ByteTokenizer(model.config.vocab_size)
    offline = LLM(model, tokenizer=tokenizer, **SHAPES)
    app = build_app(LLM(model, tokenizer=tokenizer, **SHAPES), model_name=NAME)
    with BackgroundServer(app) as server:
        yield server.url, offline, tokenizer


@pytest.fixture(scope="module")
def results(setup, tmp_path_factory):
    url, _, _ = setup
    root = tmp_path_factory.mktemp("lm_eval")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (root / "tiny_mc.yaml").write_text(MC_TASK.format(data=data))
    (root / "tiny_gen.yaml").write_text(GEN_TASK.format(data=data))
    os.environ["HF_DATASETS_CACHE"] = str(root / "hf_cache")
    return lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": f"{url}/v1/completions", "model": NAME, "num_concurrent": 1},
        tasks=["tiny_mc", "tiny_gen"],
        task_manager=TaskManager(include_path=str(root)),
        num_fewshot=0,
        batch_size=1,
        log_samples=True,
    )


def continuation_logprob(offline, tokenizer, context: str, continuation: str) -> float:
    """Sum of the offline prompt logprobs of the continuation's tokens after the context."""
    context_ids = tokenizer.encode(context)
    ids = tokenizer.encode(context + continuation)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    (out,) = offline.generate([ids], params, use_tqdm=False)
    return sum(out.prompt_logprobs[j][ids[j]] for j in range(len(context_ids), len(ids)))


def test_multiple_choice_loglikelihoods_are_the_prompt_logprobs(setup, results):
    _, offline, tokenizer = setup
    samples = sorted(results["samples"]["tiny_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(DOCS)
    right = 0
    for doc, sample in zip(DOCS, samples, strict=True):
        got = [resp[0][0] for resp in sample["resps"]]
        want = [
            continuation_logprob(offline, tokenizer, doc["question"], " " + choice)
            for choice in doc["choices"]
        ]
        assert all(g < 0 for g in got)  # the defect: every loglikelihood came back 0
        for g, w in zip(got, want, strict=True):
            assert math.isclose(g, w, rel_tol=1e-4, abs_tol=1e-3), (doc, got, want)
        right += max(range(len(want)), key=want.__getitem__) == doc["answer"]
    assert results["results"]["tiny_mc"]["acc,none"] == pytest.approx(right / len(DOCS))


def test_generate_until_is_the_offline_greedy_text(setup, results):
    _, offline, _ = setup
    samples = sorted(results["samples"]["tiny_gen"], key=lambda s: s["doc_id"])
    for doc, sample in zip(DOCS, samples, strict=True):
        params = SamplingParams(temperature=0, max_tokens=6, stop=("\n\n",), seed=1234)
        (want,) = offline.generate([doc["question"]], params, use_tqdm=False)
        assert sample["resps"][0][0] == want.text
