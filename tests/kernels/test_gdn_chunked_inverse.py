"""The chunked GDN form's inverse of its unit lower-triangular systems
(``invert_unit_lower``, block doubling): times the right-hand sides, equal to a float64
solve of systems built as ``gdn_chunked`` builds them, and a true inverse (``L @ inv = I``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.kernels.gdn.chunked import invert_unit_lower
from tests.kernels.kernel_checks import assert_close, tolerance

_invert_jit = jax.jit(invert_unit_lower)


def _gdn_system(rng, size: int, alike: float, num_valid: int) -> np.ndarray:
    """``I + A``, ``A[t, s] = beta_t exp(G_t - G_s) k_t.k_s`` (s < t) as ``gdn_chunked``
    builds it: beta in (0, 1), decays <= 1, unit keys sharing ``alike`` of one direction
    (1: every key the same, |A| entries up to beta), tokens from ``num_valid`` on padding
    (beta = 0, k = 0, g = 0); junk above the diagonal, which the inverse must ignore."""
    shared = rng.standard_normal(32)
    keys = alike * shared + np.sqrt(1 - alike**2) * rng.standard_normal((2, size, 32))
    keys /= np.linalg.norm(keys, axis=-1, keepdims=True)
    beta = rng.uniform(0, 1, (2, size))
    g = -rng.uniform(0, 0.05, (2, size))
    valid = np.arange(size) < num_valid
    keys, beta, g = keys * valid[:, None], beta * valid, g * valid
    cum = np.cumsum(g, axis=-1)
    decay = np.exp(np.minimum(cum[..., :, None] - cum[..., None, :], 0))
    strict = beta[..., :, None] * decay * np.einsum("btd,bsd->bts", keys, keys)
    junk = np.triu(rng.standard_normal((2, size, size)), 1)
    return (np.tril(strict, -1) + np.eye(size) + junk).astype(np.float32)


@pytest.mark.parametrize("alike", [0.0, 0.7, 1.0])
@pytest.mark.parametrize(("size", "num_valid"), [(64, 64), (64, 23), (48, 48), (5, 5), (1, 1)])
def test_doubling_inverse_solves_the_chunk_systems(size, num_valid, alike):
    """Sizes that are powers of two and not; a chunk with padding tokens; keys from
    independent to all alike (where the power series ``(I - L)(I + L^2)...`` of the
    inverse loses every digit in float32)."""
    rng = np.random.default_rng(size + num_valid)
    system = _gdn_system(rng, size, alike, num_valid)
    rhs = rng.standard_normal((2, size, 24)).astype(np.float32)
    lower = np.tril(system.astype(np.float64), -1) + np.eye(size)
    want = np.linalg.solve(lower, rhs.astype(np.float64))
    inverse = np.asarray(_invert_jit(jnp.asarray(system)))
    got = np.asarray(jnp.matmul(inverse, rhs, precision="highest"))
    tol = tolerance(jnp.float32, size)
    assert_close(got, want, tol, "inverse @ rhs")
    assert_close(lower @ inverse, np.broadcast_to(np.eye(size), lower.shape), tol, "L @ inverse")
    if num_valid < size:  # padding rows are identity rows: their rhs passes through
        np.testing.assert_array_equal(got[:, num_valid:], rhs[:, num_valid:])
