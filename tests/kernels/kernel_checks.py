"""Shared checks for the Pallas kernel tests."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def assert_close(actual, expected, tol: float, what: str) -> None:
    """Every element finite (unwritten outputs stay NaN in interpret mode) and within tol,
    relative to the element and to the array's largest magnitude."""
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    expected = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
    assert actual.shape == expected.shape, what
    assert np.isfinite(actual).all(), f"{what}: {np.sum(~np.isfinite(actual))} non-finite"
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * scale, err_msg=what)


def launch_names(eqns) -> list[str]:
    """The kernel names of the ``pallas_call`` equations among ``eqns``."""
    return [
        str(e.params.get("name", e.params.get("name_and_src_info"))).split()[0]
        for e in eqns
        if e.primitive.name == "pallas_call"
    ]


def draw_slots(rng, batch: int, num_slots: int) -> np.ndarray:
    """Distinct real slots, with padding rows (slot 0) at random positions (at least one)."""
    slot = rng.choice(np.arange(1, num_slots + 1), size=batch, replace=False)
    padding = rng.random(batch) < 0.3
    padding[rng.integers(batch)] = True
    return np.where(padding, 0, slot).astype(np.int32)
