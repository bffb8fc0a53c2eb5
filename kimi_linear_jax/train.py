"""Training: next-token cross-entropy with AdamW (optax), a jitted step over a donated train
state, gradient accumulation, data parallelism over the local devices, Orbax checkpoints that
resume exactly, held-out evaluation, a JSONL log and a tqdm bar.

Devices: tensor_parallel_size 1 splits the batch over the local devices (a 1-D mesh ("data",),
parameters replicated). tensor_parallel_size tp > 1 builds the model for its own TP plan
(`parallel.mesh.make_parallel(config, tp, 1)`): parameters and optimizer state sharded by the
model's rules, the forward its shard_map, the batch replicated over the tp devices. The model's
mesh ("model", "dcp") has no data axis, so tp > 1 trains on exactly tp devices, with no data
parallelism beside it.

The train state is one pytree: {"params", "opt_state", "step", "samples"}. `samples` counts
the sequences consumed, and `corpus.Batches` makes sample i a pure function of i, so the state
is the whole data position: a resumed run draws the batches the straight run would have.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kimi_linear_jax import bpe, corpus
from kimi_linear_jax.checkpoint import save_pretrained
from kimi_linear_jax.config import KimiLinearConfig
from kimi_linear_jax.model import KimiLinearForCausalLM, init_model
from kimi_linear_jax.parallel import rules
from kimi_linear_jax.parallel.mesh import SINGLE, Parallel, make_parallel
from kimi_linear_jax.parallel.mesh import validate as validate_parallel


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    seq_len: int = 256
    batch_size: int = 8  # sequences per micro-batch (all devices together)
    grad_accum: int = 1
    learning_rate: float = 2e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # the cosine decays to learning_rate x this at max_steps
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_steps: int = 1000
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 8
    save_every: int = 100
    time_budget: float | None = None  # seconds; stops early (and saves) when spent
    tensor_parallel_size: int = 1  # > 1: the model's TP plan over that many devices, no DP

    def validate(self, num_devices: int) -> None:
        """`num_devices`: the devices the batch is split over (1 under tensor parallelism)."""
        for name in (
            "seq_len",
            "batch_size",
            "grad_accum",
            "max_steps",
            "eval_every",
            "tensor_parallel_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_size % num_devices:
            raise ValueError(
                f"batch_size {self.batch_size} is not divisible by the {num_devices} devices "
                "it is split over (data parallel)"
            )
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")


def optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """AdamW with warmup + cosine decay and global-norm clipping; no decay on vectors (norms,
    biases, decay rates), as is usual."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        tc.learning_rate,
        min(tc.warmup_steps, tc.max_steps),
        max(tc.max_steps, tc.warmup_steps + 1),
        end_value=tc.learning_rate * tc.min_lr_ratio,
    )
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(tc.grad_clip),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=tc.weight_decay, mask=decay_mask),
    )


def _split(model: KimiLinearForCausalLM):
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, nnx.to_pure_dict(params)


def _merge(graphdef, abstract, params):
    state = jax.tree.map(lambda x: x, abstract)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def token_nll(model: KimiLinearForCausalLM, tokens: jax.Array) -> jax.Array:
    """Per-token negative log-likelihood [B, T] of tokens[:, 1:] given the prefix."""
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def tensor_parallel_plan(config: KimiLinearConfig, tp: int, devices=None) -> Parallel:
    """The model's TP plan over exactly `tp` devices (the first `tp` local ones by default).
    Its mesh has no data axis and its shard_map takes the batch replicated, so more devices
    than tp would sit idle: asking for them is an error rather than a silent half-used run."""
    if devices is None:
        devices = jax.local_devices()[:tp]
    elif len(devices) != tp:
        raise ValueError(
            f"tensor_parallel_size {tp} trains on exactly {tp} devices (no data parallelism "
            f"beside it: the model's mesh has no data axis), got {len(devices)} devices"
        )
    return make_parallel(config, tp, 1, devices=devices)


class Trainer:
    """Builds the jitted train / eval steps for one model shape, optimizer and device plan:
    data parallel over `devices` (tensor_parallel_size 1), or the model's TP plan."""

    def __init__(self, config: KimiLinearConfig, tc: TrainConfig, devices=None) -> None:
        self.config, self.tc = config, tc
        tp = tc.tensor_parallel_size
        if tp > 1:
            self.par = tensor_parallel_plan(config, tp, devices)
            tc.validate(1)
            self.mesh = self.par.mesh
            batch_spec = eval_spec = P()  # every TP rank sees the whole batch
        else:
            self.par = SINGLE
            devices = list(devices if devices is not None else jax.local_devices())
            tc.validate(len(devices))
            self.mesh = Mesh(np.asarray(devices), ("data",))
            batch_spec, eval_spec = P(None, "data", None), P("data", None)  # [accum, B, T+1]
        self.replicated = NamedSharding(self.mesh, P())
        self.batch_sharding = NamedSharding(self.mesh, batch_spec)
        self.eval_sharding = NamedSharding(self.mesh, eval_spec)
        model = nnx.eval_shape(lambda: init_model(config, seed=tc.seed, par=self.par))
        self.graphdef, abstract = nnx.split(model, nnx.Param)
        self.abstract = abstract
        self.tx = optimizer(tc)
        self._shapes = jax.eval_shape(self._init)  # traced once: a large model's init is slow
        self.state_shardings = self._state_shardings(self._shapes)
        # Shardings pinned in and out: the donated state keeps its layout step after step, and
        # a state laid out otherwise (a bad restore) fails loudly instead of being resharded.
        self._step = jax.jit(
            self._train_step,
            donate_argnums=0,
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, self.replicated),
        )
        self._eval = jax.jit(self._eval_sum)

    # ---- state ------------------------------------------------------------------------------
    def _init(self) -> dict:
        # Built unsharded: the parameters do not depend on the plan, and under jit with
        # sharded outputs each device computes only its shards.
        model = init_model(self.config, seed=self.tc.seed, dtype=jnp.float32)
        _, params = _split(model)
        return {
            "params": params,
            "opt_state": self.tx.init(params),
            "step": jnp.zeros((), jnp.int32),
            "samples": jnp.zeros((), jnp.int64 if jax.config.x64_enabled else jnp.int32),
        }

    def _state_shardings(self, abstract_state: dict) -> dict:
        """Replicated on the data mesh; under TP each parameter by the model's rules, and each
        optimizer moment like its parameter (the optimizer's scalars replicated)."""
        if not self.par.sharded:
            return jax.tree.map(lambda _: self.replicated, abstract_state)
        specs = rules.param_specs(self.abstract, rules.ShardingRules.for_parallel(self.par))
        params = rules.shardings(nnx.to_pure_dict(specs), self.mesh)
        opt_state = optax.tree_map_params(
            self.tx,
            lambda _, sharding: sharding,
            abstract_state["opt_state"],
            params,
            transform_non_params=lambda _: self.replicated,
        )
        rep = self.replicated
        return {"params": params, "opt_state": opt_state, "step": rep, "samples": rep}

    def init_state(self) -> dict:
        """A fresh train state, created on its shards (never whole on one device)."""
        return jax.jit(self._init, out_shardings=self.state_shardings)()

    def abstract_state(self) -> dict:
        """Shapes, dtypes and shardings of the train state: what a restore fills in."""
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            self._shapes,
            self.state_shardings,
        )

    def model(self, state: dict) -> KimiLinearForCausalLM:
        return _merge(self.graphdef, self.abstract, state["params"])

    # ---- steps ------------------------------------------------------------------------------
    def _loss(self, params, tokens):
        return jnp.mean(token_nll(_merge(self.graphdef, self.abstract, params), tokens))

    def _train_step(self, state, batch):
        """batch [accum, B, T+1]: gradients averaged over the micro-batches by a scan (one
        micro-batch's activations alive at a time), then one optimizer update."""
        grad_fn = jax.value_and_grad(self._loss)

        def micro(acc, tokens):
            loss, grads = grad_fn(state["params"], tokens)
            return jax.tree.map(jnp.add, acc, (loss, grads)), None

        zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, state["params"]))
        (loss, grads), _ = jax.lax.scan(micro, zero, batch)
        n = batch.shape[0]
        loss, grads = loss / n, jax.tree.map(lambda g: g / n, grads)
        updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
        new = {
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state,
            "step": state["step"] + 1,
            "samples": state["samples"] + batch.shape[0] * batch.shape[1],
        }
        return new, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    def _eval_sum(self, params, tokens, nbytes):
        nll = token_nll(_merge(self.graphdef, self.abstract, params), tokens)
        return jnp.sum(nll), jnp.sum(nbytes[tokens[:, 1:]])

    def step(self, state: dict, batch: np.ndarray) -> tuple[dict, dict]:
        batch = jax.device_put(batch, self.batch_sharding)
        return self._step(state, batch)

    def evaluate(self, state: dict, sequences: np.ndarray, nbytes: np.ndarray) -> dict:
        """Held-out loss (nats per token) and bits per byte over `sequences`."""
        total_nll, total_bytes, count = 0.0, 0, 0
        b = self.tc.batch_size
        table = jnp.asarray(nbytes)
        for i in range(0, len(sequences) - b + 1, b):
            chunk = jax.device_put(sequences[i : i + b], self.eval_sharding)
            nll, nb = self._eval(state["params"], chunk, table)
            total_nll, total_bytes = total_nll + float(nll), total_bytes + int(nb)
            count += chunk.shape[0] * (chunk.shape[1] - 1)
        if count == 0:
            return {}
        return {
            "eval_loss": total_nll / count,
            "eval_bpb": total_nll / math.log(2) / max(total_bytes, 1),
        }


# ---- checkpoints ---------------------------------------------------------------------------
def _manager(path: Path):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    return ocp.CheckpointManager(path.absolute(), options=options)


def save_state(path: Path, state: dict) -> None:
    import orbax.checkpoint as ocp

    step = int(state["step"])
    with _manager(path) as mngr:
        if step in mngr.all_steps():  # saved already (the last step was a save step)
            return
        mngr.save(step, args=ocp.args.StandardSave(state), force=True)
        mngr.wait_until_finished()


def restore_state(path: Path, like: dict) -> dict | None:
    """The latest train state under `path`, laid out like `like` (arrays or
    `Trainer.abstract_state()`: each array restored onto its shards); None when there is none."""
    import orbax.checkpoint as ocp

    with _manager(path) as mngr:
        step = mngr.latest_step()
        if step is None:
            return None
        return mngr.restore(step, args=ocp.args.StandardRestore(like))


def export(trainer: Trainer, state: dict, path: Path, dtype=jnp.float32) -> None:
    """The trained weights in the Hugging Face layout (`save_pretrained`), cast to `dtype`
    where the model stores that dtype (tensors it keeps in fp32 stay fp32). Sharded
    parameters are gathered whole to the host first, into a one-device model."""
    target = nnx.eval_shape(lambda: init_model(trainer.config, dtype=dtype))
    graphdef, abstract = nnx.split(target, nnx.Param)
    like = nnx.to_pure_dict(abstract)
    host = jax.device_get(state["params"])
    params = jax.tree.map(lambda p, a: np.asarray(p, a.dtype), host, like)
    save_pretrained(_merge(graphdef, abstract, params), path)


# ---- the run -------------------------------------------------------------------------------
@dataclasses.dataclass
class Data:
    train: corpus.Batches
    held_out: np.ndarray  # [N, T+1] evaluation windows
    token_bytes: np.ndarray
    held_out_names: list[str]


def prepare_data(data: str, out: Path, tc: TrainConfig, vocab_size: int, tokenizer=None):
    """Split the documents, train (or reuse `out`'s / the given) tokenizer on the training
    split, and tokenize both splits. Returns (Data, tokenizer)."""
    import tokenizers

    train_docs, held_docs = corpus.split(corpus.documents(data))
    if tokenizer is None and (out / "tokenizer.json").is_file():
        tokenizer = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    if tokenizer is None:
        tokenizer = bpe.train_bpe(train_docs.values(), vocab_size)
        bpe.save_tokenizer(tokenizer, out)
    eos = bpe.special_ids(tokenizer)["eos"]
    stream = corpus.token_stream(tokenizer, train_docs.values(), eos)
    held = corpus.token_stream(tokenizer, held_docs.values(), eos)
    windows = corpus.eval_sequences(held, tc.seq_len, tc.eval_batches * tc.batch_size)
    return (
        Data(
            train=corpus.Batches(stream, tc.seq_len, tc.seed),
            held_out=windows,
            token_bytes=bpe.token_bytes(tokenizer),
            held_out_names=sorted(held_docs),
        ),
        tokenizer,
    )


def model_config_for(config: KimiLinearConfig, tokenizer) -> KimiLinearConfig:
    """The preset with the tokenizer's vocabulary and special ids."""
    ids = bpe.special_ids(tokenizer)
    return dataclasses.replace(
        config,
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        pad_token_id=ids["pad"],
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
    )


class _Log:
    """Appends one JSON object per line (flushed, so a killed run keeps its log)."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "a")  # noqa: SIM115 (closed by `close`)

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def train(
    config: KimiLinearConfig,
    tc: TrainConfig,
    data: str,
    out: str | os.PathLike,
    *,
    vocab_size: int = 4096,
    resume: bool = False,
    run_steps: int | None = None,
    export_dtype=jnp.float32,
    progress: bool = True,
) -> dict:
    """Train from scratch (or `resume` from `out/checkpoints`) until `max_steps`, `run_steps`
    more steps or the time budget; then save the train state and export the model, tokenizer
    and `data.json` (the split) to `out`. Returns the last log record."""
    out = Path(out)
    ckpt_dir = out / "checkpoints"
    if not resume and ckpt_dir.exists() and any(ckpt_dir.iterdir()):
        raise FileExistsError(f"{ckpt_dir} holds a train state; pass --resume or a new --out")
    # A tp the model cannot take fails before the tokenizer is trained (minutes on a large
    # corpus). The vocabulary will be the tokenizer's: a stand-in of tp passes here, and the
    # Trainer checks the real one.
    tc.validate(1)
    tp = tc.tensor_parallel_size
    validate_parallel(dataclasses.replace(config, vocab_size=tp), tp, 1, len(jax.local_devices()))
    out.mkdir(parents=True, exist_ok=True)
    prepared, tokenizer = prepare_data(data, out, tc, vocab_size)
    config = model_config_for(config, tokenizer)
    trainer = Trainer(config, tc)
    if resume:
        state = restore_state(ckpt_dir, trainer.abstract_state())
        if state is None:
            raise FileNotFoundError(f"--resume: no train state under {ckpt_dir}")
    else:
        state = trainer.init_state()
    (out / "data.json").write_text(
        json.dumps(
            {
                "data": str(data),
                "seq_len": tc.seq_len,
                "seed": tc.seed,
                "held_out": prepared.held_out_names,
            },
            indent=2,
        )
    )
    record = _loop(trainer, state, prepared, out, ckpt_dir, run_steps, progress)
    state = record.pop("_state")
    save_state(ckpt_dir, state)
    export(trainer, state, out, export_dtype)
    return record


def _loop(trainer, state, data: Data, out, ckpt_dir, run_steps, progress) -> dict:
    from tqdm import tqdm

    tc = trainer.tc
    start = int(state["step"])
    end = tc.max_steps if run_steps is None else min(tc.max_steps, start + run_steps)
    per_step = tc.batch_size * tc.grad_accum
    log = _Log(out / "train_log.jsonl")
    bar = tqdm(total=end - start, disable=not progress, unit="step")
    t0, record = time.perf_counter(), {}
    samples = int(state["samples"])  # the step adds per_step on device too; no read per step
    try:
        for step in range(start, end):
            batch = data.train.take(samples, per_step).reshape(tc.grad_accum, tc.batch_size, -1)
            samples += per_step
            tick = time.perf_counter()
            state, metrics = trainer.step(state, batch)
            loss = float(metrics["loss"])  # waits for the step: honest tokens/s
            tok_s = per_step * tc.seq_len / (time.perf_counter() - tick)
            record = {
                "step": step + 1,
                "loss": loss,
                "grad_norm": float(metrics["grad_norm"]),
                "tokens_per_s": round(tok_s, 1),
                "elapsed_s": round(time.perf_counter() - t0, 2),
            }
            if (step + 1) % tc.eval_every == 0 or step + 1 == end:
                record.update(trainer.evaluate(state, data.held_out, data.token_bytes))
            if (step + 1) % tc.save_every == 0:
                save_state(ckpt_dir, state)
            log.write(record)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:.0f}")
            bar.update()
            if tc.time_budget is not None and time.perf_counter() - t0 > tc.time_budget:
                break
    finally:
        bar.close()
        log.close()
    return {**record, "_state": state}
