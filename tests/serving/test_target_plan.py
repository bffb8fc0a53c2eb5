"""`kimi-linear-jax plan --target h200`: the activation compiled deviceless for an H200 (needs the
gpu-compile extra and the CUDA plugin; `make gpu-compile` runs these, marked `deviceless`)."""

from __future__ import annotations

import json

import pytest

from kimi_linear_jax.parallel.plan import plan_memory
from kimi_linear_jax.presets import preset
from serving import cli

pytestmark = pytest.mark.deviceless

GIB = 1 << 30


def plan_json(capsys, *argv):
    rc = cli.main(["plan", "--preset", "tiny", "--json", *argv])
    out = capsys.readouterr().out
    return rc, json.loads(out)


@pytest.mark.parametrize("tp", [1, 2])
def test_target_plan_compiles_the_activation_for_the_gpu(capsys, tp):
    args = ("--max-num-seqs", "8", "--max-model-len", "1024", "-tp", str(tp))
    rc, plan = plan_json(capsys, "--target", "h200", *args)
    assert rc == 0 and plan["fits"] is True
    assert plan["activation_method"] == "compiled deviceless for h200"
    # The H200's own memory (141 GiB, kernels/targets/h200.txtpb) when none is given.
    assert plan["device_memory_bytes"] == 141 * GIB
    estimate = plan_memory(
        preset("tiny"),
        device_memory=141 * GIB,
        tensor_parallel_size=tp,
        dcp_size=1,
        max_num_seqs=8,
        max_model_len=1024,
    )
    assert estimate.activation_method == "estimate"
    assert plan["activation_bytes"] > 0 and plan["activation_bytes"] != estimate.activation_bytes
    # The same weights and caches per token and slot: only the activation was compiled.
    for key in ("weights_bytes_per_device", "kv_bytes_per_token_per_device"):
        assert plan[key] == getattr(estimate, key)


def test_target_plan_takes_a_given_device_memory(capsys):
    rc, plan = plan_json(capsys, "--target", "h200", "--device-memory", "80GiB")
    assert rc == 0 and plan["device_memory_bytes"] == 80 * GIB
