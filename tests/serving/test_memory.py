"""The engine's pool sizing (`LLM(gpu_memory_utilization=..., device_memory=...)`) and
dtype "auto", on the tiny model (CPU: XLA reports no device memory, so the tests pass it).

`tiny`: 3 KDA layers of 4 heads x 8 (conv width 4), one MLA layer of latent 32 + rope 8.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from kimi_linear_jax.checkpoint import auto_dtype, save_pretrained
from kimi_linear_jax.presets import preset
from kimi_linear_jax.testing import random_model
from serving.engine import LLM

F32 = 4
SHAPES = dict(
    page_size=4,
    max_model_len=256,
    max_num_batched_tokens=64,
    chunk_size=16,
    batch_buckets=(1, 2, 4),
    token_buckets=(16,),
)


@pytest.fixture(scope="module")
def model():
    return random_model(preset("tiny"))


def bytes_on(tree, device) -> int:
    return sum(
        s.data.nbytes
        for x in jax.tree.leaves(tree)
        for s in x.addressable_shards
        if s.device == device
    )


def test_engine_allocates_the_pools_it_planned(model):
    """tp 2 x dcp 2 on 8 MiB devices: what device 0 really holds (weights, caches) plus the
    compiled steps' peak stays within 0.9 x 8 MiB, and leaves less than a page unused."""
    llm = LLM(model, device_memory="8MiB", tensor_parallel_size=2, dcp_size=2, **SHAPES)
    plan, layout = llm.memory_plan, llm.layout
    assert plan.activation_method == "compiled" and plan.activation_bytes > 0
    assert (layout.num_pages, layout.num_slots) == (plan.num_pages, plan.num_state_slots)
    assert llm.scheduler.max_num_seqs == plan.max_num_seqs == layout.max_num_seqs
    # A device's page: 4 tokens of the MLA row (32 + 8) in f32. A slot: 3 KDA layers of
    # S [4/2 heads, 8, 8] and three conv windows [3, 4 * 8 / 2], all f32 here.
    page = 4 * (32 + 8) * F32
    slot = 3 * (2 * 8 * 8 * F32 + 3 * 3 * 16 * F32)
    device = llm.model.par.mesh.devices.flat[0]
    caches = bytes_on(llm.runner.cache, device)
    assert caches == layout.num_pages * page + layout.num_slots * slot
    used = bytes_on(nnx.state(llm.model), device) + caches + plan.activation_bytes
    budget = int(8 * 2**20 * 0.9)
    assert 0 <= budget - used < page


def test_fixed_pools_without_device_memory(model):
    llm = LLM(model, page_size=4)  # XLA:CPU reports no memory and none was given
    assert llm.memory_plan is None
    assert (llm.layout.num_pages, llm.layout.max_num_seqs) == (256, 8)
    assert llm.layout.num_checkpoint_slots == 16
    given = LLM(model, page_size=4, num_pages=15, device_memory="8MiB")
    assert given.memory_plan is None and given.layout.num_pages == 15


def test_too_small_a_device_says_why(model):
    # The tiny model's weights are 1.1 MB: 0.9 x 1 MiB cannot hold them.
    with pytest.raises(ValueError, match="does not fit the device memory: weights"):
        LLM(model, device_memory="1MiB", **SHAPES)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(gpu_memory_utilization=0), "gpu_memory_utilization must be in"),
        (dict(device_memory="lots"), "cannot read 'lots'"),
    ],
)
def test_bad_memory_options(model, kw, match):
    with pytest.raises(ValueError, match=match):
        LLM(model, **kw)


def test_auto_dtype_follows_the_checkpoint(tmp_path):
    save_pretrained(random_model(preset("tiny"), dtype=jnp.bfloat16), tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    llm = LLM(str(tmp_path), page_size=4, num_pages=15, max_num_seqs=1)
    assert llm.model.dtype == jnp.bfloat16
    kda = llm.runner.cache.kda[0]
    assert kda.S.dtype == jnp.float32  # the KDA state stays fp32
    assert kda.conv_q.dtype == jnp.bfloat16
    assert llm.runner.cache.mla[0].latent.dtype == jnp.bfloat16


def test_auto_dtype_of_the_builtin_model_is_float32():
    assert LLM(page_size=4, num_pages=8, max_num_seqs=1).model.dtype == jnp.float32


@pytest.mark.parametrize(
    ("torch_dtype", "want"),
    [("bfloat16", "bfloat16"), ("float32", "float32"), ("float16", "bfloat16"), (None, "float32")],
)
def test_auto_dtype_table(tmp_path, torch_dtype, want):
    config = {} if torch_dtype is None else {"torch_dtype": torch_dtype}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert auto_dtype(tmp_path) == want


def test_auto_dtype_rejects_an_unknown_dtype(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "int8"}))
    with pytest.raises(ValueError, match="torch_dtype 'int8' is not one of"):
        auto_dtype(tmp_path)
