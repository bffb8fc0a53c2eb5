"""The training loop: the loss falls, accumulation, data parallelism and tensor parallelism
are the same step, a resumed run is the straight run (also at tp 2), and the export loads in
transformers with equal logits."""

from __future__ import annotations

import dataclasses
import json
import sysconfig
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from kimi_linear_jax import corpus, load_pretrained
from kimi_linear_jax.model import forward
from kimi_linear_jax.presets import preset
from kimi_linear_jax.testing import random_model
from kimi_linear_jax.train import (
    TrainConfig,
    Trainer,
    export,
    model_config_for,
    prepare_data,
    train,
)
from kimi_linear_jax.train_command import train_config
from kimi_linear_jax.trainer import distill_kl
from serving.cli import build_parser
from serving.cli import main as cli_main

STDLIB = Path(sysconfig.get_paths()["stdlib"])
TC = TrainConfig(
    seq_len=32,
    batch_size=8,
    learning_rate=3e-3,
    warmup_steps=2,
    max_steps=6,
    eval_every=3,
    eval_batches=2,
    save_every=100,
)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> str:
    """One text file of real Python (a few stdlib modules): held out by its last 2%."""
    text = "".join((STDLIB / name).read_text() for name in ("bisect.py", "heapq.py", "abc.py"))
    path = tmp_path_factory.mktemp("data") / "code.py"
    path.write_text(text)
    return str(path)


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "train_log.jsonl").read_text().splitlines()]


def _run(out, data, **kwargs):
    return train(
        preset("tiny"), kwargs.pop("tc", TC), data, out, vocab_size=300, progress=False, **kwargs
    )


# A 10-step run (high learning rate) whose last step is also a periodic save step.
TRAINED_TC = dataclasses.replace(TC, max_steps=10, eval_every=10, save_every=5, learning_rate=1e-2)


@pytest.fixture(scope="module")
def trained(data_file, tmp_path_factory):
    """One run, data parallel over the 8 devices, shared by the tests that read what a finished
    run leaves behind; it is also the straight run the resume test must reproduce."""
    out = tmp_path_factory.mktemp("trained")
    return out, _run(out, data_file, tc=TRAINED_TC)


def test_loss_falls_and_held_out_is_measured(trained):
    out, record = trained
    losses = _losses(out)
    assert len(losses) == 10
    assert np.mean(losses[-2:]) < losses[0] - 0.3, losses
    assert 0 < record["eval_bpb"] < 8 and record["eval_loss"] > 0
    split = json.loads((out / "data.json").read_text())
    assert split["held_out"] == ["code.py#held-out"]


def test_a_run_ending_on_a_save_step_saves_and_exports(trained):
    """The last step is also a periodic save step: the final save must not fail on it."""
    out, _ = trained
    assert (out / "model.safetensors").is_file()
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir()) == [5, 10]


def test_resume_continues_the_straight_run_exactly(trained, data_file, tmp_path):
    """Half the run, then `resume`: the losses and the final weights are the straight run's
    (the state data parallel over 8 devices: params, optimizer state, step, data position)."""
    straight, _ = trained
    _run(tmp_path, data_file, tc=TRAINED_TC, run_steps=5)
    assert len(_losses(tmp_path)) == 5
    _run(tmp_path, data_file, tc=TRAINED_TC, resume=True)
    assert _losses(tmp_path) == _losses(straight)
    a, b = load_pretrained(straight, dtype="float32"), load_pretrained(tmp_path, dtype="float32")
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _two_steps(data_file, tmp_path, tc, devices=None):
    """Two steps from the same start: the first one's learning rate is 0 (warmup), so only
    the second moves the parameters (through the optimizer state the first one wrote).
    Returns (trainer, state, the two losses)."""
    prepared, tok = prepare_data(data_file, tmp_path, tc, vocab_size=300)
    trainer = Trainer(model_config_for(preset("tiny"), tok), tc, devices=devices)
    state, losses = trainer.init_state(), []
    for i in range(2):
        batch = prepared.train.take(
            i * tc.batch_size * tc.grad_accum, tc.batch_size * tc.grad_accum
        )
        state, metrics = trainer.step(state, batch.reshape(tc.grad_accum, tc.batch_size, -1))
        losses.append(float(metrics["loss"]))
    return trainer, state, losses


def _params(state) -> list[np.ndarray]:
    return jax.tree.leaves(jax.device_get(state["params"]))


def _assert_same_step(got, want):
    (got_losses, got_params), (want_losses, want_params) = got, want
    np.testing.assert_allclose(got_losses, want_losses, rtol=0, atol=1e-5)
    for x, y in zip(got_params, want_params, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def one_device(data_file, tmp_path_factory):
    """(losses, updated parameters) of two steps on one device: what every split must give."""
    _, state, losses = _two_steps(data_file, tmp_path_factory.mktemp("one"), TC, jax.devices()[:1])
    return losses, _params(state)


@pytest.mark.heavy  # 39 s
def test_accumulation_and_data_parallel_are_the_same_step(data_file, tmp_path, one_device):
    """8 sequences as one batch on one device, as 2 x 4 accumulated, and split over 8
    devices: the same loss and the same updated parameters (up to summation order)."""
    accum = dataclasses.replace(TC, batch_size=4, grad_accum=2)
    for tc, devices in ((accum, jax.devices()[:1]), (TC, jax.devices()[:8])):
        _, state, losses = _two_steps(data_file, tmp_path, tc, devices)
        _assert_same_step((losses, _params(state)), one_device)


# Slow: the TP-sharded gradient is checked in the default run by tests/parallel.
@pytest.mark.parametrize("tp", [pytest.param(t, marks=pytest.mark.slow) for t in (2, 4)])
def test_tensor_parallel_is_the_same_step(data_file, tmp_path, one_device, tp):
    """The model's TP plan over tp devices: the same losses and updated parameters as one
    device; parameters and optimizer moments stay on their shards, and the export gathers
    them whole."""
    tc = dataclasses.replace(TC, tensor_parallel_size=tp)
    trainer, state, losses = _two_steps(data_file, tmp_path, tc)
    _assert_same_step((losses, _params(state)), one_device)
    assert trainer.mesh.devices.size == tp
    tp_axes = P(("model", "dcp"), None)
    lm_head = state["params"]["lm_head"]["weight"]  # [vocab, hidden], vocab over the TP group
    assert lm_head.sharding.spec == tp_axes and lm_head.sharding.mesh == trainer.mesh
    moments = [s for s in jax.tree.leaves(state["opt_state"]) if s.shape == lm_head.shape]
    assert moments and all(m.sharding.spec == tp_axes for m in moments)
    if tp == 2:
        export(trainer, state, tmp_path / "export")
        model = load_pretrained(tmp_path / "export", dtype="float32")
        loaded = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        for x, y in zip(jax.tree.leaves(loaded), _params(state), strict=True):
            np.testing.assert_array_equal(np.asarray(x), y)


@pytest.mark.slow  # 40 s; the one-device resume and the tp 2 step run by default
def test_resume_at_tensor_parallel_2_is_exact(data_file, tmp_path):
    """The sharded train state saves and restores onto its shards: 2 + 2 steps equal 4."""
    tc = dataclasses.replace(TC, max_steps=4, eval_every=100, tensor_parallel_size=2)
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    _run(straight, data_file, tc=tc)
    _run(halves, data_file, tc=tc, run_steps=2)
    _run(halves, data_file, tc=tc, resume=True)
    assert len(_losses(straight)) == 4
    assert _losses(halves) == _losses(straight)
    a, b = load_pretrained(straight, dtype="float32"), load_pretrained(halves, dtype="float32")
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_bad_tensor_parallel_plans_fail_clearly(data_file, tmp_path):
    bad = dataclasses.replace(TC, tensor_parallel_size=3)  # tiny has 4 heads
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide the MLA heads"):
        Trainer(preset("tiny"), bad)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide the MLA heads"):
        _run(tmp_path, data_file, tc=bad)
    assert not (tmp_path / "tokenizer.json").exists()  # failed before training a tokenizer
    tp2 = dataclasses.replace(TC, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="exactly 2 devices .no data parallelism"):
        Trainer(preset("tiny"), tp2, devices=jax.devices()[:8])


def test_distill_kl_is_the_kl_divergence():
    rng = np.random.default_rng(0)
    s, t = rng.standard_normal((2, 3, 7)), rng.standard_normal((2, 3, 7))

    def softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    p, q = softmax(t), softmax(s)
    want = np.sum(p * (np.log(p) - np.log(q)), axis=-1)
    np.testing.assert_allclose(distill_kl(jnp.asarray(s), jnp.asarray(t)), want, rtol=1e-5)
    np.testing.assert_allclose(distill_kl(jnp.asarray(t), jnp.asarray(t)), 0, atol=1e-6)
    grad_t = jax.grad(lambda t: distill_kl(jnp.asarray(s), t).sum())(jnp.asarray(t))
    np.testing.assert_array_equal(grad_t, 0)  # the teacher is a constant


@pytest.mark.heavy  # 40 s
def test_distillation_loss_is_the_kl_to_the_teacher_and_falls(data_file, tmp_path):
    """With a teacher the step's loss is the mean KL of the student's next-token distributions
    to the teacher's (checked against both models run outside the step), and training on it
    pulls the student towards the teacher."""
    tc = dataclasses.replace(TC, learning_rate=1e-2)
    prepared, tok = prepare_data(data_file, tmp_path, tc, vocab_size=300)
    config = model_config_for(preset("tiny"), tok)
    teacher = random_model(config, seed=3)
    trainer = Trainer(config, tc, devices=jax.devices()[:1], teacher=teacher)
    state, losses = trainer.init_state(), []
    first = prepared.train.take(0, tc.batch_size)
    x = jnp.asarray(first[:, :-1])
    want = float(jnp.mean(distill_kl(trainer.model(state)(x), teacher(x))))
    for i in range(8):
        batch = prepared.train.take(i * tc.batch_size, tc.batch_size)
        state, metrics = trainer.step(state, batch.reshape(1, tc.batch_size, -1))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses[0], want, rtol=1e-4)
    after = float(jnp.mean(distill_kl(trainer.model(state)(x), teacher(x))))
    assert after < 0.7 * want and np.mean(losses[-2:]) < 0.7 * losses[0], (want, after, losses)


def test_distillation_needs_the_same_vocabulary_and_one_device_plan():
    teacher = random_model(preset("tiny", vocab_size=256))
    with pytest.raises(ValueError, match=r"teacher's vocabulary \(256 ids\) differs"):
        Trainer(preset("tiny"), TC, teacher=teacher)
    tp2 = dataclasses.replace(TC, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="distillation trains with tensor_parallel_size 1"):
        Trainer(preset("tiny"), tp2, teacher=random_model(preset("tiny")))


@pytest.mark.heavy  # 26 s
def test_a_new_run_can_start_from_a_models_weights(data_file, tmp_path):
    """`init`: the run starts from the given weights. Its first step has learning rate 0
    (warmup), so a one-step run exports them unchanged; other shapes are refused."""
    _, tok = prepare_data(data_file, tmp_path / "tok", TC, vocab_size=300)
    start = random_model(model_config_for(preset("tiny"), tok), seed=4)
    tc = dataclasses.replace(TC, max_steps=1)
    _run(tmp_path / "run", data_file, tc=tc, init=start, devices=jax.devices()[:1])
    got = load_pretrained(tmp_path / "run", dtype="float32")
    want = nnx.to_pure_dict(nnx.state(start, nnx.Param))
    got = nnx.to_pure_dict(nnx.state(got, nnx.Param))
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    wide = random_model(model_config_for(preset("tiny", hidden_size=32), tok))
    with pytest.raises(ValueError, match="other parameter shapes than the one trained"):
        _run(tmp_path / "bad", data_file, init=wide)


def test_cli_tensor_parallel_flag():
    base = ["train", "--data", "x", "--preset", "tiny", "--out", "o"]
    assert train_config(build_parser().parse_args(base)).tensor_parallel_size == 1
    args = build_parser().parse_args([*base, "-tp", "2"])
    assert train_config(args).tensor_parallel_size == 2


def test_batch_size_must_split_over_devices():
    with pytest.raises(ValueError, match="not divisible by the 8 devices"):
        Trainer(preset("tiny"), dataclasses.replace(TC, batch_size=4), devices=jax.devices()[:8])


def test_batches_are_a_function_of_the_sample_index():
    stream = np.arange(1000, dtype=np.int32)
    a, b = corpus.Batches(stream, 9, seed=3), corpus.Batches(stream, 9, seed=3)
    first = a.take(0, 200)  # crosses an epoch (111 sequences)
    np.testing.assert_array_equal(b.take(150, 50), first[150:])
    assert sorted(first[:111, 0].tolist()) == list(range(0, 999, 9))  # each sequence once
    np.testing.assert_array_equal(first[:, 1:], first[:, :-1] + 1)  # contiguous windows
    windows = corpus.eval_sequences(stream, 9)
    np.testing.assert_array_equal(windows[:, 1:].ravel(), stream[1 : 1 + 9 * len(windows)])


def test_split_is_by_file_name_and_skips_tests(tmp_path):
    for i in range(300):
        (tmp_path / f"m{i}.py").write_text(f"x = {i}\n")
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "t.py").write_text("skipped\n")
    (tmp_path / "bin.py").write_bytes(b"\xff\xfe")
    docs = corpus.documents(tmp_path)
    assert len(docs) == 300 and "test/t.py" not in docs and "bin.py" not in docs
    train_docs, held = corpus.split(docs)
    assert 0 < len(held) < 20 and set(train_docs).isdisjoint(held)
    assert sorted(held) == sorted(n for n in docs if corpus.is_held_out(n))
    with pytest.raises(FileNotFoundError, match="neither a file nor a directory"):
        corpus.documents(tmp_path / "missing")


def test_export_loads_in_transformers_with_equal_logits(trained):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    out, _ = trained
    ours = load_pretrained(out, dtype="float32")
    ref = transformers.KimiLinearForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = np.random.default_rng(0).integers(0, ours.config.vocab_size, (2, 40))
    with torch.no_grad():
        expected = ref.eval()(torch.as_tensor(ids)).logits.numpy()
    graphdef, params = nnx.split(ours)
    got = np.asarray(forward(graphdef, params, jnp.asarray(ids, jnp.int32)))
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.heavy  # 32 s; exact resume stays in the default run
def test_cli_train_then_resume(data_file, tmp_path, capsys):
    args = [
        "train",
        "--data",
        data_file,
        "--preset",
        "tiny",
        "--out",
        str(tmp_path),
        "--vocab-size",
        "300",
        "--seq-len",
        "32",
        "--batch-size",
        "8",
        "--max-steps",
        "4",
        "--eval-every",
        "2",
        "--eval-batches",
        "1",
        "--no-progress",
    ]
    assert cli_main([*args, "--run-steps", "2"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["step"] == 2
    assert cli_main(args) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert cli_main([*args, "--resume"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["step"] == 4
    assert (tmp_path / "tokenizer.json").is_file() and (tmp_path / "model.safetensors").is_file()
