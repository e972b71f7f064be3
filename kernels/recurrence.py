"""Per-token recurrence math shared by the models, the Pallas kernels and their references.

Everything here works on ONE row (no batch axis) and in float32; callers vmap over rows.
Shapes (per row):
  GDN     state h [H, d_k, d_v]; q, k [H, d_k] (already L2-normalised, q already scaled by
          1/sqrt(d_k), and repeated from the key heads to the H value heads); v [H, d_v];
          g [H] (log decay, <= 0); beta [H] in (0, 1).
  Mamba2  state h [H, P, N]; x [H, P]; b, c [G, N] (G groups, head i uses group i // (H/G));
          dt [H] (after softplus(dt + bias) and clamping); a [H] (negative); d [H].
  conv    window [C, K-1] of the raw (pre-conv) inputs of the last K-1 tokens, oldest first;
          x [C]; weight [C, K] (weight[:, K-1] multiplies the newest token); bias [C] or None.

The ``*_scan`` functions are the token-by-token ``lax.scan`` references (the oracles every
faster form is checked against). A ``valid`` mask marks real tokens; a padding token leaves
the state unchanged, so padded rows and ragged tails are exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

L2_EPS = 1e-6


def l2_normalize(x: jax.Array, eps: float = L2_EPS) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis (the FLA / transformers convention)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


# ---------------------------------------------------------------- Gated DeltaNet


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


# ---------------------------------------------------------------- Mamba2 (SSD)


def _expand_groups(bc: jax.Array, num_heads: int) -> jax.Array:
    """[G, N] -> [H, N]: head i reads group i // (H / G)."""
    groups = bc.shape[0]
    return jnp.repeat(bc, num_heads // groups, axis=0)


def mamba2_step(h, x, b, c, dt, a, d):
    """One Mamba2 token. Returns (new h [H, P, N], output y [H, P])."""
    num_heads = h.shape[0]
    b_h = _expand_groups(b, num_heads)
    c_h = _expand_groups(c, num_heads)
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


# ---------------------------------------------------------------- causal depthwise conv


def conv_step(window, x, weight, bias=None, silu: bool = True):
    """One token through the causal depthwise conv. Returns (new window, output [C])."""
    full = jnp.concatenate([window, x[:, None].astype(window.dtype)], axis=1)  # [C, K]
    y = jnp.sum(full.astype(jnp.float32) * weight.astype(jnp.float32), axis=1)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    if silu:
        y = jax.nn.silu(y)
    return full[:, 1:], y


def conv_scan(window0, x, weight, bias=None, valid=None, silu: bool = True):
    """Token-by-token causal conv over T tokens ([T, C] inputs).

    Returns (outputs [T, C], final window, window after every token [T, C, K-1]).
    """
    num_tokens = x.shape[0]
    if valid is None:
        valid = jnp.ones((num_tokens,), dtype=bool)

    def body(window, xs):
        x_t, ok = xs
        new_window, y = conv_step(window, x_t, weight, bias, silu)
        new_window = jnp.where(ok, new_window, window)
        return new_window, (y, new_window)

    final, (ys, windows) = jax.lax.scan(body, window0, (x, valid))
    return ys, final, windows
