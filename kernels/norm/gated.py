"""The GDN output's gated RMSNorm in one Pallas launch, reading its gate (z) out of the
layer's fused projection in place.

Contract. ``x [N, H, d]`` (the recurrence's outputs, any float dtype), ``z_source [N, C]``
(a projection's output holding every head's gate: Qwen3-Next's ``in_proj_qkvz``, grouped
per key head), ``layout`` (``GateLayout``: head i's gate is the d channels from column
``(i // heads_per_group) * group_width + offset + (i % heads_per_group) * d``), ``weight
[d]``. Returns ``[N, H, d]`` in ``dtype``: ``layers.norms.gated_rms_norm`` of x rounded to
``dtype`` with that gate (norm before gate: ``weight * norm(x) * silu(z)``, float32
statistics and products, one rounding at the end), which is the reference; XLA runs it as a
reduction and an elementwise fusion over the gate's strided slice.

Kernel: grid ``(token, head)``; a program reads its head's row of x and its gate's d
channels (one block of the source, named by the index map: the layout's columns must be
multiples of d) and writes the head's normed row. Backends: ``interpret=True`` anywhere
(the tests, on CPU); NVIDIA GPUs through the Triton lowering (d a power of two). Not
written for TPUs (a ``(1, d)`` block is not a TPU tile).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


class GateLayout(NamedTuple):
    """Where head i's gate sits in each row of a projection's output: group ``i //
    heads_per_group`` spans ``group_width`` columns, its heads' gates start at ``offset``
    within it, one after another."""

    group_width: int
    offset: int
    heads_per_group: int

    def gather(self, z_source: jax.Array, num_heads: int, head_dim: int) -> jax.Array:
        """The gates as ``[..., H, d]`` (a strided slice of the source)."""
        groups = num_heads // self.heads_per_group
        grouped = z_source.reshape(*z_source.shape[:-1], groups, self.group_width)
        z = grouped[..., self.offset : self.offset + self.heads_per_group * head_dim]
        return z.reshape(*z_source.shape[:-1], num_heads, head_dim)

    def in_whole_blocks(self, head_dim: int) -> bool:
        """Whether every gate starts at a multiple of ``head_dim`` (the launch reads each
        as one block of the source)."""
        return self.group_width % head_dim == 0 and self.offset % head_dim == 0


def _check(x: jax.Array, z_source: jax.Array, layout: GateLayout, weight: jax.Array) -> None:
    if x.ndim != 3 or z_source.ndim != 2 or z_source.shape[0] != x.shape[0]:
        raise ValueError(f"x {x.shape} must be [N, H, d] and z_source {z_source.shape} [N, C]")
    num, num_heads, head_dim = x.shape
    if weight.shape != (head_dim,):
        raise ValueError(f"weight {weight.shape} must be [{head_dim}]")
    groups, rest = divmod(num_heads, layout.heads_per_group)
    inside = layout.offset + layout.heads_per_group * head_dim <= layout.group_width
    if rest or not inside or groups * layout.group_width != z_source.shape[1]:
        raise ValueError(
            f"{layout} does not place {num_heads} gates of {head_dim} in {z_source.shape}"
        )
    if not layout.in_whole_blocks(head_dim):
        raise ValueError(f"{layout}: the gates' columns must be multiples of d={head_dim}")


def gated_rows(x: jax.Array, z: jax.Array, weight: jax.Array, *, eps: float, dtype) -> jax.Array:
    """The gated norm of rows ``x [..., d]`` (rounded to ``dtype`` first, as the layer rounds
    them) with gates ``z [..., d]``: float32 statistics and products, in ``dtype``. The
    kernels' arithmetic (this launch's and ``gdn.update``'s with an ``OutputNorm``)."""
    x = x.astype(dtype).astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    out = x * inv * weight.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
    return out.astype(dtype)


def _kernel(x_ref, z_ref, weight_ref, out_ref, *, eps, dtype):
    out = gated_rows(x_ref[0, :], z_ref[0, :], weight_ref[...], eps=eps, dtype=dtype)
    out_ref[0, :] = out.astype(out_ref.dtype)


def gated_norm_pallas(
    x: jax.Array,
    z_source: jax.Array,
    layout: GateLayout,
    weight: jax.Array,
    *,
    eps: float,
    dtype: Any,
    interpret: bool = False,
    compiler_params: Any = None,
) -> jax.Array:
    """The launch (module docstring); pure."""
    _check(x, z_source, layout, weight)
    num, num_heads, head_dim = x.shape
    per_group, width, offset = layout.heads_per_group, layout.group_width, layout.offset

    def z_block(n, i):
        group, slot = i // per_group, i % per_group
        return n, (group * width + offset) // head_dim + slot

    out = pl.pallas_call(
        functools.partial(_kernel, eps=eps, dtype=dtype),
        grid=(num, num_heads),
        in_specs=[
            pl.BlockSpec((None, 1, head_dim), lambda n, i: (n, i, 0)),
            pl.BlockSpec((1, head_dim), z_block),
            pl.BlockSpec((head_dim,), lambda n, i: (0,)),
        ],
        out_specs=pl.BlockSpec((None, 1, head_dim), lambda n, i: (n, i, 0)),
        out_shape=jax.ShapeDtypeStruct(x.shape, dtype),
        name="gated_norm",
        interpret=interpret,
        compiler_params=compiler_params,
    )(x, z_source, weight)
    return out
