"""Runs a mixer's T-step state update (decode / verify) through the Pallas state_update
kernel instead of the jnp scan.

The layer has already gathered each row's state; the kernel wants a pool and slot ids. In
verify mode the kernel only reads the pool, so the gathered states serve as the pool as
they are (row b is slot b; no copy), slot 0 included: its row's outputs and step states are
computed like any other. Tokens past a row's ``num_new`` are made identity steps (GDN: no
decay and beta 0; Mamba2: dt 0), so ragged rows stay exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lazyspec.kernels.backend import state_update
from lazyspec.kernels.state_update import GdnTokens, Mamba2Tokens


def _final(step_states: jax.Array, ssm0: jax.Array, num_new: jax.Array) -> jax.Array:
    rows = jnp.arange(step_states.shape[0])
    last = step_states[rows, jnp.maximum(num_new - 1, 0)]
    keep = (num_new > 0).reshape((-1,) + (1,) * (last.ndim - 1))
    return jnp.where(keep, last, ssm0.astype(last.dtype))


def pallas_steps(ssm0: jax.Array, tokens: GdnTokens | Mamba2Tokens, num_new: jax.Array):
    """(outputs [B, T, H, ...], final state [B, ...], state after every step [B, T, ...])."""
    slot = jnp.arange(ssm0.shape[0], dtype=jnp.int32)
    result = state_update(ssm0.astype(jnp.float32), slot, tokens, mode="verify",
                          kernel_backend="pallas")
    return result.outputs, _final(result.step_states, ssm0, num_new), result.step_states


def gdn_tokens(q, k, v, g, beta, num_new) -> GdnTokens:
    valid = jnp.arange(q.shape[1])[None, :, None] < num_new[:, None, None]
    return GdnTokens(q=q, k=k, v=v, g=jnp.where(valid, g, 0.0), beta=jnp.where(valid, beta, 0.0))


def mamba2_tokens(x, b, c, dt, a, d, num_new) -> Mamba2Tokens:
    valid = jnp.arange(x.shape[1])[None, :, None] < num_new[:, None, None]
    return Mamba2Tokens(x=x.astype(jnp.float32), b=b.astype(jnp.float32),
                        c=c.astype(jnp.float32), dt=jnp.where(valid, dt, 0.0), a=a, d=d)
