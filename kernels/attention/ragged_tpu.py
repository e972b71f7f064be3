"""Ragged paged attention laid out for TPUs (Mosaic): decode (T = 1), verify (T = D) and
chunked prefill (a chunk attending to its cached prefix and causally within itself) in one
launch, pages of K / V fetched by DMA from HBM through the scalar-prefetched page table, an
online softmax over blocks of pages whose count follows each tile's visible context.

Contract: ``attention.paged``'s (``inputs.PagedInputs``: q ``[B, T, Hq, D]``, pools ``[R,
Hkv, D]``, ``token_table [B, C]``, ``ctx_len [B]``, ``positions [B, T]``; query t of row b
sees ``c < ctx_len[b]`` with ``c <= positions[b, t]``; a query that sees nothing gets
zeros; ``kv_head=i``: every query head reads pool head i), plus the pool's paging: the
pool's rows are pages of ``page_size`` rows (row ``page * page_size + offset``, ``R`` a
multiple of it) and a row's table names whole pages from position 0, ``token_table[b, c] =
page * page_size + c % page_size`` below ``ctx_len[b]`` (``cache.allocators.KVAllocator``
hands out exactly such rows). Entries at or past ``ctx_len`` are never read: their pages are
fetched as page 0, the null page. The gate is not applied here (the dispatch applies
``paged.gated``).

Layout. The pools are viewed, without a copy, as ``[pages, page_size * Hkv, D]``, so a page
of one pool is one contiguous DMA. The queries of a kv head's group (G = Hq / Hkv) are
stacked with the tokens into ``T * G`` rows (token-major) and cut into tiles of up to
``block_rows`` rows; grid ``(row b, query tile)``, every kv head of the row in one program
(a page is fetched once for all its heads). Scalar-prefetched (SMEM): the page table ``[B *
C / page_size]`` and each tile's visible length (its rows' largest ``min(ctx_len, position +
1)``), flattened. A program loops over ``cdiv(visible length, block)`` blocks of
``pages_per_block`` pages, double-buffered: block j + 1's page DMAs start before block j is
waited for and used. Head h's K / V rows of a block are a strided load (every Hkv-th row).

Checked on CPU in TPU interpret mode (DMAs, semaphores and scalar prefetch simulated) and by
lowering to Mosaic; never compiled or run on a TPU here. Not checked there: Mosaic's layout
passes for the strided head loads of bf16 pools (packed rows), VMEM use at long blocks, speed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from lazyspec.kernels.attention.inputs import PagedInputs
from lazyspec.kernels.attention.paged import MASK_VALUE
from lazyspec.kernels.common import tpu_interpret


@dataclass(frozen=True)
class RaggedTiles:
    """The static shape of a launch: the pool's ``page_size``, ``pages_per_block`` pages a
    block of the softmax loop (one DMA each per pool), ``block_rows`` query rows a tile at
    most (a multiple of 8; a tile is whole tokens' rows, or all rows where no such tile
    divides them)."""

    page_size: int
    pages_per_block: int
    block_rows: int


@dataclass(frozen=True)
class _Shape:
    """What the kernel body and its specs need to know statically."""

    num_kv_heads: int  # the pool's
    first_head: int  # pool heads first_head .. first_head + num_heads - 1 are read
    num_heads: int
    group: int  # query heads a read kv head
    pages_per_row: int
    pages_per_block: int
    page_size: int
    tile_tokens: int  # tokens a query tile
    num_tiles: int
    scale: float

    @property
    def tile_rows(self) -> int:
        return self.tile_tokens * self.group


def page_table(token_table: jax.Array, ctx_len: jax.Array, page_size: int) -> jax.Array:
    """``[B, C / page_size]`` page ids of the rows' tables; pages starting at or past
    ``ctx_len`` are page 0 (the null page), so a fetch never leaves the pool."""
    first = token_table[:, ::page_size]
    starts = jnp.arange(first.shape[1], dtype=jnp.int32)[None, :] * page_size
    return jnp.where(starts < ctx_len[:, None], first // page_size, 0).astype(jnp.int32)


def tokens_per_tile(num_tokens: int, group: int, block_rows: int) -> int:
    """The tokens of a query tile: the most that divide T whose ``tokens * group`` rows are
    a multiple of 8 within ``block_rows``; all T where none are (one whole tile)."""
    for tokens in range(min(num_tokens, block_rows // group), 0, -1):
        if num_tokens % tokens == 0 and (tokens * group) % 8 == 0:
            return tokens
    return num_tokens


def _fetch(refs, b, j, slot, visible_len, shape: _Shape, wait: bool = False) -> None:
    """Start (or, with ``wait``, wait for) the DMAs of block j's pages of both pools into
    buffer ``slot``: the pages below ``visible_len`` only (a loop, whatever the block's
    width); the buffer rows of pages not fetched keep stale values, which the softmax masks."""
    table_ref, k_hbm, v_hbm, k_buf, v_buf, sems = refs
    page_rows = k_hbm.shape[1]  # page_size * Hkv
    pages_per_block = shape.pages_per_block
    first = j * pages_per_block
    needed = jax.lax.div(visible_len + shape.page_size - 1, shape.page_size) - first
    num_pages = jnp.clip(needed, 0, pages_per_block)

    def one_page(p, carry):
        page = table_ref[b * shape.pages_per_row + first + p]
        rows = pl.ds(p * page_rows, page_rows)
        for pool, buf, which in ((k_hbm, k_buf, 0), (v_hbm, v_buf, 1)):
            copy = pltpu.make_async_copy(pool.at[page], buf.at[slot, rows], sems.at[which, slot])
            if wait:
                copy.wait()
            else:
                copy.start()
        return carry

    jax.lax.fori_loop(0, num_pages, one_page, 0)


def _block_update(carry, q_ref, limit, buffers, j, shape: _Shape):
    """One block's online-softmax step for every head: (acc, max, sum) per head."""
    k_buf, v_buf, slot, visible_len = buffers
    block = k_buf.shape[1] // shape.num_kv_heads
    cols = j * block + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1)
    seen = cols < limit  # [rows, block]
    in_tile = (j * block + jax.lax.broadcasted_iota(jnp.int32, (block, 1), 0)) < visible_len
    updated = []
    for h, (acc, run_max, run_sum) in enumerate(carry):
        rows = pl.ds(shape.first_head + h, block, stride=shape.num_kv_heads)
        k = k_buf[slot, rows, :]
        v = jnp.where(in_tile, v_buf[slot, rows, :], 0)  # rows past every query: stale
        scores = jax.lax.dot_general(
            q_ref[h], k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
        scores = jnp.where(seen, scores * shape.scale, MASK_VALUE)
        new_max = jnp.maximum(run_max, jnp.max(scores, axis=1, keepdims=True))
        correction = jnp.exp(run_max - new_max)
        probs = jnp.where(seen, jnp.exp(scores - new_max), 0.0)
        run_sum = correction * run_sum + jnp.sum(probs, axis=1, keepdims=True)
        pv = jnp.dot(probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
        updated.append((correction * acc + pv, new_max, run_sum))
    return tuple(updated)


def _ragged_kernel(*refs, shape: _Shape):
    """Refs: the prefetched page table and tile lengths, q rows, row limits, the pools in
    HBM, the output, the K / V buffers and their DMA semaphores."""
    table_ref, tile_len_ref, q_ref, limit_ref, k_hbm, v_hbm, out_ref, k_buf, v_buf, sems = refs
    b, i = pl.program_id(0), pl.program_id(1)
    visible_len = tile_len_ref[b * shape.num_tiles + i]
    block = k_buf.shape[1] // shape.num_kv_heads
    num_blocks = jax.lax.div(visible_len + block - 1, block)  # truncating: no sign to lower
    refs = (table_ref, k_hbm, v_hbm, k_buf, v_buf, sems)

    _fetch(refs, b, 0, 0, visible_len, shape)  # nothing where the tile sees nothing

    limit = limit_ref[...]  # [rows, 1]
    rows = q_ref.shape[1]
    init = tuple(
        (
            jnp.zeros((rows, q_ref.shape[2]), jnp.float32),
            jnp.full((rows, 1), MASK_VALUE, jnp.float32),
            jnp.zeros((rows, 1), jnp.float32),
        )
        for _ in range(shape.num_heads)
    )

    def body(j, carry):
        slot = jax.lax.rem(j, 2)

        _fetch(refs, b, j + 1, 1 - slot, visible_len, shape)  # nothing past the last block
        _fetch(refs, b, j, slot, visible_len, shape, wait=True)
        buffers = (k_buf, v_buf, slot, visible_len)
        return _block_update(carry, q_ref, limit, buffers, j, shape)

    carry = jax.lax.fori_loop(0, num_blocks, body, init)
    for h, (acc, _, run_sum) in enumerate(carry):
        out_ref[h] = (acc / jnp.where(run_sum > 0, run_sum, 1.0)).astype(out_ref.dtype)


def _plan(q, k_pool, token_table, scale: float, tiles: RaggedTiles, kv_head) -> _Shape:
    """The launch's static shape; ValueError where the pool or the table is not whole pages
    or the tiles are not legal."""
    num_tokens, num_q_heads = q.shape[1:3]
    num_rows, num_kv_heads = k_pool.shape[:2]
    page_size, width = tiles.page_size, token_table.shape[1]
    if num_rows % page_size or width % page_size:
        raise ValueError(
            f"pool rows {num_rows} / table width {width} not whole pages of {page_size}"
        )
    if tiles.pages_per_block <= 0 or tiles.block_rows <= 0 or tiles.block_rows % 8:
        raise ValueError(f"{tiles} needs pages a block > 0 and rows a tile a multiple of 8")
    heads = num_kv_heads if kv_head is None else 1
    group = num_q_heads // heads
    tokens = tokens_per_tile(num_tokens, group, tiles.block_rows)
    pages_per_row = width // page_size
    return _Shape(
        num_kv_heads, 0 if kv_head is None else kv_head, heads, group, pages_per_row,
        min(tiles.pages_per_block, pages_per_row), page_size, tokens, num_tokens // tokens,
        scale,
    )  # fmt: skip


def _grid_spec(shape: _Shape, batch: int, head_dim: int, dtype) -> Any:
    """Grid (row, query tile); q / out tiles of all read kv heads; the row limits; the pools
    left in HBM; two K and two V buffers of a block's pages (all pool heads) and their DMA
    semaphores."""
    q_spec = pl.BlockSpec(
        (None, shape.num_heads, shape.tile_rows, head_dim), lambda b, i, *_: (b, 0, i, 0)
    )
    buffer_rows = shape.pages_per_block * shape.page_size * shape.num_kv_heads
    buffer = pltpu.VMEM((2, buffer_rows, head_dim), dtype)
    return pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(batch, shape.num_tiles),
        in_specs=[
            q_spec,
            pl.BlockSpec((None, shape.tile_rows, 1), lambda b, i, *_: (b, i, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=q_spec,
        scratch_shapes=[buffer, buffer, pltpu.SemaphoreType.DMA((2, 2))],
    )


def ragged_paged_attention_tpu(
    inputs: PagedInputs,
    scale: float,
    tiles: RaggedTiles,
    kv_head: int | None = None,
    interpret: Any = False,
) -> jax.Array:
    """The module's attention, ``[B, T, Hq, D]`` in q's dtype (ungated). ``interpret``:
    as ``common.tpu_interpret``."""
    inputs.check(kv_head)
    q, k_pool, token_table, ctx_len = inputs.q, inputs.k_pool, inputs.token_table, inputs.ctx_len
    shape = _plan(q, k_pool, token_table, scale, tiles, kv_head)
    batch, num_tokens, num_q_heads, head_dim = q.shape
    width = token_table.shape[1]
    visible = jnp.minimum(ctx_len[:, None], inputs.positions + 1)
    visible = jnp.clip(visible, 0, width).astype(jnp.int32)
    tile_len = visible.reshape(batch, shape.num_tiles, shape.tile_tokens).max(axis=2)
    limit = jnp.repeat(visible, shape.group, axis=1)[..., None]  # [B, T * G, 1], token-major
    split = (batch, num_tokens, shape.num_heads, shape.group, head_dim)
    rows = q.reshape(split).transpose(0, 2, 1, 3, 4)
    rows = rows.reshape(batch, shape.num_heads, num_tokens * shape.group, head_dim)
    page_rows = shape.page_size * shape.num_kv_heads
    pools = [p.reshape(-1, page_rows, head_dim) for p in (k_pool, inputs.v_pool)]

    def ragged_paged_attention(*refs):  # the kernel's name in profiles
        _ragged_kernel(*refs, shape=shape)

    out = pl.pallas_call(
        ragged_paged_attention,
        grid_spec=_grid_spec(shape, batch, head_dim, k_pool.dtype),
        out_shape=jax.ShapeDtypeStruct(rows.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        name="ragged_paged_attention",
        interpret=tpu_interpret(interpret),
    )(
        page_table(token_table, ctx_len, shape.page_size).reshape(-1),
        tile_len.reshape(-1),
        rows,
        limit,
        *pools,
    )
    out = out.reshape(batch, shape.num_heads, num_tokens, shape.group, head_dim)
    return out.transpose(0, 2, 1, 3, 4).reshape(batch, num_tokens, num_q_heads, head_dim)
