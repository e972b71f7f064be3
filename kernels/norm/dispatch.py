"""The norm launches by token count: the residual add + norm (+ a router's logits) and the
GDN output's gated norm run in one Pallas launch at a decode step's sizes (``tuning.norm``'s
limits), else the caller's XLA form (its ops with the same contract)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from lazyspec.kernels.common import fitted_tile, pallas_options, powers_of_two
from lazyspec.kernels.norm.gated import gated_norm_pallas
from lazyspec.kernels.norm.residual import ResidualNorm, residual_norm_pallas
from lazyspec.kernels.tuning import DEFAULT_TUNING, Tuning


def residual_norm_fits(
    num_tokens: int, num_experts: int | None, tuning: Tuning = DEFAULT_TUNING
) -> bool:
    """Whether the residual-norm launch runs for this many tokens (and router experts, None
    without a router): up to ``residual_max_tokens`` tokens and tokens times experts up to
    ``residual_max_token_experts``; else XLA's fusions run."""
    norm = tuning.norm
    return (
        num_tokens <= norm.residual_max_tokens
        and num_tokens * (num_experts or 1) <= norm.residual_max_token_experts
    )


def residual_norm_tiles(num_tokens: int, tuning: Tuning = DEFAULT_TUNING) -> dict[str, int]:
    """The residual-norm launch's router rows a program and warps at ``num_tokens`` tokens."""
    norm = tuning.norm
    if num_tokens <= norm.few_tokens:
        return {"block_experts": norm.few_block_experts, "num_warps": norm.few_num_warps}
    return {"block_experts": norm.block_experts, "num_warps": norm.num_warps}


def pallas_residual_norm(
    x: jax.Array,
    delta: jax.Array | None,
    weight: jax.Array,
    router: jax.Array | None = None,
    *,
    xla_form: Callable[[], ResidualNorm],
    interpret: bool = False,
    tuning: Tuning = DEFAULT_TUNING,
    **options: Any,
) -> ResidualNorm:
    """``residual_norm_pallas`` (``options``: ``eps``, ``zero_centered``, ``logits_dtype``,
    tiles overriding ``residual_norm_tiles``') where ``residual_norm_fits``; else, or where a
    compiled launch would need a row that is not a power of two wide (Triton), ``xla_form()``."""
    (num_tokens, width), experts = x.shape, None if router is None else router.shape[0]
    options = {**residual_norm_tiles(num_tokens, tuning), **options}
    launch = pallas_options(interpret, None, options.pop("num_warps"))
    fits = residual_norm_fits(num_tokens, experts, tuning)
    if not fits or not (launch["interpret"] or powers_of_two(width)):
        return xla_form()
    if router is not None:
        options["block_experts"] = fitted_tile(experts, options["block_experts"])
    return residual_norm_pallas(x, delta, weight, router, **options, **launch)


def pallas_gated_norm(
    x: jax.Array,
    *operands: Any,
    xla_form: Callable[[], jax.Array],
    interpret: bool = False,
    num_warps: int = 1,
    tuning: Tuning = DEFAULT_TUNING,
    **options: Any,
) -> jax.Array:
    """``gated_norm_pallas`` of x and ``operands`` (z_source, layout, weight; ``options``:
    ``eps``, ``dtype``) up to ``gated_max_tokens`` tokens where the gates' columns are whole
    blocks of d (and, compiled, d a power of two); else ``xla_form()``."""
    launch = pallas_options(interpret, None, num_warps)
    head_dim, layout = x.shape[-1], operands[1]
    fits = layout.in_whole_blocks(head_dim) and (launch["interpret"] or powers_of_two(head_dim))
    if x.shape[0] > tuning.norm.gated_max_tokens or not fits:
        return xla_form()
    return gated_norm_pallas(x, *operands, **options, **launch)
