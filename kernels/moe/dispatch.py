"""The routed experts by token count: ``moe_experts_pallas`` (GPUs, interpret mode), in
launches of at most the tuning's ``kernel_max_tokens`` tokens, or the TPU layout
``moe.experts_tpu`` up to its limit; else (widths Triton takes no tile of, a TPU call
past its limit) the caller's XLA form (the layers' sort-based dispatch, same contract)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from lazyspec.kernels.common import (
    TRITON_MIN_DOT,
    fitted_tile,
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
    override the folds), or None where one launch does not run them: more than
    ``kernel_max_tokens`` tokens (``experts_in_pieces`` cuts them) or, compiled for Triton,
    widths whose fitted tiles fall below ``TRITON_MIN_DOT`` (interpret mode runs any tile,
    so the tiny test models still exercise the kernel). Depends on the widths only, not on
    the number of experts."""
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
    options = pallas_options(interpret, None, warps, stages)
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
    """``moe_experts_pallas`` of ``operands`` (x, weights, expert_ids, up, down[, gate]) in
    pieces of at most ``kernel_max_tokens`` tokens (``experts_in_pieces``), else, where
    Triton takes no tile of the widths, ``xla_form()``. ``shared``: a shared expert run in
    the same launches (``xla_form`` then adds it too). ``routing``: the router's logits,
    from which the kernel picks a few tokens' experts."""
    if not takes_widths(operands, interpret, tuning, **tiles):
        return xla_form()
    return experts_in_pieces(operands, shared, routing, interpret, tuning, **tiles)


def takes_widths(
    operands: tuple[jax.Array | None, ...],
    interpret: bool = False,
    tuning: Tuning = DEFAULT_TUNING,
    **tiles: Any,
) -> bool:
    """Whether ``experts_in_pieces`` runs ``operands`` (x, weights, expert_ids, up, down,
    ...): ``moe_launch`` gives its pieces a launch (it refuses only widths)."""
    x, up, down = operands[0], operands[3], operands[4]
    return (
        moe_launch(piece_tokens(x.shape[0], tuning), up, down, interpret, tuning, **tiles)
        is not None
    )


def experts_in_pieces(
    operands: tuple[jax.Array | None, ...],
    shared: SharedExpert | None = None,
    routing: TokenRouting | None = None,
    interpret: bool = False,
    tuning: Tuning = DEFAULT_TUNING,
    **tiles: Any,
) -> jax.Array:
    """``moe_experts_pallas`` of ``operands`` run on consecutive pieces of at most
    ``tuning.moe.kernel_max_tokens`` tokens (``piece_tokens``), each with ``moe_launch``'s
    arguments for its size, the outputs concatenated: a token's output depends on its own
    row alone. Cut in pieces, each takes the given weights and expert ids, not
    ``routing`` (which would send a piece's padding to its own first token's experts, not
    the call's). For widths ``takes_widths`` allows. A prefill step holds more tokens than
    the kernel's tuned sizes, and the sort-based XLA form would stage every pair's expert
    weights there (out of memory at Qwen3-Next's 512 experts from 1,024 tokens)."""
    x, up, down = operands[0], operands[3], operands[4]
    num_tokens = x.shape[0]
    piece = piece_tokens(num_tokens, tuning)
    if piece == num_tokens:
        launch = moe_launch(piece, up, down, interpret, tuning, **tiles)
        return moe_experts_pallas(*operands, shared=shared, routing=routing, **launch)
    outs = []
    for start in range(0, num_tokens, piece):
        rows = slice(start, min(start + piece, num_tokens))
        launch = moe_launch(rows.stop - start, up, down, interpret, tuning, **tiles)
        args = tuple(None if a is None else a[rows] for a in operands[:3]) + operands[3:]
        own = shared and dataclasses.replace(shared, weight=shared.weight[rows])
        outs.append(moe_experts_pallas(*args, shared=own, **launch))
    return jnp.concatenate(outs)


def piece_tokens(num_tokens: int, tuning: Tuning = DEFAULT_TUNING) -> int:
    """Tokens of each launch of ``experts_in_pieces`` over ``num_tokens`` tokens (the last
    may be fewer)."""
    return max(1, min(num_tokens, tuning.moe.kernel_max_tokens))


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
