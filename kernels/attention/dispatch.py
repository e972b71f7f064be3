"""The attention launches: the paged attention with ``tuning.attention``'s tiles (on a TPU
the ragged Mosaic kernel, or the jnp walk where its page table would not fit SMEM), and the
prologue (q / k norms, rotary, K / V writes) in one launch at a decode or verify step's
token counts, else the caller's XLA form."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from lazyspec.kernels.attention.inputs import PagedInputs
from lazyspec.kernels.attention.paged import PagedPlan, gated, paged_attention
from lazyspec.kernels.attention.prologue import (
    HeadPrep,
    QKVHeads,
    all_powers_of_two,
    attention_prologue_pallas,
)
from lazyspec.kernels.attention.walk import paged_attend
from lazyspec.kernels.common import (
    pallas_options,
    powers_of_two,
    small_step_tile,
)
from lazyspec.kernels.tuning import DEFAULT_TUNING, Tuning


def attention_plan(tuning: Tuning = DEFAULT_TUNING) -> PagedPlan:
    """``paged_attention``'s plan from ``tuning.attention``'s tiles (active splits as it says)."""
    tiles = tuning.attention
    return PagedPlan(
        max_block_rows=tiles.block_rows,
        block_kv=tiles.block_kv,
        target_programs=tiles.target_programs,
        query_tile_bytes=tiles.query_tile_bytes,
        active_splits=tiles.active_splits,
    )


def pallas_paged_attention(
    inputs: PagedInputs,
    scale: float,
    *,
    gate: jax.Array | None = None,
    interpret: bool = False,
    compiler_params: Any = None,
    tuning: Tuning = DEFAULT_TUNING,
    **plan: Any,
) -> jax.Array:
    """``paged_attention`` of ``inputs`` with ``attention_plan(tuning)`` (``plan``,
    ``PagedPlan`` fields such as the per-shard form's ``kv_head``, overrides it), the
    combine's columns a program set up to ``small_step_max_tokens`` tokens; compiler
    params left as None take the tuning's warps and stages."""
    attention = tuning.attention
    q = inputs.q
    num_tokens = q.shape[0] * q.shape[1]
    combine = small_step_tile(
        num_tokens, tuning.small_step_max_tokens, q.shape[-1], attention.combine_block
    )
    plan = dataclasses.replace(attention_plan(tuning), **{"combine_block": combine, **plan})
    launch = pallas_options(interpret, compiler_params, attention.num_warps, attention.num_stages)
    return paged_attention(inputs, scale, gate=gate, plan=plan, **launch)


def tpu_paged_attention(
    inputs: PagedInputs,
    scale: float,
    *,
    gate: jax.Array | None = None,
    kv_head: int | None = None,
    page_size: int = 1,
    interpret: Any = False,
    tuning: Tuning = DEFAULT_TUNING,
) -> jax.Array:
    """``paged_attention``'s contract on a TPU: ``attention.ragged_tpu`` over pages of
    ``page_size`` rows with ``tuning.attention``'s TPU tiles, or, where its page table
    would pass ``tpu_table_max_bytes`` of SMEM, the jnp walk (``attention.walk``); gated
    after either."""
    from lazyspec.kernels.attention import ragged_tpu  # Mosaic imports only where used

    attention = tuning.attention
    batch, width = inputs.token_table.shape
    if batch * (width // page_size) * 4 > attention.tpu_table_max_bytes:
        if kv_head is not None:  # every query head reads that one pool head
            heads = slice(kv_head, kv_head + 1)
            inputs = dataclasses.replace(
                inputs, k_pool=inputs.k_pool[:, heads], v_pool=inputs.v_pool[:, heads]
            )
        return gated(paged_attend(inputs, scale, attention.xla_block_kv), gate)
    pages_per_block = max(1, attention.tpu_block_kv // page_size)
    tiles = ragged_tpu.RaggedTiles(page_size, pages_per_block, attention.tpu_block_rows)
    out = ragged_tpu.ragged_paged_attention_tpu(inputs, scale, tiles, kv_head, interpret)
    return gated(out, gate)


def pallas_attention_prologue(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *pools_and_norms: Any,
    xla_form: Callable[[], tuple[jax.Array, jax.Array, jax.Array]],
    num_heads: int | None = None,
    interpret: bool = False,
    num_warps: int = 4,
    tuning: Tuning = DEFAULT_TUNING,
    **options: Any,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``attention_prologue_pallas`` (``pools_and_norms``: positions, write_idx, num_new,
    k_pool, v_pool, q_norm, k_norm; ``options``: eps, zero_centered, rotary_dim, rope_theta,
    k_head_at, v_head_at) up to ``prologue_max_tokens`` tokens; else, or where a compiled
    launch would move a block that is not a power of two (Triton), ``xla_form()``."""
    launch = pallas_options(interpret, None, num_warps)
    k_pool = pools_and_norms[3]
    num_heads = q.shape[1] if num_heads is None else num_heads
    head_dim, groups = k_pool.shape[2], num_heads // k_pool.shape[1]
    rotary_dim = options.get("rotary_dim", 0)
    fits = powers_of_two(groups, q.shape[2], head_dim) and all_powers_of_two(head_dim, rotary_dim)
    attention = tuning.attention
    if q.shape[0] > attention.prologue_max_tokens or not (launch["interpret"] or fits):
        return xla_form()
    # a kv head's query heads over several programs, at a few tokens
    block_q_heads = small_step_tile(
        q.shape[0], tuning.small_step_max_tokens, groups, attention.prologue_q_heads
    )
    tokens_and_pools, norms = pools_and_norms[:5], pools_and_norms[5:]
    heads = {name: options.pop(name) for name in ("k_head_at", "v_head_at") if name in options}
    return attention_prologue_pallas(
        QKVHeads(q, k, v, num_heads, **heads),
        *tokens_and_pools,
        prep=HeadPrep(*norms, **options),
        block_q_heads=block_q_heads,
        **launch,
    )


# reads q, k and v out of one product's output (``num_heads``, ``k_head_at``, ``v_head_at``)
pallas_attention_prologue.takes_one_product = True
