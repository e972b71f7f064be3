"""The state updates' Triton-layout kernels lowered for an NVIDIA GPU at model shapes
(Triton IR built on this machine, not compiled), and a tile Triton cannot lower refused."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from lazyspec.kernels import common
from lazyspec.kernels.gdn import update as gdn_update
from lazyspec.kernels.mamba2 import update as mamba2_update
from lazyspec.kernels.state import update_common as su
from lazyspec.kernels.tuning import Tuning
from tests.kernels.kernel_checks import lower_for_cuda

pytestmark = pytest.mark.pallas


def test_state_updates_lower_to_triton_at_model_shapes_pallas(monkeypatch):
    """Qwen3-Next GDN (32 heads, 128 x 128) and Nemotron-H Mamba2 (128 heads, 64 x 128, 8
    groups) lower through Pallas-Triton with the benchmark's tiles; a non-power-of-two tile
    is refused before tracing (``mamba2_triton_error``) and, the refusal bypassed, rejected
    by Triton's lowering, which shows its checks really ran."""
    spec = jax.ShapeDtypeStruct
    params = common.pallas_compiler_params("gpu")
    batch, tokens, slot = 4, 4, spec((4,), jnp.int32)
    gdn = su.GdnTokens(
        *(spec((batch, tokens, 32, 128), jnp.bfloat16),) * 3,
        *(spec((batch, tokens, 32), jnp.float32),) * 2,
    )
    mamba = su.Mamba2Tokens(
        spec((batch, tokens, 128, 64), jnp.bfloat16),
        *(spec((batch, tokens, 8, 128), jnp.bfloat16),) * 2,
        spec((batch, tokens, 128), jnp.float32),
        *(spec((128,), jnp.float32),) * 2,
    )
    conv = su.GdnConvTokens(  # 16 key heads, 32 value heads, as the decode step has them
        spec((batch, tokens, 64 * 128), jnp.float32),
        *(spec((batch, tokens, 32), jnp.bfloat16),) * 2,
        *(spec((32,), jnp.bfloat16),) * 2,
        slot,
        num_k_heads=16,
    )
    grouped = su.GdnConvTokens.grouped(  # Qwen3-Next's in_proj_ba read in place
        conv.conv_out, spec((batch, tokens, 64), jnp.bfloat16), conv.a_log, conv.dt_bias, slot, 16
    )
    gdn_update_fn = gdn_update.gdn_state_update_pallas
    mamba2_update_fn = mamba2_update.mamba2_state_update_pallas

    def lowers(update, pool_shape, inputs, **options) -> None:
        text = lower_for_cuda(
            lambda p, s, t: update(p, s, t, compiler_params=params, **options),
            spec(pool_shape, jnp.float32),
            slot,
            inputs,
        )
        assert "triton" in text.lower()

    for mode in su.MODES:
        for inputs in (gdn, conv, grouped):
            tiles = su.UpdateTiles(block_value=32)
            lowers(gdn_update_fn, (9, 32, 128, 128), inputs, mode=mode, tiles=tiles)
        tiles = su.UpdateTiles(block_value=32, evict_last=True)
        lowers(mamba2_update_fn, (9, 128, 64, 128), mamba, mode=mode, tiles=tiles)
    for mode in su.MODES:  # a layer of the stacked pool, as the engine's decode step passes it
        for inputs in (gdn, grouped):  # (and padding rows skipping their state)
            tiles = su.UpdateTiles(block_value=64, skip_padding=True)
            lowers(gdn_update_fn, (3, 9, 32, 128, 128), inputs, mode=mode, tiles=tiles, layer=2)
        tiles = su.UpdateTiles(block_value=32, evict_last=True, skip_padding=True)
        lowers(mamba2_update_fn, (3, 9, 128, 64, 128), mamba, mode=mode, tiles=tiles, layer=1)
    odd_tile = (
        lambda p, s, t: mamba2_update.mamba2_state_update_pallas(
            p, s, t, mode="decode", tiles=su.UpdateTiles(block_value=48), compiler_params=params
        ),
        spec((9, 128, 96, 128), jnp.float32),
        slot,
        dataclasses.replace(mamba, x=spec((batch, tokens, 128, 96), jnp.bfloat16)),
    )
    with pytest.raises(ValueError, match="block_value=48 is not"):
        lower_for_cuda(*odd_tile)
    monkeypatch.setattr(su, "refuse_triton_shapes", lambda *args: None)
    with pytest.raises(ValueError, match="power of 2"):
        lower_for_cuda(*odd_tile)


@pytest.mark.parametrize("num_heads", [128, 48])
def test_mamba2_update_lowers_to_triton_at_granite_shapes_pallas(num_heads):
    """Granite 4.0-H's Mamba2 (a 64 x 128 state per head, all heads sharing one group of B and
    C) lowers through Pallas-Triton with the default tiles, as the engine's decode step calls
    it (a layer of the stacked pool)."""
    spec = jax.ShapeDtypeStruct
    params = common.pallas_compiler_params("gpu")
    batch, tokens, head_dim, state_dim = 4, 4, 64, 128
    tiles = {"block_value": Tuning().mamba2.block_value, "evict_last": Tuning().mamba2.evict_last}
    mamba = su.Mamba2Tokens(
        spec((batch, tokens, num_heads, head_dim), jnp.bfloat16),
        *(spec((batch, tokens, 1, state_dim), jnp.bfloat16),) * 2,
        spec((batch, tokens, num_heads), jnp.float32),
        *(spec((num_heads,), jnp.float32),) * 2,
    )
    for mode in su.MODES:
        text = lower_for_cuda(
            lambda p, s, t: mamba2_update.mamba2_state_update_pallas(
                p,
                s,
                t,
                mode=mode,
                tiles=su.UpdateTiles(
                    block_value=common.fitted_tile(head_dim, tiles["block_value"]),
                    evict_last=tiles["evict_last"],
                ),
                layer=1,
                compiler_params=params,
            ),
            spec((3, 9, num_heads, head_dim, state_dim), jnp.float32),
            spec((batch,), jnp.int32),
            mamba,
        )
        assert "triton" in text.lower()
