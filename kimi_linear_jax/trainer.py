"""The trainer: next-token cross-entropy with AdamW (optax), a jitted step over a donated
train state, gradient accumulation, data or tensor parallelism, held-out evaluation. The run
around it (data, checkpoints, export, log, loop) is `train.py`.

Distillation: given a teacher (a model of the same vocabulary), the loss is instead the
teacher-to-student KL divergence of the next-token distributions at every position
(`distill_kl`), the teacher run forward inside the same jitted step. A draft model trained so
learns the target's choices rather than the data's: what speculative decoding accepts. The
held-out evaluation still measures the data's cross-entropy.

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
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kimi_linear_jax.config import KimiLinearConfig
from kimi_linear_jax.model import KimiLinearForCausalLM, init_model
from kimi_linear_jax.parallel import rules
from kimi_linear_jax.parallel.mesh import SINGLE, Parallel, make_parallel


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


def split_params(model: KimiLinearForCausalLM):
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, nnx.to_pure_dict(params)


def merge_params(graphdef, abstract, params):
    state = jax.tree.map(lambda x: x, abstract)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def token_nll(model: KimiLinearForCausalLM, tokens: jax.Array) -> jax.Array:
    """Per-token negative log-likelihood [B, T] of tokens[:, 1:] given the prefix."""
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def distill_kl(student_logits: jax.Array, teacher_logits: jax.Array) -> jax.Array:
    """KL(teacher || student) per position [..., V] -> [...], in float32; no gradient flows
    into the teacher."""
    t = jax.nn.log_softmax(jax.lax.stop_gradient(teacher_logits).astype(jnp.float32), axis=-1)
    s = jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.exp(t) * (t - s), axis=-1)


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


def _shapes_of(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _check_teacher(teacher, config: KimiLinearConfig, tp: int) -> None:
    if tp > 1:
        raise ValueError("distillation trains with tensor_parallel_size 1 (teacher replicated)")
    if teacher.config.vocab_size != config.vocab_size:
        raise ValueError(
            f"the teacher's vocabulary ({teacher.config.vocab_size} ids) differs from the "
            f"student's ({config.vocab_size}): distillation compares distributions over ids"
        )


class Trainer:
    """Builds the jitted train / eval steps for one model shape, optimizer and device plan:
    data parallel over `devices` (tensor_parallel_size 1), or the model's TP plan."""

    def __init__(
        self, config: KimiLinearConfig, tc: TrainConfig, devices=None, teacher=None
    ) -> None:
        self.config, self.tc = config, tc
        tp = tc.tensor_parallel_size
        if teacher is not None:
            _check_teacher(teacher, config, tp)
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
            in_shardings=(self.state_shardings, self.batch_sharding, self.replicated),
            out_shardings=(self.state_shardings, self.replicated),
        )
        self._eval = jax.jit(self._eval_sum)
        # The teacher's parameters go in as an argument (replicated, never donated); its
        # graph is static.
        self.teacher_graph, self.teacher_params = None, None
        if teacher is not None:
            graph, state = nnx.split(teacher, nnx.Param)
            self.teacher_graph = (graph, _shapes_of(state))
            self.teacher_params = jax.device_put(nnx.to_pure_dict(state), self.replicated)

    # ---- state ------------------------------------------------------------------------------
    def _init(self) -> dict:
        # Built unsharded: the parameters do not depend on the plan, and under jit with
        # sharded outputs each device computes only its shards.
        model = init_model(self.config, seed=self.tc.seed, dtype=jnp.float32)
        _, params = split_params(model)
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
        return merge_params(self.graphdef, self.abstract, state["params"])

    # ---- steps ------------------------------------------------------------------------------
    def _loss(self, params, tokens, teacher_params):
        model = merge_params(self.graphdef, self.abstract, params)
        if teacher_params is None:
            return jnp.mean(token_nll(model, tokens))
        teacher = merge_params(*self.teacher_graph, teacher_params)
        return jnp.mean(distill_kl(model(tokens[:, :-1]), teacher(tokens[:, :-1])))

    def _train_step(self, state, batch, teacher_params):
        """batch [accum, B, T+1]: gradients averaged over the micro-batches by a scan (one
        micro-batch's activations alive at a time), then one optimizer update."""
        grad_fn = jax.value_and_grad(self._loss)

        def micro(acc, tokens):
            loss, grads = grad_fn(state["params"], tokens, teacher_params)
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
        nll = token_nll(merge_params(self.graphdef, self.abstract, params), tokens)
        return jnp.sum(nll), jnp.sum(nbytes[tokens[:, 1:]])

    def step(self, state: dict, batch: np.ndarray) -> tuple[dict, dict]:
        batch = jax.device_put(batch, self.batch_sharding)
        return self._step(state, batch, self.teacher_params)

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
