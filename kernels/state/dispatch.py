"""The state-pool kernels by backend: the GDN and Mamba2 T-step updates (``gdn.update``,
``mamba2.update``), the conv update, the scatter of verify steps' states and the
pool-to-pool copy, each with its tiles from a ``Tuning``. The contracts are those of the
functions called (``state.update_common``, ``state.conv``, ``state.scatter``). A compiled
Pallas launch (Triton) is made only where every block dim the kernel creates is a power of
two (each kernel's ``*_triton_error``); elsewhere the launcher runs the XLA form, as the
attention and norm dispatches do. Interpret mode runs any shape."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from lazyspec.kernels.common import (
    fitted_tile,
    on_platform,
    pallas_options,
    resolve_backend,
    small_step_tile,
    tpu_head_tile,
)
from lazyspec.kernels.gdn.update import (
    gdn_state_update_pallas,
    gdn_state_update_xla,
    gdn_triton_error,
)
from lazyspec.kernels.mamba2.update import (
    mamba2_state_update_pallas,
    mamba2_state_update_xla,
    mamba2_triton_error,
)
from lazyspec.kernels.state.conv import (
    ConvOptions,
    ConvUpdateResult,
    conv_triton_error,
    conv_update_pallas,
    conv_update_xla,
)
from lazyspec.kernels.state.scatter import (
    PoolBlocks,
    pool_tiles_triton_error,
    state_copy_pallas,
    state_copy_xla,
    state_scatter_pallas,
    state_scatter_xla,
)
from lazyspec.kernels.state.update_common import (
    GdnConvTokens,
    GdnTokens,
    Mamba2Tokens,
    StateUpdateResult,
    UpdateTiles,
)
from lazyspec.kernels.tuning import DEFAULT_TUNING, Tuning

_XLA_UPDATES = {"gdn": gdn_state_update_xla, "mamba2": mamba2_state_update_xla}
_PALLAS_UPDATES = {"gdn": gdn_state_update_pallas, "mamba2": mamba2_state_update_pallas}
_TRITON_ERRORS = {"gdn": gdn_triton_error, "mamba2": mamba2_triton_error}


def mixer_of(tokens: GdnTokens | GdnConvTokens | Mamba2Tokens) -> str:
    if isinstance(tokens, (GdnTokens, GdnConvTokens)):
        return "gdn"
    if isinstance(tokens, Mamba2Tokens):
        return "mamba2"
    raise ValueError(f"tokens must be GdnTokens or Mamba2Tokens, got {type(tokens).__name__}")


def tpu_state_update(
    mixer: str, *operands: Any, interpret: Any = False, tuning: Tuning = DEFAULT_TUNING, **call: Any
) -> StateUpdateResult:
    """The scalar-prefetch kernels of ``gdn.update_tpu`` / ``mamba2.update_tpu`` on
    ``operands`` (pool, slot, tokens; ``call``: mode, layer) with the mixer's
    ``tpu_block_heads`` fitted to the heads (``common.tpu_head_tile``); where no tile fits,
    the XLA scan (same contract). ``interpret``: as ``common.tpu_interpret``."""
    record = tuning.gdn if mixer == "gdn" else tuning.mamba2
    tokens = operands[2]
    num_heads = (tokens.q if mixer == "gdn" else tokens.x).shape[2]
    block_heads = tpu_head_tile(num_heads, record.tpu_block_heads)
    if block_heads is None:
        return _XLA_UPDATES[mixer](*operands, **call)
    # Mosaic imports only where used
    if mixer == "gdn":
        from lazyspec.kernels.gdn.update_tpu import gdn_state_update_tpu as tpu_fn
    else:
        from lazyspec.kernels.mamba2.update_tpu import mamba2_state_update_tpu as tpu_fn
    return tpu_fn(*operands, block_heads=block_heads, interpret=interpret, **call)


def _update_tiles(mixer: str, tokens: Any, tuning: Tuning) -> tuple[UpdateTiles, int]:
    """(tiles, warps) of ``mixer``'s update for ``tokens``: the mixer's tuning; GDN's
    small-step tile up to ``small_step_max_tokens`` tokens; GDN conv tokens with an
    ``OutputNorm``: a whole head a program with the norm's warps."""
    record = tuning.gdn if mixer == "gdn" else tuning.mamba2
    block_value, num_warps = record.block_value, record.num_warps
    conv = isinstance(tokens, GdnConvTokens)
    value_dim = tokens.head_dim if conv else (tokens.v if mixer == "gdn" else tokens.x).shape[-1]
    if mixer == "gdn":
        lead = (tokens.conv_out if conv else tokens.v).shape[:2]
        small = small_step_tile(
            lead[0] * lead[1], tuning.small_step_max_tokens, value_dim, record.small_block_value
        )
        block_value = block_value if small is None else small
    if conv and tokens.norm is not None:
        block_value, num_warps = tokens.head_dim, tuning.gdn.norm_in_update_warps
    tiles = UpdateTiles(
        block_value=fitted_tile(value_dim, block_value),
        evict_last=record.evict_last,
        skip_padding=tuning.state.skip_padding_state,
    )
    return tiles, num_warps


def pallas_state_update(
    mixer: str,
    *operands: Any,
    mode: str,
    layer: int | None = None,
    interpret: bool = False,
    compiler_params: Any = None,
    tuning: Tuning = DEFAULT_TUNING,
    **tiles: Any,
) -> StateUpdateResult:
    """The Triton-layout kernel of ``mixer`` on ``operands`` (pool, slot, tokens) with
    ``tuning``'s tiles; ``tiles`` (``UpdateTiles`` fields) override them. Compiled where
    the mixer's ``*_triton_error`` finds a dim Triton cannot lower: the XLA form (same
    contract); ``GdnConvTokens``, which have none, are then the kernel's ValueError."""
    tuned, num_warps = _update_tiles(mixer, operands[2], tuning)
    chosen = dataclasses.replace(tuned, **tiles)
    launch = pallas_options(interpret, compiler_params, num_warps)
    if (
        not launch["interpret"]
        and not isinstance(operands[2], GdnConvTokens)
        and _TRITON_ERRORS[mixer](operands[0].shape[-3:], chosen) is not None
    ):
        return _XLA_UPDATES[mixer](*operands, mode=mode, layer=layer)
    return _PALLAS_UPDATES[mixer](*operands, mode=mode, layer=layer, tiles=chosen, **launch)


def state_update(
    pool: jax.Array,
    slot: jax.Array,
    tokens: GdnTokens | Mamba2Tokens,
    *,
    mode: str,
    kernel_backend: str | None = None,
    layer: int | None = None,
    interpret: bool = False,
    platform: str | None = None,
    tuning: Tuning = DEFAULT_TUNING,
    **tiles: Any,
) -> StateUpdateResult:
    """GDN or Mamba2 T-step update (chosen by the type of ``tokens``) on the chosen backend;
    ``layer=l``: ``pool`` is the stacked pool of all layers and layer l's rows are used.
    ``tiles`` (``block_heads``, ``block_value``, ``evict_last``, ``compiler_params``) override
    ``tuning``'s. On a TPU platform (``platform`` defaults to JAX's default) Pallas means
    ``tpu_state_update``."""
    mixer = mixer_of(tokens)
    xla, tpu = resolve_backend(kernel_backend, platform) == "xla", on_platform("tpu", platform)
    if isinstance(tokens, GdnConvTokens) and (xla or tpu):
        raise ValueError("GdnConvTokens run only in the Triton-layout Pallas kernel")
    if xla:
        return _XLA_UPDATES[mixer](pool, slot, tokens, mode=mode, layer=layer)
    if tpu:
        return tpu_state_update(
            mixer, pool, slot, tokens, mode=mode, layer=layer, interpret=interpret, tuning=tuning
        )
    return pallas_state_update(
        mixer, pool, slot, tokens, mode=mode, layer=layer, interpret=interpret, tuning=tuning,
        **tiles,
    )  # fmt: skip


def _conv_options(options: dict[str, Any]) -> tuple[jax.Array | None, ConvOptions]:
    """(num_new, the rest as ``ConvOptions``) of a conv update's keyword options."""
    options = dict(options)
    return options.pop("num_new", None), ConvOptions(**options)


def pallas_conv_update(
    *operands: jax.Array | None,
    block_channels: int | None = None,
    interpret: bool = False,
    compiler_params: Any = None,
    tuning: Tuning = DEFAULT_TUNING,
    **options: Any,
) -> ConvUpdateResult:
    """The Triton-layout conv update of ``operands`` (pool, slot, x, weight[, bias];
    ``options``: ``mode``, ``silu``, ``num_new``, ``layer``, ``out_dtype``,
    ``channel_groups``); ``block_channels`` left as None takes ``tuning``'s, fitted to the
    channels (with ``channel_groups``, to its parts and group stride). Compiled with a
    ``block_channels`` Triton cannot lower (``conv_triton_error``): the XLA form."""
    num_new, conv_options = _conv_options(options)
    channel_groups = conv_options.channel_groups
    if block_channels is None:
        fit = operands[2].shape[2]
        if channel_groups is not None:
            fit = math.gcd(*channel_groups.parts, channel_groups.check(fit))
        block_channels = fitted_tile(fit, tuning.state.conv_block_channels)
    launch = pallas_options(interpret, compiler_params)
    if not launch["interpret"] and conv_triton_error(block_channels) is not None:
        return conv_update_xla(*operands, num_new=num_new, options=conv_options)
    return conv_update_pallas(
        *operands, num_new=num_new, options=conv_options, block_channels=block_channels, **launch
    )


# the GDN layers hand this kernel Qwen3-Next's fused projection as it is (``ChannelGroups``);
# the per-shard form takes the conv channels in order
pallas_conv_update.reads_channel_groups = True


def conv_update(
    *operands: jax.Array | None, kernel_backend: str | None = None, **options: Any
) -> ConvUpdateResult:
    """Causal conv update for T tokens per row on the chosen backend (XLA on TPU);
    ``operands`` and ``options`` as ``pallas_conv_update``'s."""
    if resolve_backend(kernel_backend) == "xla" or on_platform("tpu"):
        for pallas_only in ("block_channels", "interpret", "compiler_params", "tuning"):
            options.pop(pallas_only, None)
        num_new, conv_options = _conv_options(options)
        return conv_update_xla(*operands, num_new=num_new, options=conv_options)
    return pallas_conv_update(*operands, **options)


def _scatter_blocks(
    ssm_pool: jax.Array, conv_pool: jax.Array, tiles: dict[str, Any], tuning: Tuning
) -> PoolBlocks:
    """The scatter's and the copy's tiles: those given (``PoolBlocks`` fields), else
    ``tuning``'s fitted to the pools."""
    rows = fitted_tile(ssm_pool.shape[3], tuning.state.scatter_block_rows)
    channels = fitted_tile(conv_pool.shape[2], tuning.state.scatter_block_channels)
    return dataclasses.replace(PoolBlocks(1, rows, channels), **tiles)


def pallas_state_scatter(
    *operands: jax.Array,
    layer: int | None = None,
    interpret: bool = False,
    compiler_params: Any = None,
    tuning: Tuning = DEFAULT_TUNING,
    **tiles: Any,
) -> tuple[jax.Array, jax.Array]:
    """The Pallas scatter of ``operands`` (ssm_pool, conv_pool, ssm_steps, conv_steps,
    dst_slot, step); tiles not given take ``tuning``'s. Compiled in tiles Triton cannot
    lower (``pool_tiles_triton_error``): the XLA form."""
    blocks = _scatter_blocks(operands[0], operands[1], tiles, tuning)
    launch = pallas_options(interpret, compiler_params)
    error = pool_tiles_triton_error("state_scatter_pallas", *operands[:2], blocks)
    if error is not None and not launch["interpret"]:
        return state_scatter_xla(*operands, layer=layer)
    return state_scatter_pallas(*operands, layer=layer, blocks=blocks, **launch)


def state_scatter(
    *args: jax.Array, kernel_backend: str | None = None, layer: int | None = None, **tiles: Any
) -> tuple[jax.Array, jax.Array]:
    """Masked copy ``pool[l, dst_slot[b]] = steps[l, b, step[b]]`` of ``args`` (ssm_pool,
    conv_pool, ssm_steps, conv_steps, dst_slot, step) on the chosen backend (XLA on TPU);
    with ``layer=l`` the scratch is that one layer's."""
    if resolve_backend(kernel_backend) == "xla" or on_platform("tpu"):
        return state_scatter_xla(*args, layer=layer)
    return pallas_state_scatter(*args, layer=layer, **tiles)


def pallas_state_copy(
    *operands: jax.Array,
    interpret: bool = False,
    compiler_params: Any = None,
    tuning: Tuning = DEFAULT_TUNING,
    **tiles: Any,
) -> tuple[jax.Array, jax.Array]:
    """The Pallas pool-to-pool copy of ``operands`` (ssm_pool, conv_pool, src_slot,
    dst_slot); tiles not given take ``tuning``'s. Compiled in tiles Triton cannot lower
    (``pool_tiles_triton_error``): the XLA form."""
    blocks = _scatter_blocks(operands[0], operands[1], tiles, tuning)
    launch = pallas_options(interpret, compiler_params)
    error = pool_tiles_triton_error("state_copy_pallas", *operands[:2], blocks)
    if error is not None and not launch["interpret"]:
        return state_copy_xla(*operands)
    return state_copy_pallas(
        *operands,
        blocks=blocks,
        tiles_per_program=tuning.state.copy_tiles_per_program,
        **launch,
    )


def state_copy(
    *args: jax.Array, kernel_backend: str | None = None, **tiles: Any
) -> tuple[jax.Array, jax.Array]:
    """Masked pool-to-pool copy ``pool[l, dst_slot[b]] = pool[l, src_slot[b]]`` of ``args``
    (ssm_pool, conv_pool, src_slot, dst_slot; rows with ``dst_slot[b] == 0`` write nothing)
    on the chosen backend (XLA on TPU)."""
    if resolve_backend(kernel_backend) == "xla" or on_platform("tpu"):
        return state_copy_xla(*args)
    return pallas_state_copy(*args, **tiles)
