"""The residual stream: one add-and-norm entry for every family.

A decoder block takes and returns ``(x, residual)``: x the stream, ``residual`` a sublayer's
output not added yet (or None). The next norm adds it (``add_norm``), so the entry that
owns the add owns its fusions: the residual-norm launch (``Kernels.residual_norm``), which
adds, norms and computes a router's product in one, the float32 partial sums of the output
projection before it (``output_parts``) and the MLP output handed to the next layer's norm.
Each is decided here by asking the ``Kernels`` record; the model files only declare their
stream (``ResidualStream``) and which router a norm feeds.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from lazyspec.kernels.backend import Kernels
from lazyspec.kernels.norm.residual import ResidualNorm, is_partials, summed
from lazyspec.models.layers.norms import residual_rms_norm, rms_norm


@dataclass(frozen=True)
class ResidualStream:
    """How a family adds to and norms its residual stream.

    ``zero_centered``: norms scale by ``1 + w`` (Qwen3-Next) instead of ``w``.
    ``multiplier``: each sublayer's output is scaled by it before it is added (Granite's
    residual multiplier). ``launch``: the add and norm may run in ``Kernels.residual_norm``;
    the others run in XLA."""

    eps: float
    zero_centered: bool = False
    multiplier: float = 1.0
    launch: bool = False

    def norm(self, x: jax.Array, weight: jax.Array) -> jax.Array:
        return rms_norm(x, weight, self.eps, zero_centered=self.zero_centered)


def add(stream: ResidualStream, x: jax.Array, residual: jax.Array | None) -> jax.Array:
    """``x + multiplier * residual`` in x's dtype (float32 partial sums summed first); x
    itself when there is nothing to add."""
    if residual is None:
        return x
    delta = summed(x, residual).astype(x.dtype)
    return x + (delta if stream.multiplier == 1.0 else delta * stream.multiplier)


def _launches(stream: ResidualStream, kernels: Kernels) -> bool:
    return stream.launch and kernels.residual_norm is not None


def add_norm(
    stream: ResidualStream,
    kernels: Kernels,
    x: jax.Array,
    residual: jax.Array | None,
    weight: jax.Array,
    router: jax.Array | None = None,
    *,
    after_mlp: bool = False,
    only_for_router: bool = False,
    xla_form: bool = False,
    logits_dtype: Any = jnp.float32,
) -> ResidualNorm:
    """(x + residual, its norm, the router's product of the normed tokens or None).

    In ``kernels.residual_norm`` where the stream may launch and there is something to fuse
    (a residual or a router ``[E, d]``, whose product is rounded to ``logits_dtype``); else
    the add and the norm in XLA, with no product. ``after_mlp``: the residual is the
    previous layer's MLP output, which the launch adds only where
    ``Kernels.adds_mlp_output_in_next_norm`` (else it is added first). ``only_for_router``:
    the norm launches only to compute a router's product (a GDN layer's gates), never for
    the residual alone. ``xla_form``: without the launch, the stream still runs its
    contract in XLA (``norms.residual_rms_norm``, over the tokens; the norm after a mixer
    in the engine's forward), else the plain add and norm."""
    available = _launches(stream, kernels) or (stream.launch and xla_form)
    launch = available and (router is not None or not only_for_router)
    takes = launch and (not after_mlp or kernels.adds_mlp_output_in_next_norm)
    if residual is not None and not takes:
        x, residual = add(stream, x, residual), None
    if not launch or (residual is None and router is None):
        return ResidualNorm(x, stream.norm(x, weight), None)
    return _launch(stream, kernels, x, residual, weight, router, logits_dtype)


def _launch(stream, kernels, x, residual, weight, router, logits_dtype) -> ResidualNorm:
    """``kernels.residual_norm`` over the tokens ``[N, d]`` (handed ``residual_rms_norm`` as
    its XLA form; that form itself without the kernel), reshaped back to x's shape."""
    flat = x.reshape(-1, x.shape[-1])
    if residual is not None:
        parts = (residual.shape[0],) if is_partials(x, residual) else ()
        residual = residual.reshape(*parts, *flat.shape)
    args = (flat, residual, weight, router)
    options = {"eps": stream.eps, "zero_centered": stream.zero_centered}
    options["logits_dtype"] = logits_dtype
    xla_form = functools.partial(residual_rms_norm, *args, **options)
    if kernels.residual_norm is None:
        added, normed, logits = xla_form()
    else:
        added, normed, logits = kernels.residual_norm(*args, **options, xla_form=xla_form)
    if logits is not None:
        logits = logits.reshape(*x.shape[:-1], logits.shape[-1])
    return ResidualNorm(added.reshape(x.shape), normed.reshape(x.shape), logits)


def output_parts(
    stream: ResidualStream, kernels: Kernels, x: jax.Array, router: jax.Array | None
) -> int:
    """How many float32 partial sums a mixer's output projection leaves for the norm after
    it (``Kernels.output_parts``, with that norm's router ``[E, d]`` or None), 0 for one
    product: always 0 where the stream's norms run in XLA."""
    if not _launches(stream, kernels):
        return 0
    experts = None if router is None else router.shape[0]
    return kernels.output_parts(math.prod(x.shape[:-1]), experts)
