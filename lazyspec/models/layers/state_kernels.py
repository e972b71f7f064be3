"""Runs a mixer's T-step state update (decode / verify) through a state-update kernel (a
``Kernels`` field, e.g. the Pallas ``state_update``) instead of the jnp scan.

The kernel wants a pool and slot ids. Given ``PoolRows`` (the engine's decode step) it gets
the stacked pool, the layer and the slots as they are: nothing is gathered; writing
``PoolRows`` (``PoolRows.write``) run it in decode mode, which writes each row's new state
into the pool in place (``kernel_write``). Given gathered
rows, those serve as the pool (row b is slot b; no copy), slot 0 included: its row's
outputs and step states are computed like any other (verify mode only reads the pool).
Tokens past a row's ``num_new`` are made identity steps (GDN: no decay and beta 0; Mamba2:
dt 0), so ragged rows stay exact.

The conv goes the same way where the decode step writes in place and the ``Kernels`` have a
conv update (``conv_write``): the kernel reads each row's window from the stacked conv pool
and writes the new one back, so neither the gather of the windows nor their scatter runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lazyspec.kernels.backend import ConvUpdateFn, StateUpdateFn
from lazyspec.kernels.state.conv import ChannelGroups
from lazyspec.kernels.state.update_common import GdnTokens, Mamba2Tokens
from lazyspec.models.interface import PoolRows, gathered


def _final(step_states: jax.Array, ssm0: jax.Array, num_new: jax.Array) -> jax.Array:
    rows = jnp.arange(step_states.shape[0])
    last = step_states[rows, jnp.maximum(num_new - 1, 0)]
    keep = (num_new > 0).reshape((-1,) + (1,) * (last.ndim - 1))
    return jnp.where(keep, last, ssm0.astype(last.dtype))


def kernel_steps(
    update: StateUpdateFn,
    ssm0: jax.Array | PoolRows,
    tokens: GdnTokens | Mamba2Tokens,
    num_new: jax.Array,
):
    """(outputs [B, T, H, ...], final state [B, ...], state after every step [B, T, ...])
    through ``update`` in verify mode. ``PoolRows`` are read in place from the stacked pool
    (the final state of a row with no new token gathers its row; nothing does when the
    caller drops ``final``)."""
    if isinstance(ssm0, PoolRows):
        result = update(ssm0.pool, ssm0.slot, tokens, mode="verify", layer=ssm0.layer)
    else:
        slot = jnp.arange(ssm0.shape[0], dtype=jnp.int32)
        result = update(ssm0.astype(jnp.float32), slot, tokens, mode="verify")
    final = _final(result.step_states, gathered(ssm0), num_new)
    return result.outputs, final, result.step_states


def kernel_write(
    update: StateUpdateFn, ssm0: PoolRows, tokens: GdnTokens | Mamba2Tokens
) -> tuple[jax.Array, jax.Array]:
    """(outputs [B, T, H, ...], the stacked pool with row b's state after its tokens written
    at ``slot[b]``) through ``update`` in decode mode: no per-row state leaves the kernel.
    Rows at slot 0 write nothing; tokens past a row's ``num_new`` are identity steps, so
    such a row writes back the state it read."""
    result = update(ssm0.pool, ssm0.slot, tokens, mode="decode", layer=ssm0.layer)
    return result.outputs, result.pool


def writes_in_place(ssm0: jax.Array | PoolRows, state_update: StateUpdateFn | None) -> bool:
    """Whether a mixer's steps form hands ``ssm0`` to ``kernel_write``."""
    return state_update is not None and isinstance(ssm0, PoolRows) and ssm0.write


def gdn_tokens(q, k, v, g, beta, num_new) -> GdnTokens:
    valid = jnp.arange(q.shape[1])[None, :, None] < num_new[:, None, None]
    return GdnTokens(q=q, k=k, v=v, g=jnp.where(valid, g, 0.0), beta=jnp.where(valid, beta, 0.0))


def mamba2_tokens(x, b, c, dt, a, d, num_new) -> Mamba2Tokens:
    valid = jnp.arange(x.shape[1])[None, :, None] < num_new[:, None, None]
    return Mamba2Tokens(
        x=x.astype(jnp.float32),
        b=b.astype(jnp.float32),
        c=c.astype(jnp.float32),
        dt=jnp.where(valid, dt, 0.0),
        a=a,
        d=d,
    )


def writes_conv_in_place(
    conv0: jax.Array | PoolRows,
    ssm0: jax.Array | PoolRows,
    state_update: StateUpdateFn | None,
    conv_update: ConvUpdateFn | None,
) -> bool:
    """Whether a mixer hands ``conv0`` to ``conv_write``: writing ``PoolRows`` and a conv
    kernel, in a step whose ssm rows ``kernel_write`` writes in place too (any other mixer
    form gathers ``conv0``)."""
    return (
        conv_update is not None
        and isinstance(conv0, PoolRows)
        and conv0.write
        and writes_in_place(ssm0, state_update)
    )


def states_for_form(
    form: str,
    conv0: jax.Array | PoolRows,
    ssm0: jax.Array | PoolRows,
    state_update: StateUpdateFn | None,
    conv_update: ConvUpdateFn | None,
) -> tuple[bool, jax.Array | PoolRows, jax.Array | PoolRows]:
    """(whether a mixer's ``form`` runs ``state_update``, conv0, ssm0) with each state
    gathered unless a kernel reads it in place: ``ssm0`` the state-update kernel of the
    steps form, ``conv0`` ``conv_write`` (``writes_conv_in_place``)."""
    use_kernel = form == "steps" and state_update is not None
    if not use_kernel:
        ssm0 = gathered(ssm0)  # only a state-update kernel reads PoolRows in place
    if not writes_conv_in_place(conv0, ssm0, state_update, conv_update):
        conv0 = gathered(conv0)
    return use_kernel, conv0, ssm0


def conv_write(
    conv_update: ConvUpdateFn,
    conv0: PoolRows,
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    num_new: jax.Array,
    channel_groups: ChannelGroups | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(conv outputs [B, T, C] in float32, as ``conv_scan`` gives them; the stacked conv pool
    with row b's window after its first ``num_new[b]`` tokens written at ``slot[b]``) through
    ``conv_update`` in decode mode; the outputs are stored in float32, not rounded to x's
    dtype. ``channel_groups``: x holds the channels grouped so, for a ``conv_update`` that
    ``reads_channel_groups``."""
    options = {} if channel_groups is None else {"channel_groups": channel_groups}
    result = conv_update(
        conv0.pool,
        conv0.slot,
        x,
        weight,
        bias,
        mode="decode",
        num_new=num_new,
        layer=conv0.layer,
        out_dtype=jnp.float32,
        **options,
    )
    return result.outputs, result.pool
