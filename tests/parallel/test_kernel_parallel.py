"""The Pallas kernel (interpret mode) as the attention of a TP x DCP model: each rank hands it
the DCP group's gathered heads and the real verify width, and the result equals one device
with the XLA reference."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels.mla_decode import kernel_supports
from kimi_linear_jax.cache import contiguous_batch
from kimi_linear_jax.model import merge
from kimi_linear_jax.parallel.mesh import make_parallel
from kimi_linear_jax.parallel.rules import init_cache, shard_model
from kimi_linear_jax.testing import random_model
from tests.helpers import assert_close
from tests.parallel.test_model_parallel import CONFIG

# L = 32, R = 16, 16-token pages a rank: dims the kernel takes.
KCONFIG = dataclasses.replace(CONFIG, qk_rope_head_dim=16)
PAGE, B, N, T = 16, 2, 21, 4


def _verify_logits(model):
    par = model.par
    page = PAGE * par.dcp
    ids = np.random.default_rng(0).integers(0, KCONFIG.vocab_size, (B, N + T)).astype(np.int32)
    cache = init_cache(
        KCONFIG, par, num_slots=B + 1, num_pages=B * 3, page_size=page, dtype=jnp.float32
    )
    batch = contiguous_batch(B, 3 * page, page, lengths=[N, N - 5])
    win = batch._replace(start=jnp.asarray([N, N - 5], jnp.int32), lengths=jnp.full((B,), T))
    graphdef, params = nnx.split(model)

    @jax.jit
    def run(params, cache):
        m = merge(graphdef, params)
        _, cache = m.prefill(jnp.asarray(ids[:, :N]), cache, batch)
        return m.verify(jnp.asarray(ids[:, N:]), cache, win)[0]

    return np.asarray(run(params, cache))


def test_kernel_under_tp_and_dcp_equals_one_device_reference():
    assert kernel_supports(KCONFIG.kv_lora_rank, KCONFIG.qk_rope_head_dim, PAGE)
    base = random_model(KCONFIG, seed=4)
    want = _verify_logits(base)
    par = make_parallel(KCONFIG, 4, 2, attention="interpret")
    got = _verify_logits(shard_model(base, par))
    assert_close(got, want, atol=2e-5, rtol_rms=2e-6, name="verify logits")
