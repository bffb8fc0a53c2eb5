"""Where the weights and caches live on a TP x DCP mesh, and the plans that must be refused."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_linear_jax import checkpoint
from kimi_linear_jax.checkpoint import load_pretrained, save_pretrained
from kimi_linear_jax.parallel.mesh import make_parallel
from kimi_linear_jax.parallel.rules import init_cache, shard_model
from kimi_linear_jax.parallel.weights import param_bytes_per_device
from serving.engine import LLM
from tests.parallel.test_model_parallel import CONFIG, base_model

# The list, written independently of the rules table: what TP must shard, what it
# must keep whole. Every parameter matches exactly one pattern, so a new parameter forces a
# decision here.
SHARDED = [
    r"model\.embed_tokens\.weight",
    r"lm_head\.weight",
    r".*self_attn\.(q_proj|kv_b_proj|o_proj)\.weight",  # MLA heads, and KDA q / o
    r".*self_attn\.(k_proj|v_proj|f_b_proj|g_b_proj|b_proj)\.weight",
    r".*self_attn\.[qkv]_conv1d\.weight",
    r".*self_attn\.(A_log|dt_bias)",
    r".*block_sparse_moe\.experts\.w[123]",
    r".*block_sparse_moe\.shared_experts\.(gate|up|down)_proj\.weight",
    r".*mlp\.(gate|up|down)_proj\.weight",
]
REPLICATED = [
    r".*self_attn\.(kv_a_proj_with_mqa|f_a_proj|g_a_proj)\.weight",
    r".*(layernorm|norm|o_norm)\.weight",
    r".*block_sparse_moe\.gate\.(weight|e_score_correction_bias)",
]


def _params(model):
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        yield ".".join(str(p) for p in path), var[...]


@pytest.fixture(scope="module")
def sharded():
    return shard_model(base_model(), make_parallel(CONFIG, 8, 2))


def test_every_weight_sharded_or_replicated_as_specified(sharded):
    for name, value in _params(sharded):
        must_shard = [p for p in SHARDED if re.fullmatch(p, name)]
        must_keep = [p for p in REPLICATED if re.fullmatch(p, name)]
        assert len(must_shard) + len(must_keep) == 1, f"{name}: not classified exactly once"
        replicated = value.sharding.is_fully_replicated
        assert replicated == bool(must_keep), f"{name}: replicated={replicated} {value.sharding}"
        if must_shard:  # each of the 8 devices holds 1/8 of it
            shards = value.addressable_shards
            assert len(shards) == 8
            assert all(s.data.size * 8 == value.size for s in shards), name


def test_shard_shapes(sharded):
    cfg, tp, dcp = CONFIG, 8, 2
    E, H = cfg.num_experts, cfg.linear_num_heads
    experts = sharded.model.layers[1].block_sparse_moe.experts.w1[...]
    assert experts.sharding.shard_shape(experts.shape)[0] == E // tp
    cache = init_cache(
        cfg, sharded.par, num_slots=3, num_pages=5, page_size=4 * dcp, dtype=jnp.float32
    )
    S = cache.kda[0].S
    assert S.sharding.shard_shape(S.shape) == (3, H // tp, 8, 8)
    conv = cache.kda[0].conv_q
    assert conv.sharding.shard_shape(conv.shape)[-1] == cfg.kda_dim // tp
    latent = cache.mla[0].latent
    assert latent.shape[1] == 4 * dcp
    assert latent.sharding.shard_shape(latent.shape) == (5, 4, cfg.latent_dim)
    # The latent is spread over the DCP group and replicated across the groups.
    assert len({str(s.index) for s in latent.addressable_shards}) == dcp


def test_replicate_q_proj_keeps_the_groups_heads_whole():
    par = make_parallel(CONFIG, 8, 2, replicate_q_proj=True)
    model = shard_model(base_model(), par)
    attn = model.model.layers[2].self_attn  # layer 3 (1-based) is the MLA layer
    assert attn.__class__.__name__ == "MLA"
    q = attn.q_proj.weight[...]
    assert q.sharding.shard_shape(q.shape)[0] == q.shape[0] * 2 // 8  # H * dcp / tp heads
    o = attn.o_proj.weight[...]
    assert o.sharding.shard_shape(o.shape)[1] == o.shape[1] // 8  # H / tp heads


def test_load_pretrained_puts_each_tensor_on_its_shards(tmp_path, monkeypatch):
    """Each device reads only its block: no sharded tensor is ever read whole."""
    save_pretrained(base_model(), tmp_path)
    reads = []
    real = checkpoint._host_value

    def spy(names, where, index=()):
        out = real(names, where, index)
        reads.append((names[0], out.size))
        return out

    monkeypatch.setattr(checkpoint, "_host_value", spy)
    par = make_parallel(CONFIG, 4, 2)
    loaded = load_pretrained(tmp_path, "float32", parallel=par)
    want = dict(_params(shard_model(base_model(), par)))
    sizes = {}
    for name, value in _params(loaded):
        assert value.sharding == want[name].sharding, name
        np.testing.assert_array_equal(np.asarray(value), np.asarray(want[name]), err_msg=name)
        sizes[name] = value.size
    # Every read of a sharded tensor is one device's block (1/4 at tp 4), never the whole.
    for name, size in reads:
        key = name.removesuffix(".weight")
        key = re.sub(r"experts\.\d+\.(w[123])", r"experts.\1", key)
        full = sizes.get(key, sizes.get(name))
        value_sharded = any(re.fullmatch(p, key) or re.fullmatch(p, name) for p in SHARDED)
        if value_sharded and full is not None:
            assert size < full, f"{name}: read whole ({size} of {full})"
    assert reads


@pytest.mark.parametrize(
    "override,tp,dcp,match",
    [
        (dict(num_attention_heads=6), 4, 1, r"tensor_parallel_size 4 must divide the MLA heads"),
        (dict(linear_num_heads=6), 4, 2, r"tensor_parallel_size 4 must divide the KDA heads"),
        (dict(num_experts=12), 8, 1, r"tensor_parallel_size 8 must divide the experts \(num"),
        ({}, 4, 3, r"dcp_size 3 must divide tensor_parallel_size 4"),
        ({}, 16, 2, r"tensor_parallel_size 16 \(dcp_size 2\) asks for more devices than"),
        ({}, 0, 1, r"tensor_parallel_size must be an integer >= 1, got 0"),
    ],
)
def test_bad_plans_fail_before_loading(tmp_path, override, tp, dcp, match):
    """The engine checks the plan against config.json alone: the weights file here is garbage,
    so a load would raise a checkpoint error instead."""
    cfg = dataclasses.replace(CONFIG, **override)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_config()))
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=match) as info:
        LLM(str(tmp_path), tensor_parallel_size=tp, dcp_size=dcp)
    assert not isinstance(info.value, checkpoint.CheckpointError)
    assert str(tp) in str(info.value)


def test_dcp_alone_sets_the_tp_degree():
    par = make_parallel(CONFIG, None, 4)
    assert (par.tp, par.dcp) == (4, 4) and par.mesh.devices.shape == (1, 4)
    par = make_parallel(CONFIG, 8, 2)
    # DCP groups are contiguous runs of TP ranks: tp_rank = 2 * i + j, dcp_rank = j.
    ids = np.vectorize(lambda d: d.id)(par.mesh.devices)
    assert ids.tolist() == np.arange(8).reshape(4, 2).tolist()
    assert jax.device_count() == 8


@pytest.mark.parametrize("tp,dcp,replicate", [(8, 2, False), (4, 4, True), (1, 1, False)])
def test_abstract_bytes_per_device_equal_the_placed_shards(tp, dcp, replicate):
    """The planner's figure (abstract, from the rules) is what a device really holds."""
    par = make_parallel(CONFIG, tp, dcp, replicate_q_proj=replicate)
    model = shard_model(base_model(), par)
    device = jax.devices()[0]
    held = sum(
        s.data.nbytes for _, v in _params(model) for s in v.addressable_shards if s.device == device
    )
    want, total = param_bytes_per_device(
        CONFIG, tp, dcp, dtype=jnp.float32, replicate_q_proj=replicate
    )
    assert held == want
    assert total == sum(v.nbytes for _, v in _params(model))


def test_shard_model_leaves_the_original_where_it_was(sharded):
    """`sharded` (the fixture) was made from base_model(): that model is still on one device
    and still built for one device."""
    assert not base_model().par.sharded and sharded.par.sharded
    assert all(len(v.devices()) == 1 for _, v in _params(base_model()))
