"""Checkpoints: the released HF layout (config.json + safetensors, single or sharded) in and
out, and Orbax save/restore of converted parameters.

A parameter's NNX path joined by dots is its checkpoint name (layers keep HF's `[out, in]`
layout and attribute names). Two exceptions: routed experts are stacked `[E, ...]` here and
stored one tensor per expert there, and a dense FFN is accepted under `mlp.*` or
`block_sparse_moe.*` (transformers writes the latter).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from kimi_linear_jax.config import KimiLinearConfig
from kimi_linear_jax.model import KimiLinearForCausalLM
from kimi_linear_jax.parallel.mesh import SINGLE as ONE_DEVICE
from kimi_linear_jax.parallel.mesh import Parallel, validate
from kimi_linear_jax.parallel.rules import ShardingRules, var_spec
from kimi_linear_jax.safetensors_file import (
    SafetensorsFile,
    SafetensorsFormatError,
    write_safetensors,
)

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


class CheckpointError(ValueError):
    """Base of every checkpoint problem; the message says what and where."""


class NotACheckpointError(CheckpointError):
    pass


class MissingTensorError(CheckpointError):
    pass


class UnexpectedTensorError(CheckpointError):
    pass


class ShapeMismatchError(CheckpointError):
    pass


class CorruptCheckpointError(CheckpointError):
    pass


@dataclass(frozen=True)
class _Slot:
    """One model parameter and the checkpoint names that fill it."""

    path: tuple
    names: tuple[str, ...]  # several for stacked experts (one per expert)
    shape: tuple[int, ...]  # of each named tensor
    aliases: tuple[str, ...] = ()  # alternative spellings, same order as names


def _slots(state: nnx.State) -> list[_Slot]:
    slots = []
    for path, var in nnx.to_flat_state(state):
        name = ".".join(str(p) for p in path)
        shape = tuple(var.shape)
        m = re.fullmatch(r"(.*\.experts)\.(w[123])", name)
        if m:
            names = tuple(f"{m[1]}.{e}.{m[2]}.weight" for e in range(shape[0]))
            slots.append(_Slot(path, names, shape[1:]))
        elif ".mlp." in name:
            slots.append(
                _Slot(path, (name,), shape, (name.replace(".mlp.", ".block_sparse_moe."),))
            )
        else:
            slots.append(_Slot(path, (name,), shape))
    return slots


def resolve_dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(_DTYPES)} or 'auto', got {dtype!r}")
        return jnp.dtype(_DTYPES[dtype])
    d = jnp.dtype(dtype)
    if d not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"dtype: expected bfloat16 or float32, got {d}")
    return d


# The dtype "auto" takes for a checkpoint's torch_dtype. float16 runs as bfloat16 (same width;
# the model takes bfloat16 or float32 only); a config without torch_dtype was saved in float32
# (transformers' default).
_AUTO = {"bfloat16": "bfloat16", "float16": "bfloat16", "float32": "float32", None: "float32"}


def auto_dtype(path: str | os.PathLike | None) -> str:
    """What `dtype="auto"` means: the checkpoint's `torch_dtype` ("bfloat16" for the release),
    "float32" for the built-in model (`path=None`). The KDA state is fp32 either way."""
    if path is None:
        return "float32"
    path = os.fspath(path)
    cfg = path if os.path.isfile(path) else os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        raise NotACheckpointError(f"{path}: not a checkpoint (no config.json)")
    try:
        with open(cfg) as f:
            torch_dtype = json.load(f).get("torch_dtype")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{cfg}: not a JSON object ({e})") from e
    if torch_dtype not in _AUTO:
        raise ValueError(f"{cfg}: torch_dtype {torch_dtype!r} is not one of {sorted(_DTYPES)}")
    return _AUTO[torch_dtype]


# ---- reading -----------------------------------------------------------------------------------
def read_config(path: str | os.PathLike) -> KimiLinearConfig:
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise NotACheckpointError(f"{path}: not a checkpoint directory")
    cfg = os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        raise NotACheckpointError(f"{path}: not a checkpoint (no config.json)")
    return KimiLinearConfig.from_json_file(cfg)


def _open_files(path: str) -> dict[str, SafetensorsFile]:
    """tensor name -> the file holding it (single file or sharded index)."""
    index = os.path.join(path, INDEX)
    single = os.path.join(path, SINGLE)
    try:
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = {fn: SafetensorsFile(os.path.join(path, fn)) for fn in set(weight_map.values())}
            for name, fn in weight_map.items():
                if name not in files[fn]:
                    raise CorruptCheckpointError(f"{fn}: index lists {name} but the file lacks it")
            return {name: files[fn] for name, fn in weight_map.items()}
        if os.path.isfile(single):
            f = SafetensorsFile(single)
            return {name: f for name in f}
    except SafetensorsFormatError as e:
        raise CorruptCheckpointError(str(e)) from e
    except (json.JSONDecodeError, KeyError) as e:
        raise CorruptCheckpointError(f"{index}: unreadable index ({e!r})") from e
    except FileNotFoundError as e:
        raise CorruptCheckpointError(f"{path}: shard missing: {e.filename}") from e
    raise NotACheckpointError(f"{path}: not a checkpoint (no {SINGLE} or {INDEX})")


def _match(slots: list[_Slot], where: dict[str, SafetensorsFile]) -> dict[_Slot, tuple[str, ...]]:
    """Checkpoint names used for every slot; raises on missing, unexpected or misshapen ones."""
    used: dict[_Slot, tuple[str, ...]] = {}
    missing = []
    for s in slots:
        names = s.names
        if s.aliases and names[0] not in where and s.aliases[0] in where:
            names = s.aliases
        missing += [n for n in names if n not in where]
        used[s] = names
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise MissingTensorError(f"checkpoint is missing tensor(s) {missing[:5]}{more}")
    taken = {n for names in used.values() for n in names}
    # transformers writes zero-size shared experts when num_shared_experts = 0: nothing to load.
    extra = sorted(n for n in set(where) - taken if 0 not in where[n].shape(n))
    if extra:
        raise UnexpectedTensorError(f"checkpoint has unexpected tensor(s) {extra[:5]}")
    for s, names in used.items():
        for n in names:
            got = where[n].shape(n)
            if got != s.shape:
                raise ShapeMismatchError(f"{n}: expected shape {s.shape}, got {got}")
    return used


def _host_value(names: tuple[str, ...], where, index: tuple = ()) -> np.ndarray:
    """The block `index` of the parameter filled by `names`, read from the memory maps (only
    the bytes of that block for a plain tensor; only the experts in it for stacked ones)."""
    try:
        if len(names) == 1:
            return np.asarray(where[names[0]][names[0]][index])
        # Stacked experts: one host buffer for the experts of this block, filled one by one.
        experts = range(len(names))[index[0] if index else slice(None)]
        rest = tuple(index[1:])
        first = where[names[0]][names[0]][rest]
        buf = np.empty((len(experts), *first.shape), first.dtype)
        for i, e in enumerate(experts):
            buf[i] = where[names[e]][names[e]][rest]
        return buf
    except SafetensorsFormatError as e:
        raise CorruptCheckpointError(str(e)) from e


def _load_value(names: tuple[str, ...], where, var, par, rules) -> jax.Array:
    """One parameter: whole on the default device, or straight onto its shards (each device
    reads its block from the memory maps; the whole tensor is never on one device)."""
    dtype = var.dtype
    if not par.sharded:
        return jnp.asarray(_host_value(names, where), dtype)
    sharding = NamedSharding(par.mesh, var_spec(var, rules))

    def block(index):
        return np.asarray(_host_value(names, where, index)).astype(dtype)

    return jax.make_array_from_callback(tuple(var.shape), sharding, block)


def load_pretrained(
    path: str | os.PathLike, dtype="bfloat16", *, parallel: Parallel = ONE_DEVICE
) -> KimiLinearForCausalLM:
    """Load a Kimi Linear checkpoint in the HF layout, tensor by tensor.

    Weights are cast to `dtype` ("bfloat16", "float32", or "auto": the checkpoint's torch_dtype,
    see `auto_dtype`); parameters the model keeps in fp32
    whatever its dtype (A_log, dt_bias, the router's correction bias) stay fp32. `parallel`
    (`parallel.mesh.make_parallel(read_config(path), tp, dcp)`) builds the model for its mesh
    and puts every tensor straight onto its shards by the sharding rules.
    """
    path = os.fspath(path)
    config = read_config(path)
    dt = resolve_dtype(auto_dtype(path) if dtype == "auto" else dtype)
    if parallel.sharded:
        validate(config, parallel.tp, parallel.dcp, combine=parallel.combine)
    abstract = nnx.eval_shape(lambda: KimiLinearForCausalLM(config, dtype=dt, par=parallel))
    graphdef, state = nnx.split(abstract)
    where = _open_files(path)
    used = _match(_slots(nnx.state(abstract, nnx.Param)), where)
    flat = dict(nnx.to_flat_state(state))
    rules = ShardingRules.for_parallel(parallel)
    for slot, names in used.items():
        var = flat[slot.path]
        flat[slot.path] = var.replace(_load_value(names, where, var, parallel, rules))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


# The built-in models, installed with the package: `pycode` (about 14M parameters) and its
# draft `pycode-draft`, trained by `kimi-linear-jax train` on the Python standard library
# (README "The built-in model"). Stored in bfloat16 to keep the wheel small; "auto" runs them
# in float32.
BUILTIN_DIR = os.path.join(os.path.dirname(__file__), "builtin")
BUILTIN_MODEL = os.path.join(BUILTIN_DIR, "pycode")
BUILTIN_DRAFT = os.path.join(BUILTIN_DIR, "pycode-draft")


def model_config(path: str | os.PathLike | None) -> KimiLinearConfig:
    """The config of a checkpoint dir, or of the built-in default model (`path=None`), read
    without loading weights (to check a parallel plan before the load)."""
    return read_config(BUILTIN_MODEL if path is None else path)


def load_model_and_tokenizer(
    path: str | os.PathLike | None, dtype="auto", *, parallel: Parallel = ONE_DEVICE
):
    """(model, tokenizer or None) from a checkpoint dir, or for `path=None` the built-in
    default model with its BPE tokenizer. `parallel`: the plan to build the model for (see
    `load_pretrained`)."""
    from kimi_linear_jax.tokenizer import load_tokenizer

    if dtype == "auto":
        dtype = auto_dtype(path)
    path = BUILTIN_MODEL if path is None else path
    model = load_pretrained(path, dtype=dtype, parallel=parallel)
    return model, load_tokenizer(path, model.config.vocab_size)


# ---- writing -----------------------------------------------------------------------------------
def _tensors(model: KimiLinearForCausalLM):
    """(name, numpy array) pairs in checkpoint layout, one tensor at a time."""
    for slot in _slots(nnx.state(model, nnx.Param)):
        value = np.asarray(_get(model, slot.path))
        if len(slot.names) == 1:
            yield slot.names[0], value
        else:
            yield from zip(slot.names, value)


def _get(model, path):
    obj = model
    for p in path:
        obj = obj[p] if isinstance(p, int) else getattr(obj, p)
    return obj[...]


def save_pretrained(
    model: KimiLinearForCausalLM, path: str | os.PathLike, *, max_shard_bytes: int | None = None
) -> None:
    """Write config.json and the weights in the release's layout; shards (with an index) when
    `max_shard_bytes` is set and the weights exceed it."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    hf = model.config.to_hf_config()
    hf["torch_dtype"] = str(jnp.dtype(model.dtype))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    tensors = dict(_tensors(model))
    total = sum(a.nbytes for a in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        write_safetensors(os.path.join(path, SINGLE), tensors)
        return
    shards, current, size = [], {}, 0
    for name in sorted(tensors):
        if current and size + tensors[name].nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensors[name]
        size += tensors[name].nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(os.path.join(path, fn), shard)
        weight_map.update(dict.fromkeys(shard, fn))
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


# ---- Orbax ---------------------------------------------------------------------------------------
def save_orbax(model: KimiLinearForCausalLM, path: str | os.PathLike) -> None:
    """Converted parameters as an Orbax checkpoint (fast reloads), config.json beside them."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model.config.to_hf_config(), f, indent=2)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.join(path, "params"), nnx.state(model, nnx.Param), force=True)


def load_orbax(path: str | os.PathLike, dtype="bfloat16") -> KimiLinearForCausalLM:
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    config = read_config(path)
    abstract = nnx.eval_shape(lambda: KimiLinearForCausalLM(config, dtype=resolve_dtype(dtype)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    with ocp.StandardCheckpointer() as ckpt:
        params = ckpt.restore(os.path.join(path, "params"), params)
    return nnx.merge(graphdef, params, rest)
