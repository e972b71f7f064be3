"""Random init of a weight plan: large normal leaves are drawn on the devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from lazyspec.models import plan as plan_module
from lazyspec.models.plan import TensorSpec, init_plan

PLAN = {
    "big": TensorSpec("big", (128, 96), init_scale=2.0),
    "ones": TensorSpec("ones", (128, 96), init="ones"),
    "small": TensorSpec("small", (4, 8)),
}


def test_large_normal_leaves_are_drawn_on_the_device(monkeypatch):
    monkeypatch.setattr(plan_module, "DEVICE_DRAW_MIN_SIZE", 1024)
    sharding = NamedSharding(jax.sharding.Mesh(jax.devices()[:1], ("tp",)), PartitionSpec())
    placed = []

    def place(axes, shape):
        placed.append(shape)
        return sharding

    params = init_plan(PLAN, jax.random.PRNGKey(3), jnp.bfloat16, scale=0.05, place=place)
    again = init_plan(PLAN, jax.random.PRNGKey(3), jnp.bfloat16, scale=0.05, place=place)
    other = init_plan(PLAN, jax.random.PRNGKey(4), jnp.bfloat16, scale=0.05, place=place)
    big = np.asarray(params["big"], np.float32)
    assert params["big"].dtype == jnp.bfloat16 and params["big"].sharding == sharding
    assert abs(big.std() / (0.05 * 2.0) - 1) < 0.05 and abs(big.mean()) < 0.01
    np.testing.assert_array_equal(big, np.asarray(again["big"], np.float32))
    assert not np.array_equal(big, np.asarray(other["big"], np.float32))
    np.testing.assert_array_equal(np.asarray(params["ones"], np.float32), 1.0)
    # the small leaf is drawn on the host with its block (the whole leaf here) placed
    assert (4, 8) in placed and params["small"].shape == (4, 8)
    # host and device draws of the big leaf differ: the device path was taken
    monkeypatch.setattr(plan_module, "DEVICE_DRAW_MIN_SIZE", 1 << 30)
    host = init_plan(PLAN, jax.random.PRNGKey(3), jnp.bfloat16, scale=0.05, place=place)
    assert not np.array_equal(big, np.asarray(host["big"], np.float32))
    assert abs(np.asarray(host["big"], np.float32).std() / big.std() - 1) < 0.05
