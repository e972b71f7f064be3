"""The T-step recurrent state update laid out for TPUs (Mosaic): the slot ids are
scalar-prefetched and pick each row's pool block in the BlockSpec index maps, so the
pipeline DMAs exactly the rows' states into VMEM (the Triton form in ``state_update``
indexes a whole-array pool inside the kernel, which Mosaic would stage into VMEM whole).

Same contract as ``state_update`` (decode: the final state written back to ``pool[slot[b]]``
through an aliased output; verify: the state after every token to ``[B, T, ...]`` scratch;
outputs ``[B, T, H, ...]``; the tile math is ``gdn_tile_step`` / ``mamba2_tile_step``). One
difference in how slot 0 stays untouched: a padding row's block is written back with the
values it was read with (a TPU pipeline writes every output block it visits), so slot 0
keeps its contents.

With ``layer=l`` the pool is the stacked pool of all layers and the index maps pick layer
l's rows (no copy of the layer).

Blocks follow Mosaic's rule for the last two dims (multiples of (8, 128) or whole):
``block_heads`` must be a multiple of 8 or all heads; GDN's value tile is all of d_v or a
multiple of 128; Mamba2 keeps the head dim P, state N and the B/C groups whole and needs
``block_heads`` to divide the heads of one group. Checked on CPU in interpret mode and by
lowering to Mosaic; never compiled or run on a TPU here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from lazyspec.kernels.state_update import (
    GdnTokens,
    Mamba2Tokens,
    StateUpdateResult,
    check_mode,
    check_pool,
    check_tile,
    gdn_tile_step,
    mamba2_tile_step,
    state_output,
    update_result,
)


def _check_tpu_tile(name: str, size: int, block: int | None, unit: int) -> int:
    """A tile for an axis that is a minor block dim: the whole axis or a multiple of unit."""
    block = check_tile(name, size, block)
    if block != size and block % unit:
        raise ValueError(f"{name}={block} must be {size} or a multiple of {unit} on TPU")
    return block


def _store_states(mode: str, slot, h, h0, state_ref, t: int, last: bool) -> None:
    """Verify: every step's state into its scratch block; decode: after the last token, the
    final state (or, for a padding row, the state as read) into the aliased pool block."""
    if mode == "verify":
        state_ref[t] = h.astype(state_ref.dtype)
    elif last:
        state_ref[...] = jnp.where(slot != 0, h, h0).astype(state_ref.dtype)


def _pool_block(layer: int | None, block: tuple, index_map):
    """The pool's BlockSpec: ``block`` at ``index_map``, behind a squeezed layer axis fixed
    at ``layer`` when the pool is stacked."""
    if layer is None:
        return pl.BlockSpec((None,) + block, index_map)
    return pl.BlockSpec((None, None) + block, lambda *ids: (layer,) + index_map(*ids))


def _launch(
    kernel,
    mode: str,
    pool,
    slot,
    grid,
    in_specs,
    args,
    out_like,
    out_spec,
    pool_spec,
    steps_spec,
    interpret: bool,
) -> StateUpdateResult:
    """pallas_call with the slot ids scalar-prefetched; refs (slot, *args, out, state)."""
    state_shape, state_spec = state_output(mode, pool, out_like, pool_spec, steps_spec)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=grid, in_specs=in_specs, out_specs=(out_spec, state_spec)
    )
    outputs, states = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=(jax.ShapeDtypeStruct(out_like.shape, out_like.dtype), state_shape),
        # operand 0 is the prefetched slot vector, so the pool (last arg) is len(args)
        input_output_aliases={len(args): 1} if mode == "decode" else {},
        interpret=interpret,
    )(slot.astype(jnp.int32), *args)
    return update_result(mode, outputs, states)


# ---------------------------------------------------------------- GDN


def _gdn_kernel(
    slot_ref,
    q_ref,
    k_ref,
    v_ref,
    g_ref,
    beta_ref,
    pool_ref,
    out_ref,
    state_ref,
    *,
    mode,
    block_heads,
):
    slot = slot_ref[pl.program_id(0)]
    heads = pl.ds(pl.program_id(1) * block_heads, block_heads)
    h0 = pool_ref[...].astype(jnp.float32)
    h = h0
    f32 = lambda ref, *idx: ref[idx].astype(jnp.float32)  # noqa: E731
    num_tokens = q_ref.shape[0]
    for t in range(num_tokens):
        h, out = gdn_tile_step(
            h,
            f32(q_ref, t),
            f32(k_ref, t),
            f32(v_ref, t),
            f32(g_ref, t, heads),
            f32(beta_ref, t, heads),
        )
        out_ref[t] = out.astype(out_ref.dtype)
        _store_states(mode, slot, h, h0, state_ref, t, t == num_tokens - 1)


def gdn_state_update_tpu(
    pool: jax.Array,
    slot: jax.Array,
    tokens: GdnTokens,
    *,
    mode: str,
    block_heads: int = 8,
    block_value: int | None = None,
    layer: int | None = None,
    interpret: bool = False,
) -> StateUpdateResult:
    """GDN update with scalar-prefetched slots (module docstring); grid (row, head tile,
    value tile). Decode mutates ``pool`` only through the returned (aliased) array."""
    check_mode(mode)
    batch, num_tokens, num_heads, key_dim = tokens.q.shape
    value_dim = tokens.v.shape[-1]
    check_pool(pool, slot, (num_heads, key_dim, value_dim), layer)
    bh = _check_tpu_tile("block_heads", num_heads, min(block_heads, num_heads), 8)
    bv = _check_tpu_tile("block_value", value_dim, block_value, 128)
    keys = pl.BlockSpec((None, num_tokens, bh, key_dim), lambda b, i, j, s: (b, 0, i, 0))
    values = pl.BlockSpec((None, num_tokens, bh, bv), lambda b, i, j, s: (b, 0, i, j))
    per_head = pl.BlockSpec((None, num_tokens, num_heads), lambda b, i, j, s: (b, 0, 0))
    pool_spec = _pool_block(layer, (bh, key_dim, bv), lambda b, i, j, s: (s[b], i, 0, j))
    steps_spec = pl.BlockSpec(
        (None, num_tokens, bh, key_dim, bv), lambda b, i, j, s: (b, 0, i, 0, j)
    )

    def gdn_update(*refs):  # the kernel's name in profiles
        _gdn_kernel(*refs, mode=mode, block_heads=bh)

    return _launch(
        gdn_update,
        mode,
        pool,
        slot,
        (batch, num_heads // bh, value_dim // bv),
        [keys, keys, values, per_head, per_head, pool_spec],
        (tokens.q, tokens.k, tokens.v, tokens.g, tokens.beta, pool),
        tokens.v,
        values,
        pool_spec,
        steps_spec,
        interpret,
    )


# ---------------------------------------------------------------- Mamba2


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
        _store_states(mode, slot, h, h0, state_ref, t, t == num_tokens - 1)


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
    bh = _check_tpu_tile("block_heads", num_heads, min(block_heads, num_heads), 8)
    if per_group % bh:
        raise ValueError(f"block_heads={bh} must divide the {per_group} heads per group on TPU")
    values = pl.BlockSpec((None, num_tokens, bh, head_dim), lambda b, i, s: (b, 0, i, 0))
    groups = pl.BlockSpec((None, num_tokens, num_groups, state_dim), lambda b, i, s: (b, 0, 0, 0))
    per_head = pl.BlockSpec((None, num_tokens, num_heads), lambda b, i, s: (b, 0, 0))
    vector = pl.BlockSpec((1, num_heads), lambda b, i, s: (0, 0))  # a, d as [1, H] rows
    pool_spec = _pool_block(layer, (bh, head_dim, state_dim), lambda b, i, s: (s[b], i, 0, 0))
    steps_spec = pl.BlockSpec(
        (None, num_tokens, bh, head_dim, state_dim), lambda b, i, s: (b, 0, i, 0, 0)
    )

    def mamba2_update(*refs):  # the kernel's name in profiles
        _mamba2_kernel(*refs, mode=mode, block_heads=bh, heads_per_group=per_group)

    return _launch(
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
        values,
        pool_spec,
        steps_spec,
        interpret,
    )
