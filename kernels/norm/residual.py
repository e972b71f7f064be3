"""The residual add, the RMSNorm after it and a MoE router's logits, in one Pallas launch.

Contract. x and delta ``[N, d]`` (the residual stream and a sublayer's output, one dtype;
delta may be None: x is normed as it is, or float32 ``[S, N, d]``: the output projection's
partial sums over S parts of its contraction, which the launch sums in float32 and rounds
to x's dtype, as the projection's own product would, before adding them), ``weight [d]``
(the norm's scale: ``1 + weight`` with ``zero_centered``, Qwen3-Next's convention),
optionally ``router [E, d]`` (a MoE router, or any projection kept in a checkpoint's
``[out, in]`` layout, such as a GDN layer's ``in_proj_ba``). Returns ``ResidualNorm``:
``residual = x + delta`` (x itself without delta) and ``normed = rms_norm(residual)`` in
x's dtype, and with a router its logits ``normed @ router.T`` summed in float32 and
rounded to ``logits_dtype`` (float32: ``layers.moe.router_logits``), else None. The
reference is the model's own ops (``layers.norms.residual_rms_norm``), which XLA runs as
two fusions and, for the logits, a split-K product and its reduction.

Kernel: grid ``(token, expert tile)``. Every program reads its token's row of x and delta
(``d`` wide; of partial sums, the token's row of every part) and, with a router, its
``block_experts`` rows of it, all in one round of loads; forms the residual rounded to x's
dtype, the normed row (float32 statistics, rounded to x's dtype as the model rounds it) and
the sums of its products with those columns in float32. Program ``(n, 0)`` writes the
residual and the normed row. The router's rows are contiguous, so a program's loads are
whole cache lines: on an H200, programs reading ``[d, E]`` columns (32 or 8 bytes of each
128-byte row) took 10 us (16 columns in eight dependent chunks) and 6 us (4 columns at once)
a layer at one token. The logits' summation order differs from XLA's product, so they agree
to float32 rounding, not bit for bit.

Backends: ``interpret=True`` anywhere (the tests, on CPU); NVIDIA GPUs through the Triton
lowering (``d`` and ``block_experts`` powers of two; a decode step's token counts, since
each program holds a whole row). Not written for TPUs (a ``(1, d)`` block is not a TPU tile).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lazyspec.kernels.common import check_tile


class ResidualNorm(NamedTuple):
    """``residual`` (x + delta) and ``normed`` ``[N, d]`` in x's dtype; ``logits`` float32
    ``[N, E]`` where a router was given, else None."""

    residual: jax.Array
    normed: jax.Array
    logits: jax.Array | None


def is_partials(x: jax.Array, delta: jax.Array | None) -> bool:
    """Whether ``delta`` is partial sums ``[S, *x.shape]`` (float32) rather than x's shape."""
    return delta is not None and delta.ndim == x.ndim + 1


def summed(x: jax.Array, delta: jax.Array | None) -> jax.Array | None:
    """``delta`` as x's shape and dtype: partial sums (``is_partials``) summed in float32
    and rounded; else as it is."""
    if not is_partials(x, delta):
        return delta
    return jnp.sum(delta, axis=0, dtype=jnp.float32).astype(x.dtype)


def _check(
    x: jax.Array, delta: jax.Array | None, weight: jax.Array, router: jax.Array | None
) -> None:
    if is_partials(x, delta):
        parts = delta.shape[0]
        if delta.shape[1:] != x.shape or delta.dtype != jnp.float32 or parts & (parts - 1):
            raise ValueError(
                f"partial sums {delta.shape} {delta.dtype} must be float32 [S, *{x.shape}], "
                "S a power of two"
            )
        delta = x
    delta = x if delta is None else delta
    if x.ndim != 2 or delta.shape != x.shape or delta.dtype != x.dtype:
        raise ValueError(
            f"x {x.shape} {x.dtype} and delta {delta.shape} {delta.dtype} must be one [N, d] "
            "shape and dtype"
        )
    if weight.shape != x.shape[1:]:
        raise ValueError(f"weight {weight.shape} must be [{x.shape[1]}]")
    if router is not None and (router.ndim != 2 or router.shape[1] != x.shape[1]):
        raise ValueError(f"router {router.shape} must be [E, {x.shape[1]}]")


def norm_scale(weight: jax.Array, zero_centered: bool) -> jax.Array:
    """An RMSNorm's float32 scale: ``1 + weight`` with ``zero_centered``, else ``weight``
    (``layers.norms.rms_norm`` scales by it too)."""
    scale = weight.astype(jnp.float32)
    return 1.0 + scale if zero_centered else scale


def _kernel(*refs, eps, zero_centered, with_delta, with_router, partials):
    refs = list(refs)
    x_ref = refs.pop(0)
    delta_ref = refs.pop(0) if with_delta else None
    weight_ref = refs.pop(0)
    router_ref = refs.pop(0) if with_router else None
    res_ref = refs.pop(0) if with_delta else None
    normed_ref = refs.pop(0)
    dtype = normed_ref.dtype
    row = x_ref[0, :].astype(jnp.float32)
    if with_delta:
        if partials:  # the product's parts summed in float32, rounded as its output is
            delta = jnp.sum(delta_ref[:, 0, :], axis=0).astype(dtype)
        else:
            delta = delta_ref[0, :]
        row = (row + delta.astype(jnp.float32)).astype(dtype).astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(row * row) + eps)  # the residual rounded as ``x + delta``
    normed = (row * inv * norm_scale(weight_ref[...], zero_centered)).astype(dtype)

    @pl.when(pl.program_id(1) == 0)
    def _():
        if with_delta:
            res_ref[0, :] = row.astype(dtype)
        normed_ref[0, :] = normed

    if with_router:
        logits_ref = refs.pop(0)
        w = router_ref[...].astype(jnp.float32)  # [block_experts, d], one load
        logits = jnp.sum(w * normed.astype(jnp.float32)[None, :], axis=1)
        logits_ref[0, :] = logits.astype(logits_ref.dtype)


def residual_norm_pallas(
    x: jax.Array,
    delta: jax.Array | None,
    weight: jax.Array,
    router: jax.Array | None = None,
    *,
    eps: float,
    zero_centered: bool = False,
    logits_dtype: Any = jnp.float32,
    block_experts: int | None = 4,
    interpret: bool = False,
    compiler_params: Any = None,
) -> ResidualNorm:
    """The fused launch (module docstring); ``block_experts`` None is the whole axis (it
    is clipped to E)."""
    _check(x, delta, weight, router)
    num_tokens, width = x.shape
    with_router, with_delta = router is not None, delta is not None
    row = pl.BlockSpec((1, width), lambda n, j: (n, 0))
    partials = is_partials(x, delta)
    delta_spec = row
    if partials:  # every part's row of the token
        delta_spec = pl.BlockSpec((delta.shape[0], 1, width), lambda n, j: (0, n, 0))
    in_specs = [row] + [delta_spec] * with_delta + [pl.BlockSpec((width,), lambda n, j: (0,))]
    args = [x, delta, weight] if with_delta else [x, weight]
    out_specs = [row] * (1 + with_delta)
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype)] * (1 + with_delta)
    expert_tiles = 1
    if with_router:
        num_experts = router.shape[0]
        be = num_experts if block_experts is None else min(block_experts, num_experts)
        be = check_tile("block_experts", num_experts, be)
        expert_tiles = num_experts // be
        in_specs.append(pl.BlockSpec((be, width), lambda n, j: (j, 0)))
        args.append(router)
        out_specs.append(pl.BlockSpec((1, be), lambda n, j: (n, j)))
        out_shape.append(jax.ShapeDtypeStruct((num_tokens, num_experts), logits_dtype))
    kernel = functools.partial(
        _kernel,
        eps=eps,
        zero_centered=zero_centered,
        with_delta=with_delta,
        with_router=with_router,
        partials=partials,
    )
    outs = pl.pallas_call(
        kernel,
        grid=(num_tokens, expert_tiles),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        name="residual_norm",
        interpret=interpret,
        compiler_params=compiler_params,
    )(*args)
    residual, outs = (outs[0], outs[1:]) if with_delta else (x, outs)
    return ResidualNorm(residual, outs[0], outs[1] if with_router else None)
