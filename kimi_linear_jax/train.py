"""Training runs: the data and tokenizer, Orbax checkpoints that resume exactly, the export to
the Hugging Face layout, a JSONL log, a tqdm bar, and the loop around `trainer.Trainer` (the
step, the optimizer and the devices; see there).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi_linear_jax import bpe, corpus
from kimi_linear_jax.checkpoint import save_pretrained
from kimi_linear_jax.config import KimiLinearConfig
from kimi_linear_jax.model import init_model
from kimi_linear_jax.parallel.mesh import validate as validate_parallel
from kimi_linear_jax.trainer import (  # noqa: F401  (re-exported: train's names before the split)
    TrainConfig,
    Trainer,
    merge_params,
    optimizer,
    split_params,
    tensor_parallel_plan,
    token_nll,
)


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
    save_pretrained(merge_params(graphdef, abstract, params), path)


def initial_params(trainer: Trainer, init) -> dict:
    """`init`'s parameters as the train state's (float32, on the state's shardings); its
    parameter shapes must be the trained model's (checked before any state is built)."""
    _, params = split_params(init)
    have = jax.tree.map(np.shape, params)
    want = jax.tree.map(np.shape, trainer.abstract_state()["params"])
    if have != want:
        raise ValueError(
            "the model to start from has other parameter shapes than the one trained: "
            f"{have} vs {want}"
        )
    params = jax.tree.map(lambda p: np.asarray(p, np.float32), params)
    return jax.device_put(params, trainer.state_shardings["params"])


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
    teacher=None,
    init=None,
    devices=None,
) -> dict:
    """Train from scratch (or `resume` from `out/checkpoints`) until `max_steps`, `run_steps`
    more steps or the time budget; then save the train state and export the model, tokenizer
    and `data.json` (the split) to `out`. Returns the last log record. `teacher`: a model of
    the tokenizer's vocabulary to distill from (`Trainer`), instead of the data's next token.
    `init`: a model of the same shapes whose parameters a new run starts from (fine-tuning),
    with a fresh optimizer and schedule. `devices`: where to train (data parallel over them at
    tensor_parallel_size 1); all local devices by default."""
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
    trainer = Trainer(config, tc, devices=devices, teacher=teacher)
    if resume:
        state = restore_state(ckpt_dir, trainer.abstract_state())
        if state is None:
            raise FileNotFoundError(f"--resume: no train state under {ckpt_dir}")
    else:
        params = None if init is None else initial_params(trainer, init)
        state = trainer.init_state()
        if params is not None:
            state["params"] = params
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
