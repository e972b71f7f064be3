"""The router against the transformers formula: softmax over every expert, top-k, then (with
``norm_topk_prob``) the weights over their sum."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.models.layers.moe import MoESpec, route


def _reference(x, gate, top_k, norm):
    probs = jax.nn.softmax(x.astype(jnp.float32) @ gate.astype(jnp.float32).T, axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if norm:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return np.asarray(weights), np.asarray(ids)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_route_matches_softmax_then_top_k(norm, dtype):
    spec = MoESpec(
        hidden_size=64,
        num_experts=32,
        top_k=6,
        intermediate_size=16,
        shared_intermediate_size=16,
        norm_topk_prob=norm,
    )
    kx, kg = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (40, spec.hidden_size)).astype(dtype)
    gate = (0.5 * jax.random.normal(kg, (spec.num_experts, spec.hidden_size))).astype(dtype)
    weights, ids = route({"gate": gate}, spec, x)
    ref_weights, ref_ids = _reference(x, gate, spec.top_k, norm)
    assert weights.dtype == jnp.float32 and weights.shape == (40, spec.top_k)
    np.testing.assert_array_equal(np.asarray(ids), ref_ids)
    np.testing.assert_allclose(np.asarray(weights), ref_weights, rtol=2e-6, atol=1e-7)
    if norm:
        np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)
