"""The Mamba2 (SSD) recurrence token by token in plain jnp: the reference every faster Mamba2
form (``update``, ``update_tpu``, ``chunked``) is checked against, and the math the models'
XLA forms run.

Everything here works on ONE row (no batch axis) and in float32; callers vmap over rows.
Shapes (per row): state h [H, P, N]; x [H, P]; b, c [G, N] (G groups, head i uses group
i // (H/G)); dt [H] (after softplus(dt + bias) and clamping); a [H] (negative); d [H].

``mamba2_scan`` is the token-by-token ``lax.scan``. A ``valid`` mask marks real tokens; a
padding token leaves the state unchanged, so padded rows and ragged tails are exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def expand_groups(bc: jax.Array, num_heads: int) -> jax.Array:
    """[..., G, N] -> [..., H, N]: head i reads group i // (H / G)."""
    return jnp.repeat(bc, num_heads // bc.shape[-2], axis=-2)


def mamba2_step(h, x, b, c, dt, a, d):
    """One Mamba2 token. Returns (new h [H, P, N], output y [H, P])."""
    num_heads = h.shape[0]
    b_h = expand_groups(b, num_heads)
    c_h = expand_groups(c, num_heads)
    decay = jnp.exp(dt * a)  # [H]
    h = h * decay[:, None, None] + (dt[:, None] * x)[:, :, None] * b_h[:, None, :]
    y = jnp.einsum("hpn,hn->hp", h, c_h) + d[:, None] * x
    return h, y


def mamba2_scan(h0, x, b, c, dt, a, d, valid=None):
    """Token-by-token Mamba2 over T tokens; same return convention as ``gdn_scan``."""
    num_tokens = x.shape[0]
    if valid is None:
        valid = jnp.ones((num_tokens,), dtype=bool)

    def body(h, xs):
        x_t, b_t, c_t, dt_t, ok = xs
        h_new, y = mamba2_step(h, x_t, b_t, c_t, dt_t, a, d)
        h_new = jnp.where(ok, h_new, h)
        return h_new, (y, h_new)

    h_final, (ys, states) = jax.lax.scan(body, h0, (x, b, c, dt, valid))
    return ys, h_final, states
