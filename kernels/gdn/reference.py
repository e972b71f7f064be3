"""The Gated DeltaNet recurrence token by token in plain jnp: the reference every faster GDN
form (``update``, ``update_tpu``, ``chunked``) is checked against, and the math the models'
XLA forms run.

Everything here works on ONE row (no batch axis) and in float32; callers vmap over rows.
Shapes (per row): state h [H, d_k, d_v]; q, k [H, d_k] (already L2-normalised, q already
scaled by 1/sqrt(d_k), and repeated from the key heads to the H value heads); v [H, d_v];
g [H] (log decay, <= 0); beta [H] in (0, 1).

``gdn_scan`` is the token-by-token ``lax.scan``. A ``valid`` mask marks real tokens; a padding
token leaves the state unchanged, so padded rows and ragged tails are exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

L2_EPS = 1e-6


def l2_normalize(x: jax.Array, eps: float = L2_EPS) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis (the FLA / transformers convention)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def gdn_step(h, q, k, v, g, beta):
    """One GDN token: decay, delta-rule write, read. Returns (new h, output [H, d_v])."""
    h = h * jnp.exp(g)[:, None, None]
    predicted = jnp.einsum("hkv,hk->hv", h, k)  # h^T k
    delta = (v - predicted) * beta[:, None]
    h = h + k[:, :, None] * delta[:, None, :]
    out = jnp.einsum("hkv,hk->hv", h, q)  # h^T q
    return h, out


def gdn_scan(h0, q, k, v, g, beta, valid=None):
    """Token-by-token GDN over T tokens (inputs with a leading T axis).

    Returns (outputs [T, H, d_v], final state, state after every token [T, H, d_k, d_v]).
    """
    num_tokens = q.shape[0]
    if valid is None:
        valid = jnp.ones((num_tokens,), dtype=bool)

    def body(h, xs):
        q_t, k_t, v_t, g_t, b_t, ok = xs
        h_new, out = gdn_step(h, q_t, k_t, v_t, g_t, b_t)
        h_new = jnp.where(ok, h_new, h)
        return h_new, (out, h_new)

    h_final, (outs, states) = jax.lax.scan(body, h0, (q, k, v, g, beta, valid))
    return outs, h_final, states
