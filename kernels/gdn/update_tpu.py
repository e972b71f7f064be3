"""The GDN state update laid out for TPUs (Mosaic), slot ids scalar-prefetched into the
pool's index map: ``state.update_tpu_common`` has the layout, its block rules and how slot 0
stays untouched; the tile math is ``update.gdn_tile_step``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lazyspec.kernels.common import check_tpu_tile
from lazyspec.kernels.gdn.update import gdn_tile_step
from lazyspec.kernels.state.update_common import (
    GdnTokens,
    StateUpdateResult,
    check_mode,
    check_pool,
)
from lazyspec.kernels.state.update_tpu_common import launch, pool_block, scan_block


def _gdn_kernel(slot_ref, *refs, mode, block_heads):
    """refs: q, k, v, g, beta (``GdnTokens``), the row's pool block, the outputs, the state
    block."""
    q_ref, k_ref, v_ref, g_ref, beta_ref, pool_ref, out_ref, state_ref = refs
    slot = slot_ref[pl.program_id(0)]
    heads = pl.ds(pl.program_id(1) * block_heads, block_heads)
    h0 = pool_ref[...].astype(jnp.float32)
    f32 = lambda ref, *idx: ref[idx].astype(jnp.float32)  # noqa: E731

    def step(t, h):
        q, k, v = f32(q_ref, t), f32(k_ref, t), f32(v_ref, t)
        return gdn_tile_step(h, q, k, v, f32(g_ref, t, heads), f32(beta_ref, t, heads))

    scan_block(step, h0, mode, slot, out_ref, state_ref)


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
    bh = check_tpu_tile("block_heads", num_heads, min(block_heads, num_heads), 8)
    bv = check_tpu_tile("block_value", value_dim, block_value, 128)
    keys = pl.BlockSpec((None, num_tokens, bh, key_dim), lambda b, i, j, s: (b, 0, i, 0))
    values = pl.BlockSpec((None, num_tokens, bh, bv), lambda b, i, j, s: (b, 0, i, j))
    per_head = pl.BlockSpec((None, num_tokens, num_heads), lambda b, i, j, s: (b, 0, 0))
    pool_spec = pool_block(layer, (bh, key_dim, bv), lambda b, i, j, s: (s[b], i, 0, j))
    steps_spec = pl.BlockSpec(
        (None, num_tokens, bh, key_dim, bv), lambda b, i, j, s: (b, 0, i, 0, j)
    )

    def gdn_update(*refs):  # the kernel's name in profiles
        _gdn_kernel(*refs, mode=mode, block_heads=bh)

    return launch(
        gdn_update,
        mode,
        pool,
        slot,
        (batch, num_heads // bh, value_dim // bv),
        [keys, keys, values, per_head, per_head, pool_spec],
        (tokens.q, tokens.k, tokens.v, tokens.g, tokens.beta, pool),
        tokens.v,
        (values, pool_spec, steps_spec),
        interpret,
    )
