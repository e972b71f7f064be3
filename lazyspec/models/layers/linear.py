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


def project_out(params: Params, x: jax.Array, parts: int = 0) -> jax.Array:
    """``linear``, or with ``parts`` its float32 partial sums (``linear_parts``)."""
    return linear_parts(params, x, parts) if parts else linear(params, x)


def linear_parts(params: Params, x: jax.Array, parts: int) -> jax.Array:
    """``linear``'s product left as float32 partial sums ``[parts, *x.shape[:-1], out]``:
    the contraction split into ``parts`` contiguous chunks, one batched product (the
    chunks as its batch), for a consumer that sums them itself (``residual_norm``'s
    partials, which round the sum to the weight's dtype as ``linear`` rounds its output).
    No bias; ``parts`` must divide the input width."""
    weight = params["weight"]
    width, out = weight.shape
    if "bias" in params or parts < 1 or width % parts:
        raise ValueError(f"{parts} parts of a {width}-wide contraction (no bias) is no split")
    chunks = x.astype(weight.dtype).reshape(*x.shape[:-1], parts, width // parts)
    return jax.lax.dot_general(
        chunks,
        weight.reshape(parts, width // parts, out),
        (((x.ndim,), (1,)), ((x.ndim - 1,), (0,))),
        preferred_element_type=jnp.float32,
    )
