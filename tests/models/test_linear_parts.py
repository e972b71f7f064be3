"""``linear.linear_parts``: a projection left as float32 partial sums of its contraction."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.models.layers.linear import linear, linear_parts, project_out


@pytest.mark.parametrize("parts", [1, 2, 4])
def test_the_parts_sum_to_the_projection(parts):
    """Part s is the product of input columns ``[s * K / S, (s + 1) * K / S)`` with those
    weight rows, in float32; the parts' sum rounded to the weight's dtype is ``linear``'s
    output (bf16 weights, float32 accumulation either way)."""
    rng = np.random.default_rng(parts)
    x = jnp.asarray(rng.standard_normal((2, 3, 32)), jnp.bfloat16)
    weight = jnp.asarray(rng.standard_normal((32, 16)) * 0.2, jnp.bfloat16)
    got = linear_parts({"weight": weight}, x, parts)
    assert got.shape == (parts, 2, 3, 16) and got.dtype == jnp.float32
    chunk = 32 // parts
    xs, ws = np.asarray(x, np.float64), np.asarray(weight, np.float64)
    for s in range(parts):
        want = xs[..., s * chunk : (s + 1) * chunk] @ ws[s * chunk : (s + 1) * chunk]
        np.testing.assert_allclose(np.asarray(got[s]), want, rtol=1e-5, atol=1e-5)
    summed = np.asarray(jnp.sum(got, 0).astype(jnp.bfloat16), np.float32)
    whole = np.asarray(linear({"weight": weight}, x), np.float32)
    np.testing.assert_allclose(summed, whole, rtol=2**-7, atol=2**-7)
    np.testing.assert_array_equal(np.asarray(project_out({"weight": weight}, x)), whole)
    np.testing.assert_array_equal(np.asarray(project_out({"weight": weight}, x, parts)), got)


@pytest.mark.parametrize("parts, bias", [(3, False), (0, False), (2, True)])
def test_a_split_that_is_none_is_refused(parts, bias):
    params = {"weight": jnp.ones((32, 16), jnp.bfloat16)}
    if bias:
        params["bias"] = jnp.ones((16,), jnp.bfloat16)
    with pytest.raises(ValueError, match="is no split"):
        linear_parts(params, jnp.ones((2, 32), jnp.bfloat16), parts)
