"""Chunked (SSD) prefill form of Mamba2 and the window form of its causal conv, in plain jnp.

Both work on ONE row (callers vmap over rows), in float32, with the shapes and conventions of
``reference`` (and ``state.conv``); they are checked against ``mamba2_scan`` / ``conv_scan``.

Ragged rows: only the first ``num_valid`` tokens are real. A padding token gets ``dt = 0``,
which makes its decay ``exp(0 * a) = 1`` and its write ``0 * x * b = 0``, so the state passes
through padding exactly unchanged. The state after chunk j is therefore the state after
``min((j + 1) * chunk_size, num_valid)`` tokens, the same value the token scan reports.

SSD, per head, inside one chunk of L tokens with log-decays ``l_t = dt_t * a`` and their
inclusive prefix sums ``s_t``:
  y_t   = sum_{r <= t} exp(s_t - s_r) (c_t . b_r) dt_r x_r  +  exp(s_t) (h_in c_t)  +  d x_t
  h_out = exp(s_L) h_in + sum_r exp(s_L - s_r) dt_r x_r (x) b_r
The intra-chunk part is a masked quadratic form computed for all chunks at once; only the
chunk-to-chunk carry of ``h`` is sequential (a scan over chunks, elementwise work).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lazyspec.kernels.mamba2.reference import expand_groups

DEFAULT_CHUNK = 64


def _pad_to_chunks(array: jax.Array, num_padded: int) -> jax.Array:
    """Zero-pad the leading (token) axis to ``num_padded`` tokens."""
    extra = num_padded - array.shape[0]
    return jnp.pad(array, [(0, extra)] + [(0, 0)] * (array.ndim - 1))


def _segment_sums(log_decay: jax.Array) -> jax.Array:
    """[nc, L, H] log-decays -> [nc, t, r, H] = sum_{r < i <= t} l_i for r <= t, -inf above.

    Each entry sums only its own terms (a masked cumsum), instead of the difference s_t - s_r
    of two long prefix sums, which would cancel and lose precision late in a chunk.
    """
    chunk_len = log_decay.shape[1]
    strict = jnp.tril(jnp.ones((chunk_len, chunk_len), dtype=bool), k=-1)  # [i, r]: i > r
    terms = jnp.where(strict[None, :, :, None], log_decay[:, :, None, :], 0.0)
    sums = jnp.cumsum(terms, axis=1)
    causal = jnp.tril(jnp.ones((chunk_len, chunk_len), dtype=bool))
    return jnp.where(causal[None, :, :, None], sums, -jnp.inf)


def _chunk_terms(
    x: jax.Array, b: jax.Array, c: jax.Array, dt: jax.Array, a: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Per-chunk quantities (inputs [num_chunks, L, ...]).

    Returns (y_intra [nc, L, H, P], local_state [nc, H, P, N] (the chunk's own write, from a
    zero start), chunk_decay [nc, H] (= exp(s_L)), decay_in [nc, L, H] (= exp(s_t))).
    """
    log_decay = dt * a  # [nc, L, H], <= 0
    gaps = _segment_sums(log_decay)  # [nc, t, r, H]
    pair_decay = jnp.exp(gaps)  # zero above the diagonal
    x_dt = x * dt[..., None]  # [nc, L, H, P]
    scores = jnp.einsum("cthn,crhn->ctrh", c, b) * pair_decay
    y_intra = jnp.einsum("ctrh,crhp->cthp", scores, x_dt)
    decay_to_end = pair_decay[:, -1]  # [nc, r, H] = exp(s_L - s_r)
    local_state = jnp.einsum("clhp,clh,clhn->chpn", x_dt, decay_to_end, b)
    prefix = jnp.cumsum(log_decay, axis=1)  # s_t, inclusive
    return y_intra, local_state, jnp.exp(prefix[:, -1, :]), jnp.exp(prefix)


def mamba2_chunked(
    h0: jax.Array,
    x: jax.Array,
    b: jax.Array,
    c: jax.Array,
    dt: jax.Array,
    a: jax.Array,
    d: jax.Array,
    num_valid: jax.Array | int,
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Mamba2 over T tokens of one row in the chunked SSD form.

    Shapes: h0 [H, P, N]; x [T, H, P]; b, c [T, G, N]; dt [T, H] (already softplus'd and
    clamped); a, d [H]; num_valid: int scalar (tokens ``>= num_valid`` are padding).
    Returns (y [T, H, P], final state [H, P, N], chunk states [T // chunk_size, H, P, N]) where
    chunk state j is the state after ``min((j + 1) * chunk_size, num_valid)`` tokens. Outputs
    at padding positions are finite but meaningless. Pure; never mutates.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    num_tokens, num_heads, head_dim = x.shape
    num_full = num_tokens // chunk_size
    num_chunks = max(1, -(-num_tokens // chunk_size))
    num_padded = num_chunks * chunk_size

    valid = jnp.arange(num_tokens) < num_valid
    dt = jnp.where(valid[:, None], dt.astype(jnp.float32), 0.0)
    x = x.astype(jnp.float32)
    b_h = expand_groups(b.astype(jnp.float32), num_heads)
    c_h = expand_groups(c.astype(jnp.float32), num_heads)

    def to_chunks(array):
        array = _pad_to_chunks(array, num_padded)
        return array.reshape((num_chunks, chunk_size) + array.shape[1:])

    x_c, b_c, c_c, dt_c = (to_chunks(t) for t in (x, b_h, c_h, dt))
    y_intra, local_state, chunk_decay, decay_in = _chunk_terms(x_c, b_c, c_c, dt_c, a)

    def carry(h, xs):
        decay, local = xs
        h_next = h * decay[:, None, None] + local
        return h_next, (h, h_next)

    h_final, (h_start, h_end) = jax.lax.scan(
        carry, h0.astype(jnp.float32), (chunk_decay, local_state)
    )
    y_inter = jnp.einsum("clhn,chpn->clhp", c_c, h_start) * decay_in[..., None]
    y = (y_intra + y_inter).reshape(num_padded, num_heads, head_dim)[:num_tokens]
    y = y + d[None, :, None] * x
    return y, h_final, h_end[:num_full]


def conv_windowed(
    window0: jax.Array,
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    num_valid: jax.Array | int,
    chunk_size: int = DEFAULT_CHUNK,
    silu: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The causal depthwise conv over T tokens of one row, all tokens at once.

    Shapes: window0 [C, K-1] (raw inputs of the previous K-1 tokens, oldest first); x [T, C];
    weight [C, K]; bias [C] or None; num_valid: int scalar.
    Returns (y [T, C] float32, final window [C, K-1] after ``num_valid`` tokens, chunk windows
    [T // chunk_size, C, K-1] after ``min((j + 1) * chunk_size, num_valid)`` tokens). Windows
    keep ``window0``'s dtype, as ``conv_step`` does.
    """
    num_tokens = x.shape[0]
    kernel = weight.shape[1]
    # full[i] is the raw input at token i - (K-1); the first K-1 entries are the old window.
    full = jnp.concatenate([window0.T, x.astype(window0.dtype)], axis=0)  # [T + K - 1, C]
    full32 = full.astype(jnp.float32)
    weight32 = weight.astype(jnp.float32)
    y = sum(full32[k : k + num_tokens] * weight32[:, k] for k in range(kernel))
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    if silu:
        y = jax.nn.silu(y)

    def window_after(count):
        # The window after `count` tokens holds tokens count-(K-1) .. count-1.
        return jax.lax.dynamic_slice_in_dim(full, count, kernel - 1, axis=0).T

    count = jnp.minimum(num_valid, num_tokens)
    num_full = num_tokens // chunk_size
    ends = jnp.minimum((jnp.arange(num_full) + 1) * chunk_size, count)
    chunk_windows = jax.vmap(window_after)(ends)
    return y, window_after(count), chunk_windows
