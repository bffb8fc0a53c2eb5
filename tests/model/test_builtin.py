"""The shipped built-in models: they load with their BPE tokenizer, are trained (held-out loss
far below a uniform guess), generate through the tokenizer, and the draft model drafts for
the default one without changing its greedy output."""

from __future__ import annotations

import json
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest

from kimi_linear_jax import corpus
from kimi_linear_jax.checkpoint import BUILTIN_DRAFT, BUILTIN_MODEL, load_model_and_tokenizer
from kimi_linear_jax.tokenizer import HFTokenizer
from kimi_linear_jax.train import token_nll
from serving.cli import main as cli_main
from serving.core.sampling import SamplingParams
from serving.engine import LLM

PROMPT = 'import os\n\n\ndef list_python_files(root):\n    """Return the .py files under root."""\n'
SHAPES = dict(max_num_seqs=2, num_pages=64)


@pytest.fixture(scope="module")
def builtin():
    return load_model_and_tokenizer(None)


def _held_out_ids(tokenizer, n: int) -> list[int]:
    """n held-out tokens from past the first file's header (its licence and prose)."""
    names = json.load(open(os.path.join(BUILTIN_MODEL, "data.json")))["held_out"]
    texts = [(corpus.stdlib_dir() / name) for name in names]
    text = "".join(p.read_text() for p in texts if p.is_file())
    return tokenizer.encode(text)[2000 : 2000 + n]


@pytest.mark.parametrize("path", [BUILTIN_MODEL, BUILTIN_DRAFT])
def test_builtin_models_are_trained(path):
    """Mean held-out loss well under the uniform guess ln(vocab) (8.3 nats for 4,096 ids): a
    random or mis-loaded model scores at or above it."""
    model, tokenizer = load_model_and_tokenizer(path)
    assert isinstance(tokenizer, HFTokenizer) and model.config.vocab_size == 4096
    ids = _held_out_ids(tokenizer, 257)
    nll = token_nll(model, jnp.asarray([ids], jnp.int32))
    assert float(jnp.mean(nll)) < 0.7 * math.log(model.config.vocab_size)


def test_default_llm_generates_python_through_the_tokenizer(builtin):
    llm = LLM(**SHAPES)
    assert llm.config == builtin[0].config and isinstance(llm.tokenizer, HFTokenizer)
    (out,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    assert len(out.token_ids) > 0 and out.text == llm.tokenizer.decode(out.token_ids)
    assert out.prompt_token_ids == llm.tokenizer.encode(PROMPT)


def test_builtin_draft_model_keeps_greedy_output_and_gets_accepted():
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = LLM(**SHAPES).generate([PROMPT], params, use_tqdm=False)
    drafted = LLM(speculative={"method": "draft_model", "num_draft_tokens": 4}, **SHAPES)
    spec = drafted.generate([PROMPT], params, use_tqdm=False)
    assert spec[0].token_ids == plain[0].token_ids
    metrics = drafted.metrics()
    assert metrics["spec_accepted_tokens"] > 0.2 * metrics["spec_draft_tokens"] > 0


def test_cli_text_output_continues_the_prompt(capsys):
    argv = ["generate", "--prompt", PROMPT, "--max-tokens", "8", "--output-format", "text"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(PROMPT) and len(out) > len(PROMPT)


def test_shipped_files_are_small():
    for path in (BUILTIN_MODEL, BUILTIN_DRAFT):
        sizes = {f: os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)}
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(sizes)
        assert sum(sizes.values()) < 40e6, sizes
    np.testing.assert_equal(
        open(os.path.join(BUILTIN_MODEL, "tokenizer.json")).read(),
        open(os.path.join(BUILTIN_DRAFT, "tokenizer.json")).read(),
    )
