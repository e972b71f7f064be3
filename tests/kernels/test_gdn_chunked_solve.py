"""The chunked GDN form's unit lower-triangular solve (``solve_unit_lower``): on CPU a
forward substitution in jnp, equal to LAPACK's batched solve (the one it replaces there,
which can hang a multi-device CPU program: ``tests/bench/test_bench_engine.py``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.kernels.gdn.chunked import _lapack_solve, solve_unit_lower


@pytest.mark.parametrize("size", [1, 2, 16, 64])
def test_substitution_equals_the_lapack_solve(size):
    rng = np.random.default_rng(size)
    noise = rng.standard_normal((3, 2, size, size)).astype(np.float32)
    # a unit lower system (small strict part, so X stays of the size of rhs and the residual
    # check below is meaningful) with junk above the diagonal, which both forms must ignore
    system = np.tril(0.15 * noise, -1) + np.eye(size) + 5 * np.triu(noise, 1)
    rhs = rng.standard_normal((3, 2, size, 24)).astype(np.float32)
    got = jax.jit(solve_unit_lower)(jnp.asarray(system), jnp.asarray(rhs))
    want = jax.jit(_lapack_solve)(jnp.asarray(system), jnp.asarray(rhs))
    scale = max(1.0, float(np.max(np.abs(want))))
    assert float(np.max(np.abs(np.asarray(got) - np.asarray(want)))) / scale < 1e-5
    # and it is a solution: L @ X == rhs
    lower = np.tril(system, -1) + np.eye(size)
    assert np.allclose(lower @ np.asarray(got, np.float64), rhs, atol=1e-4)
