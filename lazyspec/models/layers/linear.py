"""Linear projections.

A linear layer's params are ``{"weight": [in, out]}`` plus an optional ``"bias": [out]``
(the transpose of PyTorch's ``nn.Linear.weight``, so activations multiply on the left).
The input is cast to the weight's dtype; the result has the weight's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lazyspec.models.plan import Params


def linear(params: Params, x: jax.Array) -> jax.Array:
    """``x @ weight (+ bias)`` over the last axis of ``x``."""
    weight = params["weight"]
    y = jnp.matmul(x.astype(weight.dtype), weight)
    if "bias" in params:
        y = y + params["bias"].astype(y.dtype)
    return y
