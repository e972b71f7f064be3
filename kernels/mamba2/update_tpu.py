"""Mamba2's TPU (Mosaic) state update: ``mamba2_tile_step`` over a head tile, the row's
pool block picked by its scalar-prefetched slot id (the layout, its block rules and slot
0's handling are ``state.update_tpu_common``'s). A tile may lie inside one B/C group or
span several: each head takes its group's row of the whole ``[G, N]`` block."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lazyspec.kernels.common import check_tpu_tile
from lazyspec.kernels.mamba2.update import check_groups, mamba2_tile_step
from lazyspec.kernels.state.update_common import (
    Mamba2Tokens,
    StateUpdateResult,
    check_mode,
    check_pool,
)
from lazyspec.kernels.state.update_tpu_common import launch, pool_block, scan_block


def _group_rows(bc_ref, t: int, head: jax.Array, heads_per_group: int) -> jax.Array:
    """Each head's row of its B/C group at token ``t``, ``[block_heads, N]``; ``head``
    ``[block_heads, 1]`` the tile's head indices. A select per group, by comparisons only
    (no dynamic sublane index or vector division for Mosaic), exact in any dtype."""
    rows = bc_ref[t].astype(jnp.float32)  # [G, N]
    picked = jnp.zeros((head.shape[0], rows.shape[1]), jnp.float32)
    for g in range(rows.shape[0]):
        inside = (head >= g * heads_per_group) & (head < (g + 1) * heads_per_group)
        picked = jnp.where(inside, rows[g : g + 1, :], picked)
    return picked


def _mamba2_kernel(slot_ref, *refs, mode, block_heads, heads_per_group):
    """refs: x, b, c, dt, a [1, H], d [1, H], the row's pool block, the outputs, the state
    block."""
    x_ref, b_ref, c_ref, dt_ref, a_ref, d_ref, pool_ref, out_ref, state_ref = refs
    slot = slot_ref[pl.program_id(0)]
    first_head = pl.program_id(1) * block_heads
    heads = pl.ds(first_head, block_heads)
    head = first_head + jax.lax.broadcasted_iota(jnp.int32, (block_heads, 1), 0)
    h0 = pool_ref[...].astype(jnp.float32)
    a = a_ref[0, heads].astype(jnp.float32)
    d = d_ref[0, heads].astype(jnp.float32)

    def step(t, h):
        b = _group_rows(b_ref, t, head, heads_per_group)
        c = _group_rows(c_ref, t, head, heads_per_group)
        x, dt = x_ref[t].astype(jnp.float32), dt_ref[t, heads].astype(jnp.float32)
        return mamba2_tile_step(h, x, b, c, dt, a, d)

    scan_block(step, h0, mode, slot, out_ref, state_ref)


def mamba2_state_update_tpu(
    pool: jax.Array,
    slot: jax.Array,
    tokens: Mamba2Tokens,
    *,
    mode: str,
    block_heads: int = 8,
    layer: int | None = None,
    interpret: bool = False,
) -> StateUpdateResult:
    """Mamba2 update with scalar-prefetched slots (module docstring); grid (row, head tile).
    ``block_heads``: a multiple of 8 dividing the heads, or all heads (Mosaic's block rule);
    each head's B/C row is picked from the ``[T, G, N]`` block in-kernel."""
    check_mode(mode)
    batch, num_tokens, num_heads, head_dim = tokens.x.shape
    num_groups, state_dim = tokens.b.shape[2:]
    check_pool(pool, slot, (num_heads, head_dim, state_dim), layer)
    per_group = check_groups(num_heads, num_groups, 1)  # heads pick their group in-kernel
    bh = check_tpu_tile("block_heads", num_heads, min(block_heads, num_heads), 8)
    values = pl.BlockSpec((None, num_tokens, bh, head_dim), lambda b, i, s: (b, 0, i, 0))
    groups = pl.BlockSpec((None, num_tokens, num_groups, state_dim), lambda b, i, s: (b, 0, 0, 0))
    per_head = pl.BlockSpec((None, num_tokens, num_heads), lambda b, i, s: (b, 0, 0))
    vector = pl.BlockSpec((1, num_heads), lambda b, i, s: (0, 0))  # a, d as [1, H] rows
    pool_spec = pool_block(layer, (bh, head_dim, state_dim), lambda b, i, s: (s[b], i, 0, 0))
    steps_spec = pl.BlockSpec(
        (None, num_tokens, bh, head_dim, state_dim), lambda b, i, s: (b, 0, i, 0, 0)
    )

    def mamba2_update(*refs):  # the kernel's name in profiles
        _mamba2_kernel(*refs, mode=mode, block_heads=bh, heads_per_group=per_group)

    return launch(
        mamba2_update,
        mode,
        pool,
        slot,
        (batch, num_heads // bh),
        [values, groups, groups, per_head, vector, vector, pool_spec],
        (
            tokens.x,
            tokens.b,
            tokens.c,
            tokens.dt,
            tokens.a.reshape(1, -1),
            tokens.d.reshape(1, -1),
            pool,
        ),
        tokens.x,
        (values, pool_spec, steps_spec),
        interpret,
    )
