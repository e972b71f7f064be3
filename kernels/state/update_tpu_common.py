"""What the TPU (Mosaic) layouts of the state updates share (``gdn.update_tpu``,
``mamba2.update_tpu``): the slot ids are scalar-prefetched and pick each row's pool block in
the BlockSpec index maps, so the pipeline DMAs exactly the rows' states into VMEM (the
Triton forms in ``gdn.update`` / ``mamba2.update`` index a whole-array pool inside the
kernel, which Mosaic would stage into VMEM whole).

Same contract as ``state.update_common`` (decode: the final state written back to ``pool[slot[b]]``
through an aliased output; verify: the state after every token to ``[B, T, ...]`` scratch;
outputs ``[B, T, H, ...]``; the tile math is ``gdn_tile_step`` / ``mamba2_tile_step``). One
difference in how slot 0 stays untouched: a padding row's block is written back with the
values it was read with (a TPU pipeline writes every output block it visits), so slot 0
keeps its contents.

With ``layer=l`` the pool is the stacked pool of all layers and the index maps pick layer
l's rows (no copy of the layer).

Blocks follow Mosaic's rule for the last two dims (multiples of (8, 128) or whole):
``block_heads`` must be a multiple of 8 or all heads; GDN's value tile is all of d_v or a
multiple of 128; Mamba2 keeps the head dim P, state N and the B/C groups whole. The
dispatch (``state.dispatch.tpu_state_update``) takes the tuning's head tile where one fits
and the XLA scan where none does. Run on CPU in TPU interpret mode (``common.tpu_interpret``)
and lowered to Mosaic; never compiled or run on a TPU here.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from lazyspec.kernels.common import tpu_interpret
from lazyspec.kernels.state.update_common import StateUpdateResult, state_output, update_result


def store_states(mode: str, slot, h, h0, state_ref, t: int, last: bool) -> None:
    """Verify: every step's state into its scratch block; decode: after the last token, the
    final state (or, for a padding row, the state as read) into the aliased pool block."""
    if mode == "verify":
        state_ref[t] = h.astype(state_ref.dtype)
    elif last:
        state_ref[...] = jnp.where(slot != 0, h, h0).astype(state_ref.dtype)


def scan_block(step, h0: jax.Array, mode: str, slot, out_ref, state_ref) -> None:
    """The TPU kernels' loop over the T tokens of a block from the state ``h0`` (float32):
    ``step(t, h) -> (h, out)``, each output into ``out_ref[t]``, the states stored as
    ``store_states`` says."""
    h = h0
    num_tokens = out_ref.shape[0]
    for t in range(num_tokens):
        h, out = step(t, h)
        out_ref[t] = out.astype(out_ref.dtype)
        store_states(mode, slot, h, h0, state_ref, t, t == num_tokens - 1)


def pool_block(layer: int | None, block: tuple, index_map):
    """The pool's BlockSpec: ``block`` at ``index_map``, behind a squeezed layer axis fixed
    at ``layer`` when the pool is stacked."""
    if layer is None:
        return pl.BlockSpec((None,) + block, index_map)
    return pl.BlockSpec((None, None) + block, lambda *ids: (layer,) + index_map(*ids))


def launch(
    kernel,
    mode: str,
    pool,
    slot,
    grid,
    in_specs,
    args,
    out_like,
    specs: tuple,
    interpret: Any,
) -> StateUpdateResult:
    """pallas_call with the slot ids scalar-prefetched; refs (slot, *args, out, state).
    ``specs``: the outputs' spec, then the state's: the pool block (decode) and the step
    states' (verify). ``interpret``: as ``common.tpu_interpret``."""
    out_spec, pool_spec, steps_spec = specs
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
        interpret=tpu_interpret(interpret),
    )(slot.astype(jnp.int32), *args)
    return update_result(mode, outputs, states)
