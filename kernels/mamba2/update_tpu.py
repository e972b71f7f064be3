"""Mamba2's TPU (Mosaic) state update: ``mamba2_tile_step`` over a head tile that lies in
one B/C group, the row's pool block picked by its scalar-prefetched slot id (the layout,
its block rules and slot 0's handling are ``state.update_tpu_common``'s)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lazyspec.kernels.common import check_tpu_tile
from lazyspec.kernels.mamba2.update import mamba2_tile_step
from lazyspec.kernels.state.update_common import (
    Mamba2Tokens,
    StateUpdateResult,
    check_mode,
    check_pool,
)
from lazyspec.kernels.state.update_tpu_common import launch, pool_block, store_states


def _group_row(bc_ref, t: int, pick: jax.Array, block_heads: int) -> jax.Array:
    """Row ``t`` of the tile's B/C group, ``[block_heads, N]``: the ``[G, N]`` block masked by
    the one-hot ``pick [G, 1]`` and summed (no dynamic sublane index for Mosaic)."""
    row = jnp.sum(bc_ref[t].astype(jnp.float32) * pick, axis=0)
    return jnp.broadcast_to(row[None, :], (block_heads, row.shape[0]))


def _mamba2_kernel(
    slot_ref,
    x_ref,
    b_ref,
    c_ref,
    dt_ref,
    a_ref,
    d_ref,
    pool_ref,
    out_ref,
    state_ref,
    *,
    mode,
    block_heads,
    heads_per_group,
):
    slot = slot_ref[pl.program_id(0)]
    first_head = pl.program_id(1) * block_heads
    heads = pl.ds(first_head, block_heads)
    group = jax.lax.div(first_head, heads_per_group)
    pick = jax.lax.broadcasted_iota(jnp.int32, (b_ref.shape[1], 1), 0) == group
    pick = pick.astype(jnp.float32)
    h0 = pool_ref[...].astype(jnp.float32)
    h = h0
    a = a_ref[0, heads].astype(jnp.float32)
    d = d_ref[0, heads].astype(jnp.float32)
    num_tokens = x_ref.shape[0]
    for t in range(num_tokens):
        b = _group_row(b_ref, t, pick, block_heads)
        c = _group_row(c_ref, t, pick, block_heads)
        h, y = mamba2_tile_step(
            h, x_ref[t].astype(jnp.float32), b, c, dt_ref[t, heads].astype(jnp.float32), a, d
        )
        out_ref[t] = y.astype(out_ref.dtype)
        store_states(mode, slot, h, h0, state_ref, t, t == num_tokens - 1)


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
    A head tile lies inside one B/C group (picked from the ``[T, G, N]`` block in-kernel)."""
    check_mode(mode)
    batch, num_tokens, num_heads, head_dim = tokens.x.shape
    num_groups, state_dim = tokens.b.shape[2:]
    check_pool(pool, slot, (num_heads, head_dim, state_dim), layer)
    if num_groups <= 0 or num_heads % num_groups:
        raise ValueError(f"num_groups={num_groups} must divide num_heads={num_heads}")
    per_group = num_heads // num_groups
    bh = check_tpu_tile("block_heads", num_heads, min(block_heads, num_heads), 8)
    if per_group % bh:
        raise ValueError(f"block_heads={bh} must divide the {per_group} heads per group on TPU")
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
