"""The model's MLA decode/verify path with the Pallas kernel (interpret mode) as its attention
backend gives the same logits as with the XLA reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kernels.mla_decode import kernel_supports
from kimi_linear_jax.cache import contiguous_batch, init_cache
from kimi_linear_jax.parallel.mesh import Parallel
from kimi_linear_jax.parallel.rules import shard_model
from kimi_linear_jax.presets import preset
from kimi_linear_jax.testing import random_model
from tests.helpers import assert_close


# Slow (~30 s in interpret mode): the kernel itself is tested against the reference in
# test_mla_decode.py by default; this checks the model wiring through it.
@pytest.mark.slow
def test_verify_window_with_kernel_backend():
    cfg = preset("tiny", qk_rope_head_dim=16)  # L = 32, R = 16: dims the kernel takes
    assert kernel_supports(cfg.kv_lora_rank, cfg.qk_rope_head_dim, 16)
    model = random_model(cfg, seed=2)
    B, N, T, page = 2, 21, 4, 16
    ids = np.random.default_rng(0).integers(0, 300, (B, N + T)).astype(np.int32)
    cache = init_cache(cfg, num_slots=B + 1, num_pages=B * 4, page_size=page, dtype=jnp.float32)
    batch = contiguous_batch(B, 64, page, lengths=[N, N - 5])
    _, cache = model.prefill(jnp.asarray(ids[:, :N]), cache, batch)
    win = batch._replace(start=jnp.asarray([N, N - 5], jnp.int32), lengths=jnp.full((B,), T))
    ref, _, _ = model.verify(jnp.asarray(ids[:, N:]), cache, win)
    # The attention implementation is chosen once, when the model is built for its plan.
    model = shard_model(model, Parallel(attention="interpret"))
    got, _, _ = nnx.jit(lambda m, c: m.verify(jnp.asarray(ids[:, N:]), c, win))(model, cache)
    assert_close(got, ref, atol=1e-5, rtol_rms=1e-5, name="logits")
