"""Research use: the no-cache forward is differentiable and its gradients are right."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi_linear_jax.model import init_model
from kimi_linear_jax.presets import preset


def test_grad_finite_and_matches_finite_differences():
    """jax.grad of a next-token loss on the tiny model (float64) agrees with central
    differences along a random direction, for a parameter of each layer kind."""
    with jax.enable_x64(True):
        cfg = preset("tiny", vocab_size=300)
        model = init_model(cfg, seed=7, dtype=jnp.float64)
        graphdef, params = nnx.split(model)
        ids = jnp.asarray(np.random.default_rng(0).integers(0, 300, (2, 70)), jnp.int32)

        def loss(p):
            logits = nnx.merge(graphdef, p)(ids[:, :-1])
            logp = jax.nn.log_softmax(logits, axis=-1)
            return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))

        grads = jax.jit(jax.grad(loss))(params)
        leaves = jax.tree.leaves(grads)
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
        flat = dict(nnx.to_flat_state(params))
        gflat = dict(nnx.to_flat_state(grads))
        picks = [
            ("model", "layers", 0, "self_attn", "A_log"),  # KDA decay
            ("model", "layers", 1, "self_attn", "k_conv1d", "weight"),  # short conv
            ("model", "layers", 2, "self_attn", "kv_b_proj", "weight"),  # MLA
            ("model", "layers", 1, "block_sparse_moe", "experts", "w2"),  # routed experts
        ]
        f = jax.jit(loss)
        rng = np.random.default_rng(1)
        for path in picks:
            value = flat[path][...]
            d = jnp.asarray(rng.standard_normal(value.shape))
            eps = 1e-5

            def at(scale, path=path, value=value, d=d):
                moved = {**flat, path: flat[path].replace(value + scale * d)}
                return f(nnx.from_flat_state(moved))

            fd = (at(eps) - at(-eps)) / (2 * eps)
            analytic = jnp.sum(gflat[path][...] * d)
            assert abs(float(fd) - float(analytic)) <= 1e-6 * max(1.0, abs(float(fd))), (
                f"{path}: finite difference {float(fd):.8e} vs grad {float(analytic):.8e}"
            )
            assert abs(float(analytic)) > 1e-9, f"{path}: gradient is zero; test would be vacuous"
