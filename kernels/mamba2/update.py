"""The Mamba2 recurrent state update for a padded batch of T new tokens a row: the Pallas
(Triton layout) kernel and the XLA form, with the contract, records and launch of
``state.update_common``; value tiles split the head dim P. The TPU (Mosaic) layout is
``update_tpu``; the math is ``reference.mamba2_step`` / ``mamba2_scan``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lazyspec.kernels.common import check_tile, triton_shape_error, whole
from lazyspec.kernels.mamba2.reference import mamba2_scan
from lazyspec.kernels.state.update_common import (
    DEFAULT_UPDATE_TILES,
    Mamba2Tokens,
    StateUpdateResult,
    UpdateTiles,
    check_mode,
    check_pool,
    launch_tiles,
    load_tile,
    pool_index,
    run_update,
    scan_tokens,
    xla_update,
)


def mamba2_tile_step(
    h: jax.Array,
    x: jax.Array,
    b: jax.Array,
    c: jax.Array,
    dt: jax.Array,
    a: jax.Array,
    d: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """``reference.mamba2_step`` on a tile: h [bh, bp, N], x [bh, bp], b, c [bh, N] (already
    per head), dt, a, d [bh]."""
    decay = jnp.exp(dt * a)
    h = h * decay[:, None, None] + (dt[:, None] * x)[:, :, None] * b[:, None, :]
    return h, jnp.sum(h * c[:, None, :], axis=2) + d[:, None] * x


# ---------------------------------------------------------------- Pallas


def _heads_from_groups(
    bc_ref, t: int, head_start: jax.Array, block_heads: int, heads_per_group: int
) -> jax.Array:
    """The [block_heads, N] rows of b or c read by heads head_start.. (head i -> group
    i // heads_per_group); the tile never straddles a group partially."""
    group = jax.lax.div(head_start, heads_per_group)  # truncating: no sign fix-ups to lower
    if block_heads <= heads_per_group:
        row = bc_ref[t, group, :].astype(jnp.float32)
        return jnp.broadcast_to(row[None, :], (block_heads, row.shape[0]))
    groups = bc_ref[t, pl.ds(group, block_heads // heads_per_group), :]
    return jnp.repeat(groups.astype(jnp.float32), heads_per_group, axis=0)


def _mamba2_kernel(slot_ref, *refs, mode, tiles: UpdateTiles, heads_per_group, layer):
    """refs: x, b, c, dt, a, d (``Mamba2Tokens``), then the pool, the outputs and the state
    output."""
    x_ref, b_ref, c_ref, dt_ref, a_ref, d_ref, pool_ref, out_ref, state_ref = refs
    slot = slot_ref[pl.program_id(0)]
    block_heads = tiles.block_heads
    head_start = pl.program_id(1) * block_heads
    heads = pl.ds(head_start, block_heads)
    rows = pl.ds(pl.program_id(2) * tiles.block_value, tiles.block_value)
    tile = pool_index(layer, slot, heads, rows, slice(None))
    h = load_tile(pool_ref, tile, slot, tiles)
    a = a_ref[heads].astype(jnp.float32)
    d = d_ref[heads].astype(jnp.float32)

    def step(t, h):
        b = _heads_from_groups(b_ref, t, head_start, block_heads, heads_per_group)
        c = _heads_from_groups(c_ref, t, head_start, block_heads, heads_per_group)
        x, dt = x_ref[t].astype(jnp.float32), dt_ref[t, heads].astype(jnp.float32)
        return mamba2_tile_step(h, x, b, c, dt, a, d)

    scan_tokens(step, h, mode, slot, tile, out_ref, state_ref)


def check_groups(num_heads: int, num_groups: int, block_heads: int) -> int:
    """The heads a group of B and C, ``num_heads // num_groups``; ValueError unless the groups
    divide the heads and ``block_heads`` divides that count or is a multiple of it."""
    if num_groups <= 0 or num_heads % num_groups:
        raise ValueError(f"num_groups={num_groups} must divide num_heads={num_heads}")
    per_group = num_heads // num_groups
    if per_group % block_heads and block_heads % per_group:
        raise ValueError(
            f"block_heads={block_heads} must divide or be a multiple of the "
            f"{per_group} heads per group"
        )
    return per_group


def mamba2_triton_error(state_shape: tuple[int, ...], tiles: UpdateTiles) -> str | None:
    """Why ``mamba2_state_update_pallas`` cannot run compiled through Triton on states of
    ``state_shape`` (H, P, N) in ``tiles`` (``common.triton_shape_error``), or None: it
    computes on ``[block_heads, block_value, N]`` state tiles with ``[block_heads, N]`` rows
    of B and C (N whole; a tile's groups, ``block_heads`` over the heads a group, divide
    it). ValueError where a tile does not divide its axis."""
    num_heads, head_dim, state_dim = state_shape
    return triton_shape_error(
        "mamba2_state_update_pallas",
        block_heads=check_tile("block_heads", num_heads, tiles.block_heads),
        block_value=check_tile("block_value", head_dim, tiles.block_value),
        N=state_dim,
    )


def mamba2_state_update_pallas(
    pool: jax.Array,
    slot: jax.Array,
    tokens: Mamba2Tokens,
    *,
    mode: str,
    layer: int | None = None,
    tiles: UpdateTiles = DEFAULT_UPDATE_TILES,
    interpret: bool = False,
    compiler_params: Any = None,
) -> StateUpdateResult:
    """Pallas Mamba2 update (module docstring has the contract); value tiles split P;
    ``tiles`` as ``gdn_state_update_pallas``'s. Compiled, shapes Triton cannot lower are a
    ValueError (``mamba2_triton_error``)."""
    check_mode(mode)
    batch, num_tokens, num_heads, head_dim = tokens.x.shape
    num_groups, state_dim = tokens.b.shape[2:]
    state_shape = (num_heads, head_dim, state_dim)
    launched = launch_tiles(
        pool, slot, state_shape, layer, mode, tiles, mamba2_triton_error, interpret, value_axis=1
    )
    bh, bp = launched.block_heads, launched.block_value
    per_group = check_groups(num_heads, num_groups, bh)
    values = pl.BlockSpec((None, num_tokens, bh, bp), lambda b, i, j: (b, 0, i, j))
    groups = pl.BlockSpec((None, num_tokens, num_groups, state_dim), lambda b, i, j: (b, 0, 0, 0))
    per_head = pl.BlockSpec((None, num_tokens, num_heads), lambda b, i, j: (b, 0, 0))

    def mamba2_update(*refs):  # the kernel's name in profiles
        _mamba2_kernel(*refs, mode=mode, tiles=launched, heads_per_group=per_group, layer=layer)

    return run_update(
        mamba2_update,
        mode,
        pool,
        (batch, num_heads // bh, head_dim // bp),
        [whole(), values, groups, groups, per_head, whole(), whole(), whole()],
        (slot, tokens.x, tokens.b, tokens.c, tokens.dt, tokens.a, tokens.d, pool),
        tokens.x,
        values,
        pl.BlockSpec((None, num_tokens, bh, bp, state_dim), lambda b, i, j: (b, 0, i, j, 0)),
        {"interpret": interpret, "compiler_params": compiler_params},
    )


# ---------------------------------------------------------------- XLA


def mamba2_state_update_xla(
    pool: jax.Array, slot: jax.Array, tokens: Mamba2Tokens, *, mode: str, layer: int | None = None
) -> StateUpdateResult:
    """Same contract as ``mamba2_state_update_pallas``, through a vmapped ``mamba2_scan``."""
    check_mode(mode)
    check_pool(pool, slot, (tokens.x.shape[2], tokens.x.shape[3], tokens.b.shape[3]), layer)
    check_groups(tokens.x.shape[2], tokens.b.shape[2], 1)
    scan = jax.vmap(mamba2_scan, in_axes=(0, 0, 0, 0, 0, None, None))
    inputs = (tokens.x, tokens.b, tokens.c, tokens.dt, tokens.a, tokens.d)
    return xla_update(scan, pool, slot, inputs, mode=mode, layer=layer, out_dtype=tokens.x.dtype)
