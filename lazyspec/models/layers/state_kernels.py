"""Runs a mixer's T-step state update (decode / verify) through a state-update kernel (a
``Kernels`` field, e.g. the Pallas ``state_update``) instead of the jnp scan.

The kernel wants a pool and slot ids. Given ``PoolRows`` (the engine's decode step) it gets
the stacked pool, the layer and the slots as they are: nothing is gathered. Given gathered
rows, those serve as the pool (row b is slot b; no copy), slot 0 included: its row's
outputs and step states are computed like any other (verify mode only reads the pool).
Tokens past a row's ``num_new`` are made identity steps (GDN: no decay and beta 0; Mamba2:
dt 0), so ragged rows stay exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lazyspec.kernels.backend import StateUpdateFn
from lazyspec.kernels.state_update import GdnTokens, Mamba2Tokens
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
