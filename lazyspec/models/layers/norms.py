"""RMS norms shared by the model families (pure functions over weight arrays).

All statistics are computed in float32; the result is cast back to the input's dtype.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from lazyspec.kernels.norm.residual import ResidualNorm, norm_scale, summed
from lazyspec.models.layers.moe import router_logits


def _normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) over the last axis, in float32."""
    x = x.astype(jnp.float32)
    variance = jnp.mean(x * x, axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(variance + eps)


def rms_norm(
    x: jax.Array, weight: jax.Array, eps: float, *, zero_centered: bool = False
) -> jax.Array:
    """RMSNorm over the last axis.

    ``zero_centered=True`` is the Qwen3-Next convention (scale ``1 + weight``, weights
    initialised at 0); ``False`` is the usual ``weight * normed`` (Llama, Nemotron-H).
    Returns an array of ``x``'s shape and dtype; nothing is mutated.
    """
    return (_normalize(x, eps) * norm_scale(weight, zero_centered)).astype(x.dtype)


def residual_rms_norm(
    x: jax.Array,
    delta: jax.Array | None,
    weight: jax.Array,
    router: jax.Array | None = None,
    *,
    eps: float,
    zero_centered: bool = False,
    logits_dtype: Any = jnp.float32,
) -> ResidualNorm:
    """``x + delta`` (x without delta), its ``rms_norm`` and, given a router ``[E, d]``, its
    logits of the normed tokens (``layers.moe.router_logits``) rounded to ``logits_dtype``:
    the XLA form of the ``Kernels.residual_norm`` launch, and its reference. ``delta`` may
    be float32 partial sums ``[S, *x.shape]``, summed and rounded to x's dtype first."""
    delta = summed(x, delta)
    residual = x if delta is None else x + delta
    normed = rms_norm(residual, weight, eps, zero_centered=zero_centered)
    logits = None
    if router is not None:
        logits = router_logits({"gate": router}, normed).astype(logits_dtype)
    return ResidualNorm(residual, normed, logits)


def gated_rms_norm(
    x: jax.Array,
    gate: jax.Array,
    weight: jax.Array,
    eps: float,
    *,
    group_size: int | None = None,
    norm_before_gate: bool = True,
) -> jax.Array:
    """RMSNorm of ``x`` combined with a SiLU gate, over the last axis.

    ``norm_before_gate=True`` (Qwen3-Next GDN output): ``weight * norm(x) * silu(gate)``.
    ``norm_before_gate=False`` (Mamba2 / Nemotron-H): ``weight * norm(x * silu(gate))``.
    ``group_size`` normalises each contiguous group of that many channels separately
    (None = one group spanning the whole last axis). Returns ``x``'s shape and dtype.
    """
    width = x.shape[-1]
    size = width if group_size is None else group_size
    if size <= 0 or width % size != 0:
        raise ValueError(f"group_size {group_size} does not divide the last axis {width}")
    h = x.astype(jnp.float32)
    silu_gate = jax.nn.silu(gate.astype(jnp.float32))
    if not norm_before_gate:
        h = h * silu_gate
    grouped = h.reshape(*h.shape[:-1], width // size, size)
    h = _normalize(grouped, eps).reshape(h.shape)
    h = h * weight.astype(jnp.float32)
    if norm_before_gate:
        h = h * silu_gate
    return h.astype(x.dtype)
