"""The jnp paged attention that runs where no paged-attention kernel does (CPU, the xla
backend, a TPU table too wide for the kernel's scalar memory): the table walked in blocks up
to the batch's longest visible context with an online softmax, so its cost follows the
lengths (``AttentionTuning.xla_block_kv``). Contract: ``attention.paged``'s (ungated)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lazyspec.kernels.attention.inputs import PagedInputs
from lazyspec.kernels.attention.paged import MASK_VALUE


def paged_attend(inputs: PagedInputs, scale: float, block_kv: int) -> jax.Array:
    """``attend`` over the pools read through ``token_table``, at a cost that follows the
    lengths: the table is walked in blocks of ``block_kv`` context positions with an online
    softmax (running maximum and sum), as many blocks as the batch's longest visible context
    (``min(ctx_len[b], positions[b, t] + 1)``) needs, a loop whose trip count is data, so one
    program serves every length. ``block_kv`` 0 takes the whole table in one block (the cost
    follows C, as a gather of the whole table does).

    ``inputs`` as ``PagedInputs`` has them (entries of the table at or past ``ctx_len`` are
    never read: row 0 is read in their place). Query t of row b sees positions
    ``c < ctx_len[b]`` with ``c <= positions[b, t]``; scores and softmax in float32, the
    unnormalised probabilities rounded to q's dtype for the value product (as the Pallas
    kernel rounds them). Returns ``[B, T, Hq, D]`` in q's dtype; a query that sees no
    position (padding) gets zeros (the kernel's; ``attend`` gives the mean of the values).
    """
    inputs.check()
    q, k_pool, v_pool, token_table = inputs.q, inputs.k_pool, inputs.v_pool, inputs.token_table
    ctx_len, positions = inputs.ctx_len, inputs.positions
    if block_kv < 0:
        raise ValueError(f"block_kv={block_kv} must be >= 0 (0: the whole table)")
    batch, num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, width = k_pool.shape[1], token_table.shape[1]
    block = width if block_kv == 0 else min(block_kv, width)
    q = q.reshape(batch, num_tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)
    visible = jnp.clip(jnp.minimum(ctx_len[:, None], positions + 1), 0, width)
    num_blocks = (jnp.max(visible) + block - 1) // block

    def body(j, carry):
        acc, run_max, run_sum = carry
        first = j * block
        start = jnp.minimum(first, width - block)  # a last partial block overlaps the one before
        cols = start + jnp.arange(block)[None, :]  # [1, block]
        in_ctx = cols < ctx_len[:, None]  # [B, block]
        rows = jax.lax.dynamic_slice_in_dim(token_table, start, block, axis=1)
        rows = jnp.where(in_ctx, rows, 0)  # entries past a row's context: the null row
        k, v = k_pool[rows].astype(q.dtype), v_pool[rows].astype(q.dtype)  # [B, block, Hkv, D]
        mask = (in_ctx & (cols >= first))[:, None, :] & (cols[:, None] <= positions[..., None])
        mask = mask[:, None, None]  # [B, 1, 1, T, block]
        scores = jnp.einsum("btkgd,bckd->bkgtc", q, k, preferred_element_type=jnp.float32)
        scores = jnp.where(mask, scores * scale, MASK_VALUE)
        new_max = jnp.maximum(run_max, jnp.max(scores, axis=-1))
        correction = jnp.exp(run_max - new_max)
        probs = jnp.where(mask, jnp.exp(scores - new_max[..., None]), 0.0)
        run_sum = correction * run_sum + jnp.sum(probs, axis=-1)
        pv = jnp.einsum(
            "bkgtc,bckd->bkgtd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
        )
        return correction[..., None] * acc + pv, new_max, run_sum

    stats = (batch, num_kv_heads, num_heads // num_kv_heads, num_tokens)
    init = (
        jnp.zeros((*stats, head_dim), jnp.float32),
        jnp.full(stats, MASK_VALUE, jnp.float32),
        jnp.zeros(stats, jnp.float32),
    )
    acc, _, run_sum = jax.lax.fori_loop(0, num_blocks, body, init)
    out = acc / jnp.where(run_sum > 0, run_sum, 1.0)[..., None]  # [B, Hkv, G, T, D]
    out = out.transpose(0, 3, 1, 2, 4).reshape(batch, num_tokens, num_heads, head_dim)
    return out.astype(q.dtype)
