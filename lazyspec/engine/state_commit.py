"""The recurrent-state commit of the device steps: reading rows' states out of the state
pools and writing them back (working slot, prefill-end copy, checkpoint slot).

Every function is pure: it takes the pools ``conv`` / ``ssm`` (or a ``PoolView`` of them)
and returns the new ones. Rows that must not write name an out-of-range slot (the drop
sentinel) or, for the kernels' ``state_scatter`` / ``state_copy``, the null slot with a
negative step, so slot 0 is never written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from lazyspec.models.interface import ChunkStates, PoolView, StateRows, StepStates
from lazyspec.scheduler.batch import DecodeBatch
from lazyspec.scheduler.layout import NULL_SLOT

if TYPE_CHECKING:
    from lazyspec.engine.steps import Pools, StepStatic

NO_STEP = -1  # state_scatter: this row writes nothing


def gather_state(pools: Pools, slots: jax.Array) -> StateRows:
    """The rows of the state pools at ``slots`` (every layer). One row is read as a gather
    of two (the row twice): XLA turns a one-index gather into a dynamic slice and fuses it
    into each consumer, among them the commit's in-place writes of the same pool, which must
    then work on a copy of the whole pool (two copies of the state pool a one-row step)."""
    num_rows = slots.shape[0]
    read = jnp.concatenate([slots, slots]) if num_rows == 1 else slots
    return StateRows(conv=pools.conv[:, read][:, :num_rows], ssm=pools.ssm[:, read][:, :num_rows])


def scatter_state(pools_conv, pools_ssm, slots, conv, ssm):
    """pool[:, slots[b]] = state[:, b]; out-of-range slots are dropped."""
    pools_conv = pools_conv.at[:, slots].set(conv.astype(pools_conv.dtype), mode="drop")
    pools_ssm = pools_ssm.at[:, slots].set(ssm.astype(pools_ssm.dtype), mode="drop")
    return pools_conv, pools_ssm


def commit_picked(
    static: StepStatic,
    pools_conv,
    pools_ssm,
    states: ChunkStates | StepStates,
    dst_slot: jax.Array,
    index: jax.Array,
):
    """pool[l, dst_slot[b]] = states[l][b, index[b]] (states after each prefill chunk, stacked
    ``[L, B, N, ...]``, or after each verify position, per-layer lists of ``[B, N, ...]``)
    for rows whose dst_slot is a real slot; sentinel rows write nothing. The engine's
    ``Kernels.state_scatter``: one launch for stacked states, one per layer for lists (so
    the verify scratch is never stacked into one array). Returns (conv, ssm)."""
    # state_scatter's convention for "write nothing" is a negative step index (its slot
    # then reads as the null slot), not the drop sentinel the scatters here use
    write = (dst_slot >= 1) & (dst_slot <= static.num_slots)
    dst, step = jnp.where(write, dst_slot, NULL_SLOT), jnp.where(write, index, NO_STEP)
    if isinstance(states, ChunkStates):
        ssm, conv = static.kernels.state_scatter(
            pools_ssm, pools_conv, states.ssm, states.conv, dst, step
        )
        return conv, ssm
    ssm, conv = pools_ssm, pools_conv
    for layer, (ssm_steps, conv_steps) in enumerate(zip(states.ssm, states.conv)):
        ssm, conv = static.kernels.state_scatter(
            ssm, conv, ssm_steps, conv_steps, dst, step, layer=layer
        )
    return conv, ssm


def commit_verify(
    static: StepStatic,
    pools: Pools,
    steps: StepStates,
    batch: DecodeBatch,
    accept_len: jax.Array,
    pre: jax.Array,
    crossed: jax.Array,
):
    """A verify's commit (DESIGN §7), two masked scatters from the per-position states
    ``steps``: the last accepted state into the working slot, and for rows that crossed a
    multiple of the interval the crossing state into the planned checkpoint slot. Returns
    (conv, ssm)."""
    interval = batch.track_interval
    real = batch.req_row <= static.max_running
    t_cross = ((pre + accept_len) // interval) * interval - pre - 1
    sentinel_slot = static.sentinel_slot
    working = jnp.where(real, batch.working_slot, sentinel_slot)
    track = jnp.where(crossed, batch.track_slot, sentinel_slot)
    conv, ssm = commit_picked(static, pools.conv, pools.ssm, steps, working, accept_len - 1)
    return commit_picked(static, conv, ssm, steps, track, t_cross)


def copy_checkpoint(static: StepStatic, written: PoolView, batch: DecodeBatch, crossed):
    """An in-place decode's commit: the working slots already hold the new state
    (``written``, the pools the forward returned), so a row that crossed a multiple of the
    interval copies its working slot into its planned checkpoint slot, pool to pool. Rows
    that did not cross, or have no real target (the drop sentinel), copy nothing (their
    destination reads as the null slot, which ``state_copy`` never writes). Returns
    (conv, ssm)."""
    track = batch.track_slot
    write = crossed & (track >= 1) & (track <= static.num_slots)
    dst = jnp.where(write, track, NULL_SLOT)
    src = jnp.where(write, batch.working_slot, NULL_SLOT)
    ssm, conv = static.kernels.state_copy(written.ssm_pool, written.conv_pool, src, dst)
    return conv, ssm
