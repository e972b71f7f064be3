"""Rotary position embedding with an optional partial rotary dimension (rotate-half layout)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lazyspec.kernels.attention.prologue import inverse_frequencies


def rope_cos_sin(
    positions: jax.Array, rotary_dim: int, theta: float
) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables ``[..., rotary_dim]`` (float32) for integer ``positions [...]``."""
    inv_freq = jnp.asarray(inverse_frequencies(rotary_dim, theta))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def _rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first ``cos.shape[-1]`` channels of ``x [..., T, H, D]``; the rest pass.

    ``cos``/``sin`` are ``[..., T, rotary_dim]`` (broadcast over the head axis). Returns
    ``x``'s shape and dtype.
    """
    rotary_dim = cos.shape[-1]
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"rotary_dim {rotary_dim} exceeds head_dim {x.shape[-1]}")
    cos = cos[..., None, :].astype(x.dtype)
    sin = sin[..., None, :].astype(x.dtype)
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    rotated = rotated * cos + _rotate_half(rotated) * sin
    return jnp.concatenate([rotated, passed], axis=-1)
