"""The routed experts by token count: ``moe_experts_pallas`` (GPUs, interpret mode) or the
TPU layout ``moe.experts_tpu`` where the tuning's limits let them run, else the caller's
XLA form (the layers' sort-based dispatch with the same contract)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax

from lazyspec.kernels.common import (
    TRITON_MIN_DOT,
    fitted_tile,
    pallas_compiler_params,
    pallas_options,
)
from lazyspec.kernels.moe.experts import moe_experts_pallas
from lazyspec.kernels.moe.plan import SharedExpert
from lazyspec.kernels.moe.routing import TokenRouting
from lazyspec.kernels.tuning import DEFAULT_TUNING, Tuning


def moe_launch(
    num_tokens: int,
    up: jax.Array,
    down: jax.Array,
    interpret: bool = False,
    tuning: Tuning = DEFAULT_TUNING,
    **tiles: Any,
) -> dict[str, Any] | None:
    """The keyword arguments ``moe_experts_pallas`` runs ``num_tokens`` tokens with (tiles not
    given take ``tuning.moe``'s, fitted to the widths; ``route_in_up`` / ``down_in_up`` given
    override the folds), or None where the caller's XLA form runs instead: more than
    ``kernel_max_tokens`` tokens or, compiled for Triton, widths whose fitted tiles fall
    below ``TRITON_MIN_DOT`` (interpret mode runs any tile, so the tiny test models still
    exercise the kernel). Depends on the widths only, not on the number of experts."""
    moe = tuning.moe
    if num_tokens > moe.kernel_max_tokens:
        return None
    route_in_up = tiles.pop("route_in_up", num_tokens <= moe.route_in_up_max_tokens)
    down_in_up = tiles.pop("down_in_up", num_tokens <= moe.down_in_up_max_tokens)
    inner, out_width = up.shape[2], down.shape[2]
    if down_in_up:
        block_inner, block_out, block_k = moe.fold_block_inner, moe.fold_block_out, moe.fold_block_k
        warps, stages = moe.fold_num_warps, moe.fold_num_stages
    else:
        wide = num_tokens >= moe.wide_out_tokens
        block_inner, block_out = moe.block_inner, moe.block_out // (1 if wide else 2)
        block_k, warps, stages = moe.block_k, moe.num_warps, moe.num_stages
    tiles.setdefault("block_rows", moe.block_rows)
    tiles.setdefault("block_inner", fitted_tile(inner, block_inner))
    tiles.setdefault("block_out", fitted_tile(out_width, block_out))
    tiles.setdefault("block_k", fitted_tile(math.gcd(up.shape[1], inner), block_k))
    params = pallas_compiler_params(num_warps=warps, num_stages=stages)
    options = pallas_options(interpret, params)
    if not options["interpret"] and min(tiles.values()) < TRITON_MIN_DOT:
        return None  # widths with no power-of-two tile Triton's dots take
    return {
        **tiles,
        **options,
        "route_in_up": route_in_up,
        "down_in_up": down_in_up,
        "pair_grid": down_in_up and route_in_up and moe.pair_grid,
    }


def pallas_moe_experts(
    *operands: jax.Array | None,
    xla_form: Callable[[], jax.Array],
    interpret: bool = False,
    tuning: Tuning = DEFAULT_TUNING,
    shared: SharedExpert | None = None,
    routing: TokenRouting | None = None,
    **tiles: Any,
) -> jax.Array:
    """``moe_experts_pallas`` of ``operands`` (x, weights, expert_ids, up, down[, gate]) where
    ``moe_launch`` gives its arguments, else ``xla_form()``. ``shared``: a shared expert run
    in the same launches (``xla_form`` then adds it too). ``routing``: the router's logits,
    from which the kernel picks a few tokens' experts."""
    x, up, down = operands[0], operands[3], operands[4]
    launch = moe_launch(x.shape[0], up, down, interpret, tuning, **tiles)
    if launch is None:
        return xla_form()
    return moe_experts_pallas(*operands, shared=shared, routing=routing, **launch)


# the MoE layers hand this function their shared expert and router logits
# (``layers.moe.sparse_moe``, ``routed_experts``); its per-shard form and the TPU layout
# take neither
pallas_moe_experts.fuses_shared = True
pallas_moe_experts.routes_tokens = True


def tpu_moe_experts(
    *operands: jax.Array | None,
    xla_form: Callable[[], jax.Array],
    interpret: bool = False,
    tuning: Tuning = DEFAULT_TUNING,
    **tiles: Any,
) -> jax.Array:
    """``pallas_moe_experts`` with the scalar-prefetch kernel of ``moe.experts_tpu``; tiles
    not given are ``tuning.moe``'s TPU tiles where those divide (else the whole axis)."""
    moe = tuning.moe
    if operands[0].shape[0] > moe.kernel_max_tokens:
        return xla_form()
    from lazyspec.kernels.moe import experts_tpu  # Mosaic imports only where used

    inner, out_width = operands[3].shape[2], operands[4].shape[2]
    tiles.setdefault("block_inner", fitted_or_whole(inner, moe.tpu_block_inner))
    tiles.setdefault("block_out", fitted_or_whole(out_width, moe.tpu_block_out))
    return experts_tpu.moe_experts_tpu(*operands, interpret=interpret, **tiles)


def fitted_or_whole(size: int, tile: int) -> int:
    """``tile`` where it divides ``size``, else the whole axis (the TPU layout's rule)."""
    return tile if size % tile == 0 else size
