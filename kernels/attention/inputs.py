"""What every paged-attention form reads (``attention.paged``'s contract): the queries, the
two flat KV pools, the token table that names each context position's pool row, and the
rows' lengths and the queries' positions. One record, taken by the Pallas kernel
(``paged``), the TPU kernel (``ragged_tpu``) and the jnp walk (``walk``)."""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedInputs:
    """q ``[B, T, Hq, D]``; pools ``[R, Hkv, D]``; ``token_table [B, C]`` (the pool row of
    each context position); ``ctx_len [B]``; ``positions [B, T]``. Query t of row b attends
    to the positions ``c < ctx_len[b]`` with ``c <= positions[b, t]``. A pytree of arrays
    only: it passes through jit as its arrays."""

    q: jax.Array
    k_pool: jax.Array
    v_pool: jax.Array
    token_table: jax.Array
    ctx_len: jax.Array
    positions: jax.Array

    def check(self, kv_head: int | None = None) -> None:
        """ValueError unless the shapes fit the contract (and ``kv_head`` names a pool head
        when given; without, the query heads are whole GQA groups of the pools' heads)."""
        q, k_pool, v_pool = self.q, self.k_pool, self.v_pool
        batch, num_tokens, num_heads, head_dim = q.shape
        if k_pool.ndim != 3 or k_pool.shape != v_pool.shape or k_pool.shape[2] != head_dim:
            raise ValueError(
                f"pools {k_pool.shape} / {v_pool.shape} must both be [R, Hkv, {head_dim}]"
            )
        if kv_head is not None and not 0 <= kv_head < k_pool.shape[1]:
            raise ValueError(f"kv_head={kv_head} is not one of the pools' {k_pool.shape[1]} heads")
        if kv_head is None and num_heads % k_pool.shape[1]:
            raise ValueError(f"{num_heads} query heads are not a multiple of {k_pool.shape[1]}")
        if self.token_table.ndim != 2 or self.token_table.shape[0] != batch:
            raise ValueError(f"token_table {self.token_table.shape} must be [{batch}, C]")
        if self.ctx_len.shape != (batch,) or self.positions.shape != (batch, num_tokens):
            raise ValueError(
                f"ctx_len {self.ctx_len.shape} / positions {self.positions.shape} must be "
                f"[{batch}] / [{batch}, {num_tokens}]"
            )
