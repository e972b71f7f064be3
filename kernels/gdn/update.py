"""The GDN recurrent state update for a padded batch of T new tokens a row: the Pallas
(Triton layout) kernel and the XLA form, with the contract, records and launch of
``state.update_common``. The TPU (Mosaic) layout is ``update_tpu``; the math is
``reference.gdn_step`` / ``gdn_scan``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lazyspec.kernels.common import check_tile, powers_of_two, triton_shape_error, whole
from lazyspec.kernels.gdn.reference import gdn_scan, l2_normalize
from lazyspec.kernels.norm.gated import gated_rows
from lazyspec.kernels.state.update_common import (
    DEFAULT_UPDATE_TILES,
    GdnConvTokens,
    GdnTokens,
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


def gdn_tile_step(
    h: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``reference.gdn_step`` on a tile: h [bh, d_k, bv], q, k [bh, d_k], v [bh, bv],
    g, beta [bh]. Written with broadcasts and sums only, so it lowers without batched dots."""
    h = h * jnp.exp(g)[:, None, None]
    predicted = jnp.sum(h * k[:, :, None], axis=1)
    delta = (v - predicted) * beta[:, None]
    h = h + k[:, :, None] * delta[:, None, :]
    return h, jnp.sum(h * q[:, :, None], axis=1)


# ---------------------------------------------------------------- Pallas


def _f32(ref, *idx) -> jax.Array:
    return ref[idx].astype(jnp.float32)


def _conv_token_loader(refs, heads, block_heads, per_key):
    """``GdnConvTokens``' per-token tiles, finished as ``GdnTokens`` holds them: refs are q,
    k (the tile's one key head), v, a, b, a_log, dt_bias, num_new. ``per_key`` (value heads
    per key head) given: a and b are the grouped projection (``GdnConvTokens.grouped``), the
    tile's columns found in it (a tile's heads share one key head)."""
    q_ref, k_ref, v_ref, a_ref, b_ref, a_log_ref, dt_bias_ref, num_new_ref = refs
    decay = -jnp.exp(_f32(a_log_ref, heads))
    dt_bias = _f32(dt_bias_ref, heads)
    num_new = num_new_ref[pl.program_id(0)]
    width = q_ref.shape[-1]
    a_cols = b_cols = heads
    if per_key is not None:  # key head h // per_key holds [b of its heads, a of its heads]
        first = pl.program_id(1) * block_heads
        b_start = first + jax.lax.div(first, per_key) * per_key
        b_cols = pl.ds(b_start, block_heads)
        a_cols = pl.ds(b_start + per_key, block_heads)

    def token(t):
        q = l2_normalize(_f32(q_ref, t)) * width**-0.5
        k = l2_normalize(_f32(k_ref, t))
        live = t < num_new
        g = jnp.where(live, decay * jax.nn.softplus(_f32(a_ref, t, a_cols) + dt_bias), 0.0)
        beta = jnp.where(live, jax.nn.sigmoid(_f32(b_ref, t, b_cols)), 0.0)
        repeat = (block_heads, width)
        return jnp.broadcast_to(q, repeat), jnp.broadcast_to(k, repeat), _f32(v_ref, t), g, beta

    return token


def _gdn_kernel(slot_ref, *refs, mode, tiles: UpdateTiles, layer, per_key, norm=None):
    """refs: q, k, v, g, beta (``GdnTokens``) or ``_conv_token_loader``'s eight (then, with
    ``norm`` = (eps, dtype) of an ``OutputNorm``, the head's gate block and the norm's
    weight), then the pool, the outputs and the state output."""
    pool_ref, out_ref, state_ref = refs[-3:]
    slot = slot_ref[pl.program_id(0)]
    block_heads = tiles.block_heads
    heads = pl.ds(pl.program_id(1) * block_heads, block_heads)
    cols = pl.ds(pl.program_id(2) * tiles.block_value, tiles.block_value)
    tile = pool_index(layer, slot, heads, slice(None), cols)
    h = load_tile(pool_ref, tile, slot, tiles)
    if len(refs) == 8:
        q_ref, k_ref, v_ref, g_ref, beta_ref = refs[:5]

        def token(t):
            return (
                _f32(q_ref, t),
                _f32(k_ref, t),
                _f32(v_ref, t),
                _f32(g_ref, t, heads),
                _f32(beta_ref, t, heads),
            )

    else:
        token = _conv_token_loader(refs[:8], heads, block_heads, per_key)

    def step(t, h):
        h, out = gdn_tile_step(h, *token(t))
        if norm is not None:  # [1, d]: the head's whole row
            z_ref, weight_ref = refs[8:10]
            eps, dtype = norm
            out = gated_rows(out, z_ref[t][None, :], weight_ref[...], eps=eps, dtype=dtype)
        return h, out

    scan_tokens(step, h, mode, slot, tile, out_ref, state_ref)


def _conv_token_specs(tokens: GdnConvTokens, block_heads: int, block_value: int):
    """(in specs, arrays) of ``GdnConvTokens`` for the grid ``(row, head tile, value
    tile)``: q and k blocks of the tile's key head and the v block straight out of the conv
    output (viewed ``[B, T, heads, d]``, a reshape), the rest whole."""
    batch, num_tokens, _ = tokens.conv_out.shape
    num_k, num_v, width = tokens.num_k_heads, tokens.num_v_heads, tokens.head_dim
    per_key = num_v // num_k
    if (2 * num_k + num_v) * width != tokens.conv_out.shape[-1] or num_v % num_k:
        raise ValueError(
            f"conv_out {tokens.conv_out.shape} must hold {num_k} q, {num_k} k and {num_v} v "
            "heads of one width, the value heads a multiple of the key heads"
        )
    gate_width = 2 * num_v if tokens.gates_per_key else num_v
    for name in ("a", "b"):
        if getattr(tokens, name).shape != (batch, num_tokens, gate_width):
            raise ValueError(
                f"{name} {getattr(tokens, name).shape} must be {(batch, num_tokens, gate_width)}"
            )
    if per_key % block_heads or (2 * num_k) % block_heads:
        raise ValueError(f"block_heads={block_heads} must divide {per_key} and {2 * num_k}")
    heads = tokens.conv_out.reshape(batch, num_tokens, -1, width)
    key = lambda first: pl.BlockSpec(  # noqa: E731
        (None, num_tokens, 1, width),
        lambda b, i, j: (b, 0, first + jax.lax.div(i * block_heads, per_key), 0),
    )
    first_v = 2 * num_k // block_heads
    values = pl.BlockSpec(
        (None, num_tokens, block_heads, block_value), lambda b, i, j: (b, 0, first_v + i, j)
    )
    per_head = pl.BlockSpec((None, num_tokens, gate_width), lambda b, i, j: (b, 0, 0))
    specs = [key(0), key(num_k), values, per_head, per_head, whole(), whole(), whole()]
    arrays = (heads, heads, heads, tokens.a, tokens.b, tokens.a_log, tokens.dt_bias)
    arrays += (tokens.num_new.astype(jnp.int32),)
    if tokens.norm is not None:  # head i's gate block (one head a tile), the weight whole
        layout = tokens.norm.layout
        per_group, group_width, offset = layout.heads_per_group, layout.group_width, layout.offset

        def gate_block(b, i, j):
            group, slot = jax.lax.div(i, per_group), jax.lax.rem(i, per_group)
            return b, 0, (group * group_width + offset) // width + slot

        specs += [pl.BlockSpec((None, num_tokens, width), gate_block), whole()]
        arrays += (tokens.norm.z_source, tokens.norm.weight)
    return specs, arrays


def _check_output_norm(tokens: GdnConvTokens, block_heads: int, block_value: int) -> None:
    """ValueError unless the kernel can apply ``tokens.norm``: a program a whole head, and
    the gates where the layout puts them, in whole head-wide blocks."""
    norm, width = tokens.norm, tokens.head_dim
    batch, num_tokens = tokens.conv_out.shape[:2]
    if block_heads != 1 or block_value != width:
        raise ValueError(
            f"the output norm needs a program a head: block_heads={block_heads} must be 1 "
            f"and block_value={block_value} the head's {width}"
        )
    layout, heads = norm.layout, tokens.num_v_heads
    groups, rest = divmod(heads, layout.heads_per_group)
    z_shape = (batch, num_tokens, groups * layout.group_width)
    inside = layout.offset + layout.heads_per_group * width <= layout.group_width
    if rest or not inside or not layout.in_whole_blocks(width) or norm.z_source.shape != z_shape:
        raise ValueError(f"{layout} does not place {heads} gates of {width} in {z_shape}")
    if norm.weight.shape != (width,):
        raise ValueError(f"the output norm's weight {norm.weight.shape} must be [{width}]")


def gdn_triton_error(state_shape: tuple[int, ...], tiles: UpdateTiles) -> str | None:
    """Why ``gdn_state_update_pallas`` cannot run compiled through Triton on states of
    ``state_shape`` (H, d_k, d_v) in ``tiles`` (``common.triton_shape_error``), or None: it
    computes on ``[block_heads, d_k, block_value]`` state tiles with ``[block_heads, d_k]``
    keys (d_k whole; the head width of ``GdnConvTokens`` and of their output norm).
    ValueError where a tile does not divide its axis."""
    num_heads, key_dim, value_dim = state_shape
    return triton_shape_error(
        "gdn_state_update_pallas",
        block_heads=check_tile("block_heads", num_heads, tiles.block_heads),
        d_k=key_dim,
        block_value=check_tile("block_value", value_dim, tiles.block_value),
    )


def conv_tokens_fit(key_dim: int, value_dim: int) -> bool:
    """Whether the Triton-layout kernel takes ``GdnConvTokens`` of heads ``key_dim`` keys by
    ``value_dim`` values wide, compiled as in interpret mode: one head width (the tokens
    hold q, k and v heads of one width) that Triton can lower (a power of two: the tokens'
    tiles and the output norm's span whole heads). Elsewhere the layer hands ``GdnTokens``."""
    return key_dim == value_dim and powers_of_two(key_dim)


def never_conv_tokens(key_dim: int, value_dim: int) -> bool:
    """The TPU layout's answer: it takes no ``GdnConvTokens``."""
    return False


def gdn_state_update_pallas(
    pool: jax.Array,
    slot: jax.Array,
    tokens: GdnTokens | GdnConvTokens,
    *,
    mode: str,
    layer: int | None = None,
    tiles: UpdateTiles = DEFAULT_UPDATE_TILES,
    interpret: bool = False,
    compiler_params: Any = None,
) -> StateUpdateResult:
    """Pallas GDN update (module docstring has the contract), split and loaded as
    ``tiles`` say. Decode mutates ``pool`` only through the returned (aliased) array.
    Compiled, shapes Triton cannot lower are a ValueError (``gdn_triton_error``)."""
    check_mode(mode)
    if isinstance(tokens, GdnConvTokens):
        batch, num_tokens, _ = tokens.conv_out.shape
        num_heads, key_dim = tokens.num_v_heads, tokens.head_dim
        value_dim = key_dim
    else:
        batch, num_tokens, num_heads, key_dim = tokens.q.shape
        value_dim = tokens.v.shape[-1]
    state_shape = (num_heads, key_dim, value_dim)
    launched = launch_tiles(
        pool, slot, state_shape, layer, mode, tiles, gdn_triton_error, interpret, value_axis=2
    )
    bh, bv = launched.block_heads, launched.block_value
    values = pl.BlockSpec((None, num_tokens, bh, bv), lambda b, i, j: (b, 0, i, j))
    per_key = norm = None
    if isinstance(tokens, GdnConvTokens):
        token_specs, token_arrays = _conv_token_specs(tokens, bh, bv)
        if tokens.gates_per_key:
            per_key = num_heads // tokens.num_k_heads
        out_dtype = jnp.float32
        if tokens.norm is not None:
            _check_output_norm(tokens, bh, bv)
            norm, out_dtype = (tokens.norm.eps, tokens.norm.dtype), tokens.norm.dtype
        out_like = jax.ShapeDtypeStruct((batch, num_tokens, num_heads, value_dim), out_dtype)
    else:
        keys = pl.BlockSpec((None, num_tokens, bh, key_dim), lambda b, i, j: (b, 0, i, 0))
        per_head = pl.BlockSpec((None, num_tokens, num_heads), lambda b, i, j: (b, 0, 0))
        token_specs = [keys, keys, values, per_head, per_head]
        token_arrays = (tokens.q, tokens.k, tokens.v, tokens.g, tokens.beta)
        out_like = tokens.v

    def gdn_update(*refs):  # the kernel's name in profiles
        _gdn_kernel(*refs, mode=mode, tiles=launched, layer=layer, per_key=per_key, norm=norm)

    return run_update(
        gdn_update,
        mode,
        pool,
        (batch, num_heads // bh, value_dim // bv),
        [whole(), *token_specs, whole()],
        (slot, *token_arrays, pool),
        out_like,
        values,
        pl.BlockSpec((None, num_tokens, bh, key_dim, bv), lambda b, i, j: (b, 0, i, 0, j)),
        {"interpret": interpret, "compiler_params": compiler_params},
    )


# ---------------------------------------------------------------- XLA


def gdn_state_update_xla(
    pool: jax.Array, slot: jax.Array, tokens: GdnTokens, *, mode: str, layer: int | None = None
) -> StateUpdateResult:
    """Same contract as ``gdn_state_update_pallas``: gather, vmapped ``gdn_scan``, masked
    scatter."""
    check_mode(mode)
    check_pool(pool, slot, (tokens.q.shape[2], tokens.q.shape[3], tokens.v.shape[3]), layer)
    inputs = (tokens.q, tokens.k, tokens.v, tokens.g, tokens.beta)
    return xla_update(
        jax.vmap(gdn_scan), pool, slot, inputs, mode=mode, layer=layer, out_dtype=tokens.v.dtype
    )
