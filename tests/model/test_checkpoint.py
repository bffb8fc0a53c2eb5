"""Checkpoint I/O: HF layout (single file and sharded) in and out, bit-exact round trips,
fp32 parameters in bf16 models, transformers interop both ways, errors, Orbax."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_linear_jax import load_pretrained, save_pretrained
from kimi_linear_jax.checkpoint import (
    INDEX,
    SINGLE,
    CheckpointError,
    CorruptCheckpointError,
    MissingTensorError,
    NotACheckpointError,
    ShapeMismatchError,
    UnexpectedTensorError,
    load_orbax,
    save_orbax,
)
from kimi_linear_jax.presets import preset
from kimi_linear_jax.safetensors_file import SafetensorsFile, write_safetensors
from kimi_linear_jax.testing import make_tiny_checkpoint, random_model
from tests.helpers import TF_TINY

FP32_PARAMS = {"A_log", "dt_bias", "e_score_correction_bias"}


# ---- helpers -------------------------------------------------------------------------------------
def params(model) -> dict[str, np.ndarray]:
    """Every parameter by its dotted NNX path, as numpy."""
    return {
        ".".join(str(p) for p in path): np.asarray(v.get_value())
        for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def assert_same_params(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        # Bit-identical, not merely close.
        assert a[k].tobytes() == b[k].tobytes(), k


def read_tensors(path) -> dict[str, np.ndarray]:
    f = SafetensorsFile(os.path.join(path, SINGLE))
    return {k: np.array(f[k]) for k in f}


def rewrite(path, edit) -> None:
    """Apply `edit(dict of tensors) -> dict` to the single-file checkpoint at `path`."""
    tensors = edit(read_tensors(path))
    write_safetensors(os.path.join(path, SINGLE), tensors)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """A random tiny checkpoint (float32) written by make_tiny_checkpoint; never modified."""
    path = tmp_path_factory.mktemp("tiny_ckpt")
    config = make_tiny_checkpoint(path, seed=0)
    return path, config


@pytest.fixture
def ckpt_copy(tiny_ckpt, tmp_path):
    """A private copy of the tiny checkpoint for tests that damage it."""
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt[0], dst)
    return dst


@pytest.fixture(scope="module")
def tiny_model_f32(tiny_ckpt):
    return load_pretrained(tiny_ckpt[0], dtype="float32")


# ---- round trips ---------------------------------------------------------------------------------
def test_tiny_checkpoint_layout(tiny_ckpt, tiny_model_f32):
    path, config = tiny_ckpt
    assert sorted(os.listdir(path)) == ["config.json", SINGLE]
    with open(path / "config.json") as f:
        hf = json.load(f)
    assert hf["model_type"] == "kimi_linear"
    assert hf["linear_attn_config"]["full_attn_layers"] == [3]
    assert config == preset("tiny") and tiny_model_f32.config == config
    t = SafetensorsFile(path / SINGLE)
    # The release's names: per-expert tensors, layer 0's dense MLP under mlp.*, MLA layer 2.
    assert t.shape("model.layers.1.block_sparse_moe.experts.7.w2.weight") == (64, 32)
    assert t.shape("model.layers.0.mlp.gate_proj.weight") == (128, 64)
    assert t.shape("model.layers.2.self_attn.kv_a_proj_with_mqa.weight") == (40, 64)
    assert t.shape("model.layers.0.self_attn.A_log") == (1, 1, 4, 1)
    assert "model.layers.1.block_sparse_moe.experts.w1" not in t
    assert len(t) == len(params(tiny_model_f32)) + 3 * 3 * (8 - 1)


def test_save_load_bit_identical_float32(tmp_path, tiny_model_f32):
    model = random_model(preset("tiny"), seed=1)
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path, dtype="float32")
    assert loaded.config == model.config
    got = params(loaded)
    assert_same_params(got, params(model))
    # A different random model would not pass: the comparison has teeth.
    name = "model.layers.1.self_attn.q_proj.weight"
    assert not np.array_equal(got[name], params(tiny_model_f32)[name])


def test_save_load_bit_identical_bfloat16(tmp_path, tiny_ckpt):
    model = load_pretrained(tiny_ckpt[0], dtype="bfloat16")
    save_pretrained(model, tmp_path)
    stored = SafetensorsFile(tmp_path / SINGLE)
    assert stored["model.layers.0.self_attn.q_proj.weight"].dtype == jnp.bfloat16
    assert stored["model.layers.0.self_attn.A_log"].dtype == np.float32
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"
    loaded = load_pretrained(tmp_path, dtype="bfloat16")
    assert loaded.config == model.config
    assert_same_params(params(loaded), params(model))


def test_load_save_reproduces_files(tiny_ckpt, tiny_model_f32, tmp_path):
    path, _ = tiny_ckpt
    save_pretrained(tiny_model_f32, tmp_path)
    assert (tmp_path / SINGLE).read_bytes() == (path / SINGLE).read_bytes()
    assert (tmp_path / "config.json").read_bytes() == (path / "config.json").read_bytes()
    assert_same_params(params(load_pretrained(tmp_path, dtype="float32")), params(tiny_model_f32))


def test_bf16_load_keeps_fp32_params(tiny_ckpt):
    path, _ = tiny_ckpt
    model = load_pretrained(path, dtype="bfloat16")
    assert model.dtype == jnp.bfloat16
    stored = read_tensors(path)
    fp32 = []
    for name, value in params(model).items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in FP32_PARAMS:
            fp32.append(name)
            assert value.dtype == np.float32, name
            np.testing.assert_array_equal(value, stored[name], err_msg=name)
        else:
            assert value.dtype == jnp.bfloat16, name
            if ".experts." not in name:
                want = stored[name].astype(jnp.bfloat16)
                assert value.tobytes() == want.tobytes(), name
    # 3 KDA layers x (A_log, dt_bias) + 3 MoE routers.
    assert len(fp32) == 9
    # The correction bias is random in the file, so it must not have been rounded to bf16.
    bias = stored["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"]
    assert not np.array_equal(bias, bias.astype(jnp.bfloat16).astype(np.float32))


def test_sharded_save_load(tmp_path, tiny_model_f32):
    total = sum(a.nbytes for a in params(tiny_model_f32).values())
    save_pretrained(tiny_model_f32, tmp_path, max_shard_bytes=total // 3)
    files = sorted(os.listdir(tmp_path))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert SINGLE not in files and INDEX in files
    n = len(shards)
    assert n >= 3
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    with open(tmp_path / INDEX) as f:
        index = json.load(f)
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == total
    for shard in shards:
        t = SafetensorsFile(tmp_path / shard)
        assert sum(t[k].nbytes for k in t) <= total // 3 or len(t) == 1
        assert all(index["weight_map"][k] == shard for k in t)
    assert_same_params(params(load_pretrained(tmp_path, dtype="float32")), params(tiny_model_f32))


@pytest.mark.parametrize("spelling", ["mlp", "block_sparse_moe"])
def test_dense_ffn_under_both_names(ckpt_copy, tiny_model_f32, spelling):
    def rename(tensors):
        out = {}
        for k, v in tensors.items():
            if k.startswith("model.layers.0.mlp."):
                k = k.replace(".mlp.", f".{spelling}.")
            out[k] = v
        return out

    rewrite(ckpt_copy, rename)
    names = set(SafetensorsFile(ckpt_copy / SINGLE))
    assert f"model.layers.0.{spelling}.down_proj.weight" in names
    assert_same_params(params(load_pretrained(ckpt_copy, dtype="float32")), params(tiny_model_f32))


def test_dense_ffn_under_both_names_at_once_is_rejected(ckpt_copy):
    def duplicate(tensors):
        for k in [k for k in tensors if k.startswith("model.layers.0.mlp.")]:
            tensors[k.replace(".mlp.", ".block_sparse_moe.")] = tensors[k]
        return tensors

    rewrite(ckpt_copy, duplicate)
    with pytest.raises(UnexpectedTensorError, match=r"model\.layers\.0\.block_sparse_moe\."):
        load_pretrained(ckpt_copy, dtype="float32")


# ---- transformers interop ------------------------------------------------------------------------
def ours_as_torch_names(p: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Our parameters under the names and layouts of transformers' in-memory state_dict
    (forget-gate submodule, q/k/v convs concatenated, experts fused as gate_up_proj)."""
    out = {}
    for name, value in p.items():
        name = re.sub(
            r"self_attn\.(f_a_proj|f_b_proj|A_log|dt_bias)", r"self_attn.forget_gate.\1", name
        )
        name = name.replace(".block_sparse_moe.", ".mlp.")
        m = re.fullmatch(r"(.*)\.(q|k|v)_conv1d\.weight", name)
        if m:
            if m[2] == "q":
                out[f"{m[1]}.conv1d.weight"] = np.concatenate(
                    [p[f"{m[1]}.{c}_conv1d.weight"] for c in "qkv"], axis=0
                )
            continue
        m = re.fullmatch(r"(.*\.mlp\.experts)\.(w[123])", name)
        if m:
            src = m[1].replace(".mlp.", ".block_sparse_moe.")
            if m[2] == "w1":
                out[f"{m[1]}.gate_up_proj"] = np.concatenate([p[f"{src}.w1"], p[f"{src}.w3"]], 1)
            elif m[2] == "w2":
                out[f"{m[1]}.down_proj"] = value
            continue
        out[name] = value
    return out


def torch_state(model) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def transformers_ckpt(tmp_path_factory):
    """A random tiny transformers model and the checkpoint its save_pretrained wrote."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**TF_TINY)).eval()
    with torch.no_grad():
        # Non-trivial norms and router bias, so that any mix-up of two tensors shows.
        for name, p in model.named_parameters():
            if "norm" in name or "e_score_correction_bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("tf_ckpt")
    model.save_pretrained(path)
    return path, model


def test_load_transformers_checkpoint(transformers_ckpt):
    path, tmodel = transformers_ckpt
    # transformers writes layer 0's dense MLP under block_sparse_moe.*
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in set(SafetensorsFile(path / SINGLE))
    model = load_pretrained(path, dtype="float32")
    assert model.config.layer_kinds == ("kda", "kda", "mla", "kda")
    assert model.config.num_experts_per_token == 2 and model.config.num_expert_group == 2
    ours = params(model)
    theirs = torch_state(tmodel)
    # A few by hand, in the checkpoint's own terms...
    I = 32
    np.testing.assert_array_equal(
        ours["model.layers.2.self_attn.q_proj.weight"],
        theirs["model.layers.2.self_attn.q_proj.weight"],
    )
    np.testing.assert_array_equal(
        ours["model.layers.0.self_attn.A_log"], theirs["model.layers.0.self_attn.forget_gate.A_log"]
    )
    gate_up = theirs["model.layers.3.mlp.experts.gate_up_proj"]
    np.testing.assert_array_equal(
        ours["model.layers.3.block_sparse_moe.experts.w1"][5], gate_up[5, :I]
    )
    np.testing.assert_array_equal(
        ours["model.layers.3.block_sparse_moe.experts.w3"][5], gate_up[5, I:]
    )
    np.testing.assert_array_equal(
        ours["model.layers.3.block_sparse_moe.experts.w2"][6],
        theirs["model.layers.3.mlp.experts.down_proj"][6],
    )
    np.testing.assert_array_equal(
        ours["model.layers.0.mlp.gate_proj.weight"], theirs["model.layers.0.mlp.gate_proj.weight"]
    )
    # ...and then every tensor of transformers' state.
    mapped = ours_as_torch_names(ours)
    assert sorted(mapped) == sorted(theirs)
    for k in theirs:
        np.testing.assert_array_equal(mapped[k], theirs[k], err_msg=k)


def test_transformers_loads_our_checkpoint(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = random_model(preset("tiny"), seed=3)
    save_pretrained(model, tmp_path)
    tmodel, info = transformers.KimiLinearForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["unexpected_keys"], info["unexpected_keys"]
    assert not info["mismatched_keys"], info["mismatched_keys"]
    assert tmodel.config.num_experts_per_token == 2 and tmodel.config.num_expert_group == 2
    assert tmodel.config.layer_types == [
        "linear_attention",
        "linear_attention",
        "full_attention",
        "linear_attention",
    ]
    ours = params(model)
    theirs = torch_state(tmodel)
    I = 32
    gate_up = theirs["model.layers.1.mlp.experts.gate_up_proj"]
    np.testing.assert_array_equal(
        gate_up[0, :I], ours["model.layers.1.block_sparse_moe.experts.w1"][0]
    )
    np.testing.assert_array_equal(
        gate_up[7, I:], ours["model.layers.1.block_sparse_moe.experts.w3"][7]
    )
    np.testing.assert_array_equal(
        theirs["model.layers.2.mlp.experts.down_proj"][4],
        ours["model.layers.2.block_sparse_moe.experts.w2"][4],
    )
    np.testing.assert_array_equal(
        theirs["model.layers.1.mlp.gate.e_score_correction_bias"],
        ours["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"],
    )
    np.testing.assert_array_equal(
        theirs["model.layers.2.self_attn.kv_b_proj.weight"],
        ours["model.layers.2.self_attn.kv_b_proj.weight"],
    )
    mapped = ours_as_torch_names(ours)
    assert sorted(mapped) == sorted(theirs)
    for k in theirs:
        np.testing.assert_array_equal(theirs[k], mapped[k], err_msg=k)


# ---- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name",
    [
        "model.layers.1.self_attn.dt_bias",
        "model.layers.2.block_sparse_moe.experts.5.w3.weight",
        "model.layers.0.mlp.down_proj.weight",
        "lm_head.weight",
    ],
)
def test_missing_tensor(ckpt_copy, name):
    rewrite(ckpt_copy, lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(MissingTensorError, match=re.escape(name)):
        load_pretrained(ckpt_copy, dtype="float32")


def test_unexpected_tensor(ckpt_copy):
    name = "model.layers.1.self_attn.extra_proj.weight"
    rewrite(ckpt_copy, lambda t: {**t, name: np.zeros((2, 2), np.float32)})
    with pytest.raises(UnexpectedTensorError, match=re.escape(name)):
        load_pretrained(ckpt_copy, dtype="float32")


def test_extra_expert_is_unexpected(ckpt_copy):
    # Expert 8 of a model with 8 experts (0..7).
    name = "model.layers.1.block_sparse_moe.experts.8.w1.weight"
    rewrite(ckpt_copy, lambda t: {**t, name: np.zeros((32, 64), np.float32)})
    with pytest.raises(UnexpectedTensorError, match=re.escape(name)):
        load_pretrained(ckpt_copy, dtype="float32")


@pytest.mark.parametrize(
    "name, expected, got",
    [
        ("model.layers.0.self_attn.q_proj.weight", (32, 64), (33, 64)),
        ("model.layers.3.block_sparse_moe.experts.2.w2.weight", (64, 32), (32, 64)),
        ("model.layers.0.self_attn.A_log", (1, 1, 4, 1), (4,)),
    ],
)
def test_shape_mismatch(ckpt_copy, name, expected, got):
    rewrite(ckpt_copy, lambda t: {**t, name: np.zeros(got, np.float32)})
    pattern = f"{re.escape(name)}.*{re.escape(str(expected))}.*{re.escape(str(got))}"
    with pytest.raises(ShapeMismatchError, match=pattern):
        load_pretrained(ckpt_copy, dtype="float32")


@pytest.mark.parametrize("keep", ["all_but_4", "header_half", "4_bytes"])
def test_truncated_file(ckpt_copy, keep):
    f = ckpt_copy / SINGLE
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    cut = {"all_but_4": len(data) - 4, "header_half": 8 + n // 2, "4_bytes": 4}[keep]
    f.write_bytes(data[:cut])
    # The last tensor in the file (names are sorted) is the one whose data is cut short.
    what = {"all_but_4": r"model\.norm\.weight", "header_half": "header", "4_bytes": "header"}
    with pytest.raises(CorruptCheckpointError, match=f"{re.escape(SINGLE)}.*{what[keep]}"):
        load_pretrained(ckpt_copy, dtype="float32")


@pytest.mark.parametrize("junk", [b"\xff", b"{"])
def test_garbage_header(ckpt_copy, junk):
    f = ckpt_copy / SINGLE
    data = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    data[8 : 8 + n] = (junk * n)[:n]
    f.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=f"{re.escape(SINGLE)}.*unreadable header"):
        load_pretrained(ckpt_copy, dtype="float32")


def test_header_not_an_object(ckpt_copy):
    f = ckpt_copy / SINGLE
    data = f.read_bytes()
    header = b"[1, 2, 3]"
    f.write_bytes(struct.pack("<Q", len(header)) + header + data[8:])
    with pytest.raises(CorruptCheckpointError, match="not a JSON object"):
        load_pretrained(ckpt_copy, dtype="float32")


@pytest.fixture
def sharded(tmp_path, tiny_model_f32):
    save_pretrained(tiny_model_f32, tmp_path, max_shard_bytes=20_000)
    with open(tmp_path / INDEX) as f:
        index = json.load(f)
    return tmp_path, index


def test_index_points_to_missing_shard(sharded):
    path, index = sharded
    shard = sorted(set(index["weight_map"].values()))[1]
    os.remove(path / shard)
    with pytest.raises(CorruptCheckpointError, match=re.escape(shard)):
        load_pretrained(path, dtype="float32")


def test_index_lists_tensor_the_shard_lacks(sharded):
    path, index = sharded
    name, shard = sorted(index["weight_map"].items())[0]
    other = next(s for s in index["weight_map"].values() if s != shard)
    index["weight_map"][name] = other
    with open(path / INDEX, "w") as f:
        json.dump(index, f)
    with pytest.raises(CorruptCheckpointError, match=f"{re.escape(other)}.*{re.escape(name)}"):
        load_pretrained(path, dtype="float32")


def test_unreadable_index(sharded):
    path, _ = sharded
    (path / INDEX).write_text('{"metadata": {}}')  # no weight_map
    with pytest.raises(CorruptCheckpointError, match="weight_map"):
        load_pretrained(path, dtype="float32")


def test_path_is_a_file(tmp_path):
    p = tmp_path / "model.safetensors"
    p.write_bytes(b"")
    with pytest.raises(NotACheckpointError, match=re.escape(str(p))):
        load_pretrained(p)


def test_path_does_not_exist(tmp_path):
    p = tmp_path / "nowhere"
    with pytest.raises(NotACheckpointError, match=re.escape(str(p))):
        load_pretrained(p)


def test_dir_without_config(ckpt_copy):
    os.remove(ckpt_copy / "config.json")
    with pytest.raises(NotACheckpointError, match=r"config\.json"):
        load_pretrained(ckpt_copy)


def test_dir_without_weights(ckpt_copy):
    os.remove(ckpt_copy / SINGLE)
    with pytest.raises(NotACheckpointError, match=re.escape(SINGLE)):
        load_pretrained(ckpt_copy)


def test_config_of_another_model(ckpt_copy):
    cfg = ckpt_copy / "config.json"
    hf = json.loads(cfg.read_text())
    hf["model_type"] = "llama"
    cfg.write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="model_type.*llama"):
        load_pretrained(ckpt_copy)


@pytest.mark.parametrize("dtype", ["float16", "fp32", jnp.float16])
def test_bad_dtype(tiny_ckpt, dtype):
    with pytest.raises(ValueError, match="dtype"):
        load_pretrained(tiny_ckpt[0], dtype=dtype)


def test_errors_are_checkpoint_errors():
    for cls in (
        NotACheckpointError,
        MissingTensorError,
        UnexpectedTensorError,
        ShapeMismatchError,
        CorruptCheckpointError,
    ):
        assert issubclass(cls, CheckpointError) and issubclass(cls, ValueError)


# ---- Orbax ---------------------------------------------------------------------------------------
def test_orbax_round_trip(tmp_path, tiny_ckpt, tiny_model_f32):
    save_orbax(tiny_model_f32, tmp_path / "orbax")
    assert os.path.isfile(tmp_path / "orbax" / "config.json")
    loaded = load_orbax(tmp_path / "orbax", dtype="float32")
    assert loaded.config == tiny_model_f32.config
    assert_same_params(params(loaded), params(tiny_model_f32))
    # Restoring as bf16 casts like load_pretrained does, fp32 parameters included.
    bf16 = load_orbax(tmp_path / "orbax", dtype="bfloat16")
    assert_same_params(params(bf16), params(load_pretrained(tiny_ckpt[0], dtype="bfloat16")))
