"""The routed-experts kernel laid out for TPUs (Mosaic): the tiles' experts are
scalar-prefetched and pick each tile's weight blocks in the BlockSpec index maps, so the
pipeline DMAs only routed experts' weights into VMEM (the Triton form in ``experts``
indexes whole-array weight refs inside the kernel, which Mosaic would stage whole).

Same contract and grouping as ``experts`` (``grouping.group_pairs``; two launches, the second
weighted by the routing weights; the combine gathers each token's k rows). Unused tiles of
the static grid name the last used tile's expert in the index maps, so the pipeline sees
the block it already holds and fetches nothing; their compute is skipped and the rows they
write are never read. Each weight block holds the whole contraction axis (d for gate / up,
I for down), so there is no loop over it.

Blocks follow Mosaic's rule for the last two dims (multiples of (8, 128) or whole):
``block_inner`` / ``block_out`` are the whole axis or multiples of 128, ``block_rows`` a
multiple of 8 (16 for bf16). Run on CPU in TPU interpret mode (``common.tpu_interpret``)
and lowered to Mosaic; never compiled or run on a TPU here.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from lazyspec.kernels.common import check_tpu_tile, tpu_interpret
from lazyspec.kernels.moe.grouping import UNUSED_TILE, combine_pairs, group_pairs
from lazyspec.kernels.moe.plan import check_experts


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _up_kernel(tile_expert_ref, fetch_ref, x_ref, *refs, gated):
    del fetch_ref  # used by the index maps only
    weight_refs, out_ref = refs[:-1], refs[-1]

    @pl.when(tile_expert_ref[pl.program_id(0)] != UNUSED_TILE)
    def _compute():
        xs = x_ref[...]
        if gated:
            gate, up = (_dot(xs, w[...]) for w in weight_refs)
            h = gate / (1.0 + jnp.exp(-gate)) * up
        else:
            up = jnp.maximum(_dot(xs, weight_refs[0][...]), 0.0)
            h = up * up
        out_ref[...] = h.astype(out_ref.dtype)


def _down_kernel(tile_expert_ref, fetch_ref, h_ref, down_ref, row_weight_ref, out_ref):
    del fetch_ref

    @pl.when(tile_expert_ref[pl.program_id(0)] != UNUSED_TILE)
    def _compute():
        out_ref[...] = _dot(h_ref[...], down_ref[...]) * row_weight_ref[...]


def _fetch_experts(tile_expert: jax.Array) -> jax.Array:
    """The expert whose blocks each tile's index maps name: its own, or for an unused tile
    the last used tile's (0 when no tile is used, which cannot happen for N >= 1)."""
    last = jnp.maximum(jnp.sum(tile_expert != UNUSED_TILE) - 1, 0)
    return jnp.where(tile_expert != UNUSED_TILE, tile_expert, tile_expert[last])


def moe_experts_tpu(
    x: jax.Array,
    weights: jax.Array,
    expert_ids: jax.Array,
    up: jax.Array,
    down: jax.Array,
    gate: jax.Array | None = None,
    *,
    block_rows: int = 16,
    block_inner: int | None = None,
    block_out: int | None = None,
    interpret: Any = False,
) -> jax.Array:
    """Routed experts (``experts`` module docstring has the contract); float32
    ``[N, d_out]``. Tiles None are the whole axis; ``interpret`` as ``common.tpu_interpret``."""
    check_experts(x, expert_ids, up, down, gate)
    interpret = tpu_interpret(interpret)
    num_experts, width, inner = up.shape
    out_width = down.shape[2]
    bi = check_tpu_tile("block_inner", inner, block_inner, 128)
    bo = check_tpu_tile("block_out", out_width, block_out, 128)
    if block_rows <= 0 or block_rows % 8:
        raise ValueError(f"block_rows={block_rows} must be a positive multiple of 8 on TPU")
    grouped = group_pairs(weights, expert_ids, num_experts, block_rows)
    tables = (grouped.tile_expert, _fetch_experts(grouped.tile_expert))
    num_tiles = tables[0].shape[0]
    staged = x.astype(up.dtype)[grouped.row_token]
    projections = (up,) if gate is None else (gate, up)

    weight_block = pl.BlockSpec((None, width, bi), lambda t, i, te, fe: (fe[t], 0, i))
    hidden = pl.pallas_call(
        lambda *refs: _up_kernel(*refs, gated=gate is not None),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(num_tiles, inner // bi),
            in_specs=[pl.BlockSpec((block_rows, width), lambda t, i, te, fe: (t, 0))]
            + [weight_block] * len(projections),
            out_specs=pl.BlockSpec((block_rows, bi), lambda t, i, te, fe: (t, i)),
        ),
        out_shape=jax.ShapeDtypeStruct((staged.shape[0], inner), up.dtype),
        name="moe_experts_up",
        interpret=interpret,
    )(*tables, staged, *projections)

    rows = pl.pallas_call(
        _down_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(num_tiles, out_width // bo),
            in_specs=[
                pl.BlockSpec((block_rows, inner), lambda t, j, te, fe: (t, 0)),
                pl.BlockSpec((None, inner, bo), lambda t, j, te, fe: (fe[t], 0, j)),
                pl.BlockSpec((block_rows, 1), lambda t, j, te, fe: (t, 0)),
            ],
            out_specs=pl.BlockSpec((block_rows, bo), lambda t, j, te, fe: (t, j)),
        ),
        out_shape=jax.ShapeDtypeStruct((staged.shape[0], out_width), jnp.float32),
        name="moe_experts_down",
        interpret=interpret,
    )(*tables, hidden, down, grouped.row_weight[:, None])
    return combine_pairs(rows, grouped.pair_row)
