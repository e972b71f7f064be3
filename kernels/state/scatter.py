"""Masked commit / checkpoint copy from the verify scratch into the state pools.

Contract. For every recurrent layer l and batch row b with ``step[b] >= 0`` and
``dst_slot[b] != 0``:
    ssm_pool[l, dst_slot[b]]  = ssm_steps[l, b, step[b]]
    conv_pool[l, dst_slot[b]] = conv_steps[l, b, step[b]]
Other rows write nothing (slot 0 is never written). Shapes: ``ssm_pool [L, S+1, H, d_a,
d_b]``, ``ssm_steps [L, R, T, H, d_a, d_b]``, ``conv_pool [L, S+1, C, K-1]``, ``conv_steps
[L, R, T, C, K-1]``, ``dst_slot`` and ``step`` ``[B]`` with B <= R (row b reads scratch row
b). Caller contract: written rows name distinct slots and ``step[b] < T`` (larger steps are
clamped to T-1). The commit of a verify step is one call with ``step = accept_len - 1``;
a checkpoint copy is another with ``step = t_cross`` or -1 where nothing crossed.
With ``layer=l`` the scratch holds that one layer (``ssm_steps [R, T, H, d_a, d_b]``,
``conv_steps [R, T, C, K-1]``) and only pool layer l is written: the engine commits layer
by layer from the update kernels' own outputs, so the scratch of all layers is never
stacked into one array (a copy of every step state).

Pallas layout: one launch for both pools and all layers, grid ``(layer, row, tile)`` where
the first ``(H / block_heads) * (d_a / block_rows)`` tiles copy a ``[block_heads,
block_rows, d_b]`` tile of the ssm state and the remaining ``C / block_channels`` tiles copy
a channel tile of the conv window (column by column, so every moved conv array is
``[block_channels]``). Pools and
scratch are whole-array refs indexed inside the kernel; the pools are aliased in place.
Untested on TPU (whole-array refs would be staged into VMEM; see ``update_common``).

``state_copy`` is the pool-to-pool form, for a decode step that updated the working slots in
place: for every layer l and row b with ``dst_slot[b] != 0``,
``pool[l, dst_slot[b]] = pool[l, src_slot[b]]`` (both pools); other rows write nothing.
Caller contract: written rows name distinct destinations, none of them a source slot of any
row. The Pallas form has the scatter's tiles and reads the source rows from the pools it
writes (aliased), so only the copied rows move; a program copies ``tiles_per_program``
consecutive tiles of its row, so a step that copies nothing launches fewer programs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lazyspec.kernels.common import check_tile, refuse_triton_shapes, triton_shape_error, whole


def _layer_view(
    ssm_pool: jax.Array, ssm_steps: jax.Array, conv_steps: jax.Array, layer: int | None
) -> tuple[int, jax.Array, jax.Array]:
    """(first pool layer written, ssm_steps, conv_steps with a leading layer axis): the
    one-layer scratch of ``layer=l`` gets a unit axis (a reshape, no copy)."""
    if layer is None:
        return 0, ssm_steps, conv_steps
    if not 0 <= layer < ssm_pool.shape[0]:
        raise ValueError(f"layer={layer} is outside the pool's {ssm_pool.shape[0]} layers")
    return layer, ssm_steps[None], conv_steps[None]


def _check_inputs(
    ssm_pool: jax.Array,
    conv_pool: jax.Array,
    ssm_steps: jax.Array,
    conv_steps: jax.Array,
    dst_slot: jax.Array,
    step: jax.Array,
    step_layers: int,
) -> None:
    """Shapes as in the module docstring, scratch with a leading axis of ``step_layers``."""
    if ssm_pool.ndim != 5 or ssm_steps.ndim != 6 or ssm_steps.shape[3:] != ssm_pool.shape[2:]:
        raise ValueError(f"ssm_steps {ssm_steps.shape} does not match ssm_pool {ssm_pool.shape}")
    if conv_pool.ndim != 4 or conv_steps.ndim != 5 or conv_steps.shape[3:] != conv_pool.shape[2:]:
        raise ValueError(
            f"conv_steps {conv_steps.shape} does not match conv_pool {conv_pool.shape}"
        )
    if ssm_pool.shape[:2] != conv_pool.shape[:2] or {ssm_steps.shape[0], conv_steps.shape[0]} != {
        step_layers
    }:
        raise ValueError(
            f"layer / slot counts differ: ssm_pool {ssm_pool.shape}, conv_pool "
            f"{conv_pool.shape}, ssm_steps {ssm_steps.shape}, conv_steps "
            f"{conv_steps.shape}"
        )
    if ssm_steps.shape[1:3] != conv_steps.shape[1:3]:
        raise ValueError(f"scratch rows/steps differ: {ssm_steps.shape} vs {conv_steps.shape}")
    rows = dst_slot.shape[0]
    if dst_slot.ndim != 1 or step.shape != dst_slot.shape or rows > ssm_steps.shape[1]:
        raise ValueError(
            f"dst_slot {dst_slot.shape} and step {step.shape} must be [B] with "
            f"B <= {ssm_steps.shape[1]}"
        )


def _checked_view(
    ssm_pool, conv_pool, ssm_steps, conv_steps, dst_slot, step, layer: int | None
) -> tuple[int, jax.Array, jax.Array]:
    """``_layer_view``, after checking the inputs (``_check_inputs``)."""
    first_layer, ssm_steps, conv_steps = _layer_view(ssm_pool, ssm_steps, conv_steps, layer)
    step_layers = ssm_pool.shape[0] if layer is None else 1
    _check_inputs(ssm_pool, conv_pool, ssm_steps, conv_steps, dst_slot, step, step_layers)
    return first_layer, ssm_steps, conv_steps


@dataclasses.dataclass(frozen=True)
class PoolBlocks:
    """The tile sizes asked of a pool copy: ``block_heads`` heads and ``block_rows`` rows of
    the state, ``block_channels`` conv channels a tile (None: the whole axis)."""

    block_heads: int = 1
    block_rows: int | None = None
    block_channels: int | None = None


DEFAULT_POOL_BLOCKS = PoolBlocks()  # a head of whole states, the whole conv window a tile


@dataclasses.dataclass(frozen=True)
class PoolTiles:
    """The tiles a row's copy is cut into: ``block_heads`` x ``block_rows`` tiles of the
    state (``num_state_tiles``, ``row_tiles`` of them a head tile), then ``block_channels``
    tiles of the conv window, ``num_tiles`` in all."""

    block_heads: int
    block_rows: int
    block_channels: int
    row_tiles: int
    num_state_tiles: int
    num_tiles: int

    @classmethod
    def of(cls, ssm_pool, conv_pool, blocks: PoolBlocks) -> PoolTiles:
        """The tiles of these pools cut as ``blocks`` asks, each size checked."""
        num_heads, state_rows, num_channels = (
            ssm_pool.shape[2],
            ssm_pool.shape[3],
            conv_pool.shape[2],
        )
        bh = check_tile("block_heads", num_heads, blocks.block_heads)
        br = check_tile("block_rows", state_rows, blocks.block_rows)
        bc = check_tile("block_channels", num_channels, blocks.block_channels)
        num_state_tiles = (num_heads // bh) * (state_rows // br)
        return cls(
            bh, br, bc, state_rows // br, num_state_tiles, num_state_tiles + num_channels // bc
        )

    def state(self, tile) -> tuple:
        """(heads, rows) of state tile ``tile``: tiles run over the rows, then the heads."""
        heads = pl.ds(jax.lax.div(tile, self.row_tiles) * self.block_heads, self.block_heads)
        rows = pl.ds(jax.lax.rem(tile, self.row_tiles) * self.block_rows, self.block_rows)
        return heads, rows

    def conv(self, tile):
        """The channels of tile ``tile``, a conv tile (the tiles after the state's)."""
        return pl.ds((tile - self.num_state_tiles) * self.block_channels, self.block_channels)


def pool_tiles_triton_error(
    kernel: str, ssm_pool: Any, conv_pool: Any, blocks: PoolBlocks
) -> str | None:
    """Why ``kernel`` (the scatter or the copy, which share their tiles) cannot run compiled
    through Triton on pools of these shapes (arrays or ``ShapeDtypeStruct``s) in tiles of
    ``blocks`` (``common.triton_shape_error``), or None: it moves ``[block_heads,
    block_rows, d_b]`` state tiles (d_b the state's whole last axis) and ``[block_channels]``
    conv columns. ValueError where a tile does not divide its axis (``PoolTiles.of``)."""
    tiles = PoolTiles.of(ssm_pool, conv_pool, blocks)
    return triton_shape_error(
        kernel,
        block_heads=tiles.block_heads,
        block_rows=tiles.block_rows,
        d_b=ssm_pool.shape[-1],
        block_channels=tiles.block_channels,
    )


def _pools_call(kernel, grid, operands: tuple, interpret: bool, compiler_params: Any):
    """``pallas_call`` of a kernel that writes the two pools, the last two operands, in
    place (aliased to its outputs); every operand whole."""
    ssm_pool, conv_pool = operands[-2:]
    last = len(operands) - 1
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole()] * len(operands),
        out_specs=(whole(), whole()),
        out_shape=(
            jax.ShapeDtypeStruct(ssm_pool.shape, ssm_pool.dtype),
            jax.ShapeDtypeStruct(conv_pool.shape, conv_pool.dtype),
        ),
        input_output_aliases={last - 1: 0, last: 1},
        interpret=interpret,
        compiler_params=compiler_params,
    )(*operands)


def _scatter_kernel(
    dst_ref,
    step_ref,
    ssm_src_ref,
    conv_src_ref,
    ssm_in_ref,
    conv_in_ref,
    ssm_ref,
    conv_ref,
    *,
    tiles: PoolTiles,
    first_layer,
):
    del ssm_in_ref, conv_in_ref  # aliased to ssm_ref / conv_ref; only written through those
    layer, row, tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    pool_layer = first_layer + layer
    dst = dst_ref[row]
    raw_step = step_ref[row]
    step = jnp.minimum(raw_step, ssm_src_ref.shape[2] - 1)
    write = (raw_step >= 0) & (dst != 0)

    @pl.when(write & (tile < tiles.num_state_tiles))
    def _copy_ssm():
        heads, rows = tiles.state(tile)
        state = ssm_src_ref[layer, row, step, heads, rows, :]
        ssm_ref[pool_layer, dst, heads, rows, :] = state.astype(ssm_ref.dtype)

    @pl.when(write & (tile >= tiles.num_state_tiles))
    def _copy_conv():
        chans = tiles.conv(tile)
        for j in range(conv_ref.shape[-1]):
            column = conv_src_ref[layer, row, step, chans, j]
            conv_ref[pool_layer, dst, chans, j] = column.astype(conv_ref.dtype)


def state_scatter_pallas(
    ssm_pool: jax.Array,
    conv_pool: jax.Array,
    ssm_steps: jax.Array,
    conv_steps: jax.Array,
    dst_slot: jax.Array,
    step: jax.Array,
    *,
    layer: int | None = None,
    blocks: PoolBlocks = DEFAULT_POOL_BLOCKS,
    interpret: bool = False,
    compiler_params: Any = None,
) -> tuple[jax.Array, jax.Array]:
    """Pallas masked copy (module docstring has the contract), in tiles of ``blocks``.
    Returns the updated (ssm_pool, conv_pool), aliased to the inputs; donate them under
    jit. Compiled, tiles Triton cannot lower are a ValueError (``pool_tiles_triton_error``)."""
    first_layer, ssm_steps, conv_steps = _checked_view(
        ssm_pool, conv_pool, ssm_steps, conv_steps, dst_slot, step, layer
    )
    tiles = PoolTiles.of(ssm_pool, conv_pool, blocks)
    error = pool_tiles_triton_error("state_scatter_pallas", ssm_pool, conv_pool, blocks)
    refuse_triton_shapes(interpret, error)
    grid = (ssm_steps.shape[0], dst_slot.shape[0], tiles.num_tiles)

    def kernel(*refs):
        _scatter_kernel(*refs, tiles=tiles, first_layer=first_layer)

    operands = (dst_slot, step, ssm_steps, conv_steps, ssm_pool, conv_pool)
    return _pools_call(kernel, grid, operands, interpret, compiler_params)


def _copy_kernel(
    src_ref,
    dst_ref,
    ssm_in_ref,
    conv_in_ref,
    ssm_ref,
    conv_ref,
    *,
    tiles: PoolTiles,
    tiles_per_program,
):
    # the in refs are the pools before the copy (aliased to the out refs): a source row is
    # never a destination, so reading them is reading what the copy leaves in place
    layer, row, group = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    src, dst = src_ref[row], dst_ref[row]

    def copy_tile(tile):
        @pl.when(tile < tiles.num_state_tiles)
        def _copy_ssm():
            heads, rows = tiles.state(tile)
            ssm_ref[layer, dst, heads, rows, :] = ssm_in_ref[layer, src, heads, rows, :]

        @pl.when((tile >= tiles.num_state_tiles) & (tile < tiles.num_tiles))
        def _copy_conv():
            chans = tiles.conv(tile)
            for j in range(conv_ref.shape[-1]):
                conv_ref[layer, dst, chans, j] = conv_in_ref[layer, src, chans, j]

    @pl.when(dst != 0)
    def _copy():
        for i in range(tiles_per_program):
            copy_tile(group * tiles_per_program + i)


def _check_copy(
    ssm_pool: jax.Array, conv_pool: jax.Array, src_slot: jax.Array, dst_slot: jax.Array
) -> None:
    if ssm_pool.ndim != 5 or conv_pool.ndim != 4 or ssm_pool.shape[:2] != conv_pool.shape[:2]:
        raise ValueError(
            f"ssm_pool {ssm_pool.shape} and conv_pool {conv_pool.shape} must be "
            "[L, S+1, H, d_a, d_b] and [L, S+1, C, K-1]"
        )
    if src_slot.ndim != 1 or src_slot.shape != dst_slot.shape:
        raise ValueError(f"src_slot {src_slot.shape} and dst_slot {dst_slot.shape} must be [B]")


def state_copy_pallas(
    ssm_pool: jax.Array,
    conv_pool: jax.Array,
    src_slot: jax.Array,
    dst_slot: jax.Array,
    *,
    blocks: PoolBlocks = DEFAULT_POOL_BLOCKS,
    tiles_per_program: int = 1,
    interpret: bool = False,
    compiler_params: Any = None,
) -> tuple[jax.Array, jax.Array]:
    """Pallas pool-to-pool copy (``state_copy`` in the module docstring), in tiles of
    ``blocks``. Returns the updated
    (ssm_pool, conv_pool), aliased to the inputs; donate them under jit.
    ``tiles_per_program``: each program copies that many consecutive tiles of its row (the
    grid's last axis shrinks as much): a step where no row copies still launches one
    program per (layer, row, tile group), each returning at once, and those launches grow
    with the batch. Compiled, tiles Triton cannot lower are a ValueError
    (``pool_tiles_triton_error``)."""
    _check_copy(ssm_pool, conv_pool, src_slot, dst_slot)
    tiles = PoolTiles.of(ssm_pool, conv_pool, blocks)
    if tiles_per_program <= 0:
        raise ValueError(f"tiles_per_program={tiles_per_program} must be positive")
    refuse_triton_shapes(
        interpret, pool_tiles_triton_error("state_copy_pallas", ssm_pool, conv_pool, blocks)
    )
    groups = -(-tiles.num_tiles // tiles_per_program)
    grid = (ssm_pool.shape[0], dst_slot.shape[0], groups)

    def state_copy(*refs):  # the kernel's name in profiles
        _copy_kernel(*refs, tiles=tiles, tiles_per_program=tiles_per_program)

    operands = (src_slot, dst_slot, ssm_pool, conv_pool)
    return _pools_call(state_copy, grid, operands, interpret, compiler_params)


def state_copy_xla(
    ssm_pool: jax.Array, conv_pool: jax.Array, src_slot: jax.Array, dst_slot: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Same contract as ``state_copy_pallas``: the source rows gathered, then one
    ``.at[].set(mode="drop")`` per pool, masked rows sent to an out-of-range slot. Under
    ``lax.cond``: a step where no row copies reads nothing."""
    _check_copy(ssm_pool, conv_pool, src_slot, dst_slot)
    write = dst_slot != 0
    target = jnp.where(write, dst_slot, ssm_pool.shape[1])

    def copy(pools):
        return tuple(pool.at[:, target].set(pool[:, src_slot], mode="drop") for pool in pools)

    return jax.lax.cond(jnp.any(write), copy, lambda pools: pools, (ssm_pool, conv_pool))


def state_scatter_xla(
    ssm_pool: jax.Array,
    conv_pool: jax.Array,
    ssm_steps: jax.Array,
    conv_steps: jax.Array,
    dst_slot: jax.Array,
    step: jax.Array,
    layer: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Same contract as ``state_scatter_pallas``: one ``.at[].set(mode="drop")`` per pool,
    masked rows sent to an out-of-range slot."""
    first_layer, ssm_steps, conv_steps = _checked_view(
        ssm_pool, conv_pool, ssm_steps, conv_steps, dst_slot, step, layer
    )
    layers = slice(None) if layer is None else slice(first_layer, first_layer + 1)
    rows = jnp.arange(dst_slot.shape[0])
    picked_step = jnp.clip(step, 0, ssm_steps.shape[2] - 1)
    target = jnp.where((step >= 0) & (dst_slot != 0), dst_slot, ssm_pool.shape[1])

    def commit(pool: jax.Array, steps: jax.Array) -> jax.Array:
        return pool.at[layers, target].set(
            steps[:, rows, picked_step].astype(pool.dtype), mode="drop"
        )

    return commit(ssm_pool, ssm_steps), commit(conv_pool, conv_steps)
