"""Chunked prefill forms of the GDN layer: the gated delta rule and its causal conv.

Both work on ONE row (callers vmap over rows), with the conventions of ``reference``.
Only the first ``num_valid`` of the T tokens are real; the rest leave every state unchanged,
so a ragged row's final state is exact. Besides the final state, both return the state after
every full ``chunk_size`` tokens of the row (``T // chunk_size`` of them): the checkpoints the
prefix cache stores.

The delta rule uses the WY / UT-transform form. Inside a chunk, with cumulative log decay
``G_t = g_1 + ... + g_t`` and the state ``S`` at the chunk start, the written values
``u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t)`` solve the unit lower-triangular system
``(I + A) U = beta V - beta exp(G) K S``, ``A[t, s] = beta_t exp(G_t - G_s) k_t.k_s`` (s < t).
Then ``o_t = exp(G_t) S^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t.k_s) u_s`` and the state at the
chunk end is ``exp(G_C) S + sum_s exp(G_C - G_s) k_s u_s^T``. Everything intra-chunk is
computed for all chunks at once; only the ``[H, d_k, d_v]`` state is carried across chunks.
The system is inverted by doubling its diagonal blocks (``invert_unit_lower``) and multiplied
into the right-hand sides: batched products, no triangular solve.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def _pad_to_chunks(x: jax.Array, chunk_size: int) -> jax.Array:
    """Zero-pad the leading (token) axis to a multiple of chunk_size, then split it."""
    num_tokens = x.shape[0]
    padded = -(-num_tokens // chunk_size) * chunk_size
    x = jnp.pad(x, [(0, padded - num_tokens)] + [(0, 0)] * (x.ndim - 1))
    return x.reshape(padded // chunk_size, chunk_size, *x.shape[1:])


def _mask_invalid(num_valid: jax.Array, num_tokens: int, *arrays: jax.Array):
    """Zero every array at token positions >= num_valid (leading token axis)."""
    valid = jnp.arange(num_tokens) < num_valid
    return [jnp.where(valid.reshape(-1, *([1] * (a.ndim - 1))), a, 0) for a in arrays]


def _diagonal_blocks(x: jax.Array, size: int) -> jax.Array:
    """The ``[..., C, C]`` matrix's diagonal blocks of ``size`` rows, ``[..., C / size, size,
    size]`` (C a multiple of size)."""
    num = x.shape[-1] // size
    x = x.reshape(*x.shape[:-2], num, size, num, size)
    return jnp.moveaxis(jnp.diagonal(x, axis1=-4, axis2=-2), -1, -3)


def invert_unit_lower(system: jax.Array) -> jax.Array:
    """The inverse of ``system`` ``[..., C, C]``, unit lower-triangular (its upper part is
    ignored), by doubling the inverted diagonal blocks: blocks of one row are 1; two inverted
    neighbours ``A^-1``, ``B^-1`` under the system's block ``[[A, 0], [M, B]]`` give its
    inverse ``[[A^-1, 0], [-B^-1 M A^-1, B^-1]]``; ceil(log2 C) levels of batched products
    (matmul units' work, where a triangular solve runs row after row).

    Not the product ``(I - L)(I + L^2)(I + L^4)...`` of the power series of ``(I + L)^-1``:
    its partial sums grow as ``binomial(C, j) |L|^j`` where keys are alike (|L| entries near
    beta), and cancel to an inverse of entries below one only in exact arithmetic: float32
    loses every digit at C = 64. The doubling of blocks multiplies only inverses, as
    bounded as the result, and is as accurate as forward substitution."""
    size = system.shape[-1]
    padded = 1 << (size - 1).bit_length()  # zero rows below: their inverse's rows are I's
    system = jnp.pad(system, [(0, 0)] * (system.ndim - 2) + [(0, padded - size)] * 2)
    inverse = jnp.ones((*system.shape[:-2], padded, 1, 1), system.dtype)
    block = 1
    while block < padded:
        upper, lower = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]
        coupling = _diagonal_blocks(system, 2 * block)[..., block:, :block]
        coupling = jnp.matmul(coupling, upper, precision=HIGHEST)
        coupling = -jnp.matmul(lower, coupling, precision=HIGHEST)
        top = jnp.concatenate([upper, jnp.zeros_like(upper)], axis=-1)
        inverse = jnp.concatenate([top, jnp.concatenate([coupling, lower], axis=-1)], axis=-2)
        block *= 2
    return inverse[..., 0, :size, :size]


def gdn_chunked(
    h0: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    num_valid: jax.Array,
    chunk_size: int = 64,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Chunked gated delta rule over one row of T tokens (float32).

    h0 ``[H, d_k, d_v]``; q, k ``[T, H, d_k]``; v ``[T, H, d_v]``; g, beta ``[T, H]``.
    Returns (outputs ``[T, H, d_v]``, state after ``num_valid`` tokens, states after every
    full chunk ``[T // chunk_size, H, d_k, d_v]``). Outputs past ``num_valid`` are undefined;
    chunk states past it equal the final state.
    """
    num_tokens = q.shape[0]
    f32 = jnp.float32
    q, k, v, g, beta = (x.astype(f32) for x in (q, k, v, g, beta))
    # A padding token with g = 0, beta = 0, k = 0 leaves the state exactly as it was.
    k, v, g, beta = _mask_invalid(num_valid, num_tokens, k, v, g, beta)
    # [N, C, H, ...] -> [N, H, C, ...]
    q, k, v = (jnp.moveaxis(_pad_to_chunks(x, chunk_size), 2, 1) for x in (q, k, v))
    g, beta = (jnp.moveaxis(_pad_to_chunks(x, chunk_size), 2, 1) for x in (g, beta))

    cum = jnp.cumsum(g, axis=-1)  # G_t, [N, H, C]
    # G_t - G_s as a sum over s < r <= t started afresh for every s, not as a difference
    # of two cumulative sums: with fast decays |G| reaches hundreds, where a float32 G_t
    # carries an absolute error ~1e-5 that the difference would keep. All g <= 0, so these
    # partial sums have no cancellation.
    lower = jnp.tril(jnp.ones((chunk_size, chunk_size), dtype=bool))
    strictly_lower = jnp.tril(jnp.ones((chunk_size, chunk_size), dtype=bool), -1)
    diff = jnp.cumsum(jnp.where(strictly_lower, g[..., :, None], 0.0), axis=-2)
    decay = jnp.exp(jnp.where(lower, diff, -jnp.inf))  # exp(G_t - G_s), s <= t
    kk = jnp.einsum("nhtd,nhsd->nhts", k, k, precision=HIGHEST)
    strict = decay * (1.0 - jnp.eye(chunk_size, dtype=f32))
    system = jnp.eye(chunk_size, dtype=f32) + beta[..., :, None] * kk * strict

    d_v = v.shape[-1]
    rhs = jnp.concatenate([beta[..., None] * v, (beta * jnp.exp(cum))[..., None] * k], axis=-1)
    solved = jnp.matmul(invert_unit_lower(system), rhs, precision=HIGHEST)
    u_base, w = solved[..., :d_v], solved[..., d_v:]  # [N, H, C, d_v], [N, H, C, d_k]
    qk = jnp.einsum("nhtd,nhsd->nhts", q, k, precision=HIGHEST) * decay
    q_decayed = q * jnp.exp(cum)[..., None]
    k_decayed = k * jnp.exp(diff[..., -1, :])[..., None]  # exp(G_C - G_t)
    chunk_decay = jnp.exp(cum[..., -1])  # [N, H]

    def body(state, xs):
        u_b, w_c, qk_c, q_c, k_c, d_c = xs
        u = u_b - jnp.einsum("htk,hkv->htv", w_c, state, precision=HIGHEST)
        out = jnp.einsum("htk,hkv->htv", q_c, state, precision=HIGHEST)
        out = out + jnp.einsum("hts,hsv->htv", qk_c, u, precision=HIGHEST)
        state = state * d_c[:, None, None] + jnp.einsum("htk,htv->hkv", k_c, u, precision=HIGHEST)
        return state, (out, state)

    xs = (u_base, w, qk, q_decayed, k_decayed, chunk_decay)
    final, (outs, states) = jax.lax.scan(body, h0.astype(f32), xs)
    outs = jnp.moveaxis(outs, 1, 2).reshape(-1, *outs.shape[-3::2])[:num_tokens]
    return outs, final, states[: num_tokens // chunk_size]


def conv_chunked(
    window0: jax.Array,
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    num_valid: jax.Array,
    chunk_size: int = 64,
    silu: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Causal depthwise conv over one row of T tokens, all positions at once.

    window0 ``[C, K-1]`` (raw inputs of the previous K-1 tokens, oldest first); x ``[T, C]``;
    weight ``[C, K]``. Returns (outputs ``[T, C]`` float32, window after ``num_valid`` tokens,
    windows after every full chunk ``[T // chunk_size, C, K-1]``), windows in window0's dtype.
    Outputs past ``num_valid`` are undefined; chunk windows past it equal the final window.
    """
    num_tokens = x.shape[0]
    kernel = weight.shape[1]
    full = jnp.concatenate([window0.T, x.astype(window0.dtype)], axis=0)  # [K-1+T, C]
    taps = [
        full[j : j + num_tokens].astype(jnp.float32) * weight[:, j].astype(jnp.float32)
        for j in range(kernel)
    ]
    y = sum(taps[1:], taps[0])
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    if silu:
        y = jax.nn.silu(y)

    def window_after(num: jax.Array) -> jax.Array:
        # the raw inputs of tokens num-K+1 .. num-1, i.e. rows num .. num+K-2 of ``full``
        return jax.lax.dynamic_slice_in_dim(full, num, kernel - 1, axis=0).T

    final = window_after(jnp.asarray(num_valid, jnp.int32))
    ends = (jnp.arange(num_tokens // chunk_size, dtype=jnp.int32) + 1) * chunk_size
    # a chunk past the row's end holds the final window, as the GDN states do
    ends = jnp.minimum(ends, num_valid)
    chunks = jax.vmap(window_after)(ends)
    return y, final, chunks
