"""Causal depthwise conv for T new tokens per row against the conv pool: Pallas and XLA forms.

Contract. Row b reads its window from ``pool[slot[b]]`` (pool ``[num_slots + 1, C, K-1]``,
the raw inputs of the last K-1 tokens, oldest first, in the pool's dtype) and runs
``conv_step`` over its T tokens ``x [B, T, C]``, giving outputs ``[B, T, C]``
(float32 math, silu unless ``silu=False``, stored in ``out_dtype``, default x's dtype).
``slot[b] == 0`` marks a padding row (outputs from slot 0, nothing written); real rows name
distinct slots. Modes as in the state update (``update_common``): decode writes the final
window back into ``pool[slot[b]]`` in place (aliased), verify leaves the pool alone and
returns the window after every token, ``step_windows [B, T, C, K-1]``. With ``num_new``
``[B]``, tokens t >= num_new[b] leave the window as it is (``conv_scan``'s ``valid``; their
outputs are still computed). With ``layer=l`` the pool is the stacked pool of all recurrent layers
(``[L, num_slots + 1, C, K-1]``) and layer l's windows are read and, in decode, written in
place: the engine's decode step hands its pools over as they are, as it does to the state
update.

Pallas layout: grid ``(row, channel tile)``. The window is held as K-1 column vectors of
``block_channels`` each, so every load and store is a 1-D ``[block_channels]`` array
(Triton needs power-of-two sizes and K-1 = 3 is not). Untested on TPU: blocks keep their
last two dims full or aligned when ``block_channels`` is C or a multiple of 128, but the
whole-array pool would be staged into VMEM (see ``update_common``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lazyspec.kernels.common import check_tile, refuse_triton_shapes, triton_shape_error, whole
from lazyspec.kernels.state.update_common import check_mode, pool_index, xla_write_back

# ---------------------------------------------------------------- reference
# One row, float32 math; the reference every faster form is checked against. Per row: window
# [C, K-1] of the raw (pre-conv) inputs of the last K-1 tokens, oldest first; x [C]; weight
# [C, K] (weight[:, K-1] multiplies the newest token); bias [C] or None. A ``valid`` mask
# marks real tokens: a padding token leaves the window unchanged.


def conv_step(window, x, weight, bias=None, silu: bool = True):
    """One token through the causal depthwise conv. Returns (new window, output [C])."""
    full = jnp.concatenate([window, x[:, None].astype(window.dtype)], axis=1)  # [C, K]
    y = jnp.sum(full.astype(jnp.float32) * weight.astype(jnp.float32), axis=1)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    if silu:
        y = jax.nn.silu(y)
    return full[:, 1:], y


def conv_scan(window0, x, weight, bias=None, valid=None, silu: bool = True):
    """Token-by-token causal conv over T tokens ([T, C] inputs).

    Returns (outputs [T, C], final window, window after every token [T, C, K-1]).
    """
    num_tokens = x.shape[0]
    if valid is None:
        valid = jnp.ones((num_tokens,), dtype=bool)

    def body(window, xs):
        x_t, ok = xs
        new_window, y = conv_step(window, x_t, weight, bias, silu)
        new_window = jnp.where(ok, new_window, window)
        return new_window, (y, new_window)

    final, (ys, windows) = jax.lax.scan(body, window0, (x, valid))
    return ys, final, windows


# ---------------------------------------------------------------- Pallas and XLA forms


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ConvUpdateResult:
    """outputs [B, T, C]; pool: updated pool (decode) or None; step_windows [B, T, C, K-1]
    (verify) or None."""

    outputs: jax.Array
    pool: jax.Array | None
    step_windows: jax.Array | None


@dataclasses.dataclass(frozen=True)
class ChannelGroups:
    """Conv channels read in place from an input grouped per head, as Qwen3-Next's
    ``in_proj_qkvz`` gives them: x ``[B, T, groups * stride]`` holds, for each group g,
    ``parts[0]`` columns of the first part, then ``parts[1]`` of the second, ... (columns
    past ``sum(parts)`` of a group are not conv channels); the conv channels are part 0 of
    every group, then part 1 of every group, and so on (``C = groups * sum(parts)``)."""

    groups: int
    parts: tuple[int, ...]

    @property
    def channels(self) -> int:
        return self.groups * sum(self.parts)

    def check(self, width: int) -> int:
        """The group stride of an input ``width`` wide; ValueError unless it fits."""
        stride = width // self.groups
        if stride * self.groups != width or stride < sum(self.parts):
            raise ValueError(
                f"an input {width} wide does not hold {self.groups} groups of parts {self.parts}"
            )
        return stride

    def gather(self, x: jax.Array) -> jax.Array:
        """x's conv channels ``[..., C]`` in conv order (the XLA form: slices and a copy)."""
        grouped = x.reshape(*x.shape[:-1], self.groups, self.check(x.shape[-1]))
        starts = [sum(self.parts[:p]) for p in range(len(self.parts))]
        pieces = [grouped[..., s : s + n] for s, n in zip(starts, self.parts)]
        return jnp.concatenate([p.reshape(*x.shape[:-1], -1) for p in pieces], axis=-1)

    def tile_index(self, tile: jax.Array, block: int, stride: int) -> jax.Array:
        """The input's column tile (in ``block``-wide units) holding conv channel tile
        ``tile``; ``block`` divides every part and the stride."""
        column, region_start, part_start = jnp.int32(0), 0, 0
        for size in self.parts:
            per_group = size // block
            within = tile - region_start
            group = jax.lax.div(within, per_group)
            here = group * (stride // block) + part_start // block + within - group * per_group
            column = jnp.where(within >= 0, here, column)
            region_start += self.groups * per_group
            part_start += size
        return column


@dataclasses.dataclass(frozen=True)
class ConvOptions:
    """What a conv update does besides its operands (module contract): ``mode``, SiLU on
    the outputs or not, the stacked pool's ``layer``, the outputs' dtype (None: x's) and
    ``channel_groups`` (x grouped so: the Pallas form reads each channel tile where it sits,
    the XLA form gathers the channels into conv order first)."""

    mode: str
    silu: bool = True
    layer: int | None = None
    out_dtype: Any = None
    channel_groups: ChannelGroups | None = None


def conv_tile_step(
    columns: list[jax.Array],
    x: jax.Array,
    weight_columns: list[jax.Array],
    bias: jax.Array,
    silu: bool = True,
) -> tuple[list[jax.Array], jax.Array]:
    """``conv_step`` on a channel tile with the window as K-1 column vectors.

    columns: K-1 arrays [bc] in the window dtype, oldest first; x [bc]; weight_columns: K
    arrays [bc] (the last multiplies x); bias [bc] float32. Returns (new columns, y [bc])."""
    newest = x.astype(columns[0].dtype) if columns else x
    taps = list(columns) + [newest]
    # taps oldest first, then the bias: ``conv_step``'s order of additions
    products = [
        tap.astype(jnp.float32) * w.astype(jnp.float32) for tap, w in zip(taps, weight_columns)
    ]
    y = products[0]
    for product in products[1:]:
        y = y + product
    y = y + bias
    if silu:
        y = y / (1.0 + jnp.exp(-y))
    return taps[1:], y


def _check_inputs(
    pool: jax.Array,
    slot: jax.Array,
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    num_new: jax.Array | None,
    options: ConvOptions,
) -> tuple[int, int]:
    """ValueError unless the mode and the shapes fit the contract; returns (C, K-1)."""
    check_mode(options.mode)
    layer, channel_groups = options.layer, options.channel_groups
    lead = 0 if layer is None else 1
    x_channels = x.shape[-1] if channel_groups is None else channel_groups.channels
    if channel_groups is not None:
        channel_groups.check(x.shape[-1])
    if pool.ndim != 3 + lead or x.ndim != 3 or x_channels != pool.shape[1 + lead]:
        want = "[S+1, C, K-1]" if layer is None else "[L, S+1, C, K-1]"
        raise ValueError(f"pool {pool.shape} and x {x.shape} must be {want} and [B, T, C]")
    if layer is not None and not 0 <= layer < pool.shape[0]:
        raise ValueError(f"layer={layer} is outside the pool's {pool.shape[0]} layers")
    channels, width = pool.shape[1 + lead :]
    if weight.shape != (channels, width + 1):
        raise ValueError(f"weight shape {weight.shape} must be (C, K) = {(channels, width + 1)}")
    if bias is not None and bias.shape != (channels,):
        raise ValueError(f"bias shape {bias.shape} must be ({channels},)")
    if slot.shape != (x.shape[0],):
        raise ValueError(f"slot shape {slot.shape} must be ({x.shape[0]},)")
    if num_new is not None and num_new.shape != (x.shape[0],):
        raise ValueError(f"num_new shape {num_new.shape} must be ({x.shape[0]},)")
    return channels, width


def every_token_new(x: jax.Array) -> jax.Array:
    """``num_new`` when none is given: all T tokens of each row of ``x [B, T, C]``."""
    return jnp.full((x.shape[0],), x.shape[1], jnp.int32)


def _conv_kernel(*refs, mode, block_channels, silu, layer):
    """refs: slot, num_new, x, weight, bias, the pool, the outputs, the windows' output."""
    slot_ref, num_new_ref, x_ref, weight_ref, bias_ref, pool_ref, out_ref, window_ref = refs
    row = pl.program_id(0)
    slot, num_new = slot_ref[row], num_new_ref[row]
    chans = pl.ds(pl.program_id(1) * block_channels, block_channels)
    width = weight_ref.shape[1] - 1
    columns = [pool_ref[pool_index(layer, slot, chans, j)] for j in range(width)]
    weights = [weight_ref[:, j] for j in range(width + 1)]
    bias = bias_ref[...].astype(jnp.float32)
    for t in range(x_ref.shape[0]):
        stepped, y = conv_tile_step(columns, x_ref[t], weights, bias, silu)
        columns = [jnp.where(t < num_new, new, old) for new, old in zip(stepped, columns)]
        out_ref[t] = y.astype(out_ref.dtype)
        if mode == "verify":
            for j in range(width):
                window_ref[t, :, j] = columns[j].astype(window_ref.dtype)
    if mode == "decode":

        @pl.when(slot != 0)
        def _write_back():
            for j in range(width):
                window_ref[pool_index(layer, slot, chans, j)] = columns[j].astype(window_ref.dtype)


def conv_triton_error(block_channels: int) -> str | None:
    """Why ``conv_update_pallas`` cannot run compiled through Triton in tiles of
    ``block_channels`` (``common.triton_shape_error``), or None: every array its body moves
    is a ``[block_channels]`` column, so that is its one block dim (T and K-1 only index)."""
    return triton_shape_error("conv_update_pallas", block_channels=block_channels)


def conv_update_pallas(
    pool: jax.Array,
    slot: jax.Array,
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None = None,
    num_new: jax.Array | None = None,
    *,
    options: ConvOptions,
    block_channels: int | None = None,
    interpret: bool = False,
    compiler_params: Any = None,
) -> ConvUpdateResult:
    """Pallas conv update (module docstring has the contract). Decode mutates ``pool`` only
    through the returned (aliased) array. With ``options.channel_groups`` each channel tile
    is read where it sits in x (``block_channels`` must divide every part and the group
    stride); outputs and windows are in conv order. Compiled (``interpret`` false), a
    ``block_channels`` that is not a power of two is a ValueError (``conv_triton_error``)."""
    channels, width = _check_inputs(pool, slot, x, weight, bias, num_new, options)
    mode, channel_groups = options.mode, options.channel_groups
    batch, num_tokens, _ = x.shape
    bc = check_tile("block_channels", channels, block_channels)
    refuse_triton_shapes(interpret, conv_triton_error(bc))
    if bias is None:
        bias = jnp.zeros((channels,), jnp.float32)  # y + 0.0 == y: same result as no bias
    if num_new is None:
        num_new = every_token_new(x)
    tokens = pl.BlockSpec((None, num_tokens, bc), lambda b, j: (b, 0, j))
    x_spec = tokens
    if channel_groups is not None:
        stride = channel_groups.check(x.shape[-1])
        if any(size % bc for size in (*channel_groups.parts, stride)):
            raise ValueError(
                f"block_channels={bc} must divide the parts {channel_groups.parts} and the "
                f"group stride {stride}"
            )
        x_spec = pl.BlockSpec(
            (None, num_tokens, bc),
            lambda b, j: (b, 0, channel_groups.tile_index(j, bc, stride)),
        )
    if mode == "decode":
        window_shape, window_spec = jax.ShapeDtypeStruct(pool.shape, pool.dtype), whole()
    else:
        window_shape = jax.ShapeDtypeStruct((batch, num_tokens, channels, width), pool.dtype)
        window_spec = pl.BlockSpec((None, num_tokens, bc, width), lambda b, j: (b, 0, j, 0))

    def kernel(*refs):
        _conv_kernel(*refs, mode=mode, block_channels=bc, silu=options.silu, layer=options.layer)

    outputs, windows = pl.pallas_call(
        kernel,
        grid=(batch, channels // bc),
        in_specs=[
            whole(),
            whole(),
            x_spec,
            pl.BlockSpec((bc, width + 1), lambda b, j: (j, 0)),
            pl.BlockSpec((bc,), lambda b, j: (j,)),
            whole(),
        ],
        out_specs=(tokens, window_spec),
        out_shape=(
            jax.ShapeDtypeStruct((batch, num_tokens, channels), options.out_dtype or x.dtype),
            window_shape,
        ),
        input_output_aliases={5: 1} if mode == "decode" else {},
        interpret=interpret,
        compiler_params=compiler_params,
    )(slot, num_new.astype(jnp.int32), x, weight, bias, pool)
    if mode == "decode":
        return ConvUpdateResult(outputs=outputs, pool=windows, step_windows=None)
    return ConvUpdateResult(outputs=outputs, pool=None, step_windows=windows)


def conv_update_xla(
    pool: jax.Array,
    slot: jax.Array,
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None = None,
    num_new: jax.Array | None = None,
    *,
    options: ConvOptions,
) -> ConvUpdateResult:
    """Same contract as ``conv_update_pallas``: gather, vmapped ``conv_scan``, masked scatter
    (``options.channel_groups``: the channels gathered into conv order first)."""
    _check_inputs(pool, slot, x, weight, bias, num_new, options)
    mode, layer, silu = options.mode, options.layer, options.silu
    if options.channel_groups is not None:
        x = options.channel_groups.gather(x)
    if num_new is None:
        num_new = every_token_new(x)
    valid = jnp.arange(x.shape[1])[None, :] < num_new[:, None]

    def one_row(window, row_x, row_valid):
        return conv_scan(window, row_x, weight, bias, row_valid, silu=silu)

    layer_pool = pool if layer is None else pool[layer]
    outputs, final, windows = jax.vmap(one_row)(layer_pool[slot], x, valid)
    outputs = outputs.astype(options.out_dtype or x.dtype)
    if mode == "decode":
        new_pool = xla_write_back(pool, slot, final, layer)
        return ConvUpdateResult(outputs=outputs, pool=new_pool, step_windows=None)
    return ConvUpdateResult(outputs=outputs, pool=None, step_windows=windows.astype(pool.dtype))
