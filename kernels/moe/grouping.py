"""The (token, expert) pairs of a few tokens grouped by expert into row tiles, for the
routed-experts kernels (``experts``, ``experts_tpu``), and the combine of their rows.

Grouping (``group_pairs``, XLA, no sort): the N * k (token, expert) pairs are counted per
expert (a one-hot sum) and each pair's rank among its expert's pairs is the count of
earlier pairs of that expert (pairwise comparisons for a few pairs, a cumulative sum for
many), so pair p goes to staged row ``tile_start[e] * block_rows + rank``. Every expert with
tokens owns ``ceil(count / block_rows)`` consecutive tiles of ``block_rows`` rows; the
table ``tile_expert`` names each tile's expert and -1 marks the unused tiles of the
static grid, whose size bounds the worst case: ``min(E, N * k) + N * k // block_rows``.
A few tokens (``group_tokens``, up to ``TOKEN_ROWS_MAX_TOKENS``) skip the staging: one tile
per pair, the first pair of each expert names its tile and the others' are unused, and row
r of every tile is token r, so every tile reads x itself (zeros after its rows). A pair
whose expert id is outside ``[0, E)`` (another shard's expert) takes no row.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

UNUSED_TILE = -1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertTiles:
    """The pairs grouped by expert. tile_expert ``[num_tiles]`` (-1: unused tile);
    row_token ``[num_tiles * block_rows]`` token of each staged row (0 on padding rows);
    row_weight: the pair's routing weight (0 on padding rows); pair_row ``[N, k]``: the
    staged row of each (token, expert) pair."""

    tile_expert: jax.Array
    row_token: jax.Array
    row_weight: jax.Array
    pair_row: jax.Array


def max_tiles(num_pairs: int, num_experts: int, block_rows: int) -> int:
    """Tiles enough for any routing: sum_e ceil(c_e / r) <= sum_e floor(c_e / r) + #active."""
    return min(num_experts, num_pairs) + num_pairs // block_rows


def _local_pairs(expert_ids: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """The pairs' expert ids, flat ``[N * k]`` int32, and which of them are this call's
    (in ``[0, num_experts)``; the others are another shard's experts)."""
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    return flat, (flat >= 0) & (flat < num_experts)


# Up to this many (token, expert) pairs, ``group_pairs`` finds ranks and fills the staged
# rows by comparing every pair with every other and every staged row (reductions that fuse,
# a few kernels); more pairs take a cumulative sum over the pairs and scatters, whose cost
# grows with the pairs, not their square.
COMPARE_MAX_PAIRS = 256


def group_pairs(
    weights: jax.Array,
    expert_ids: jax.Array,
    num_experts: int,
    block_rows: int,
    compare: bool | None = None,
) -> ExpertTiles:
    """Group the (token, expert) pairs by expert into tiles of ``block_rows`` rows with a
    counting pass (module docstring); pairs of one expert keep token order. ``compare``
    picks the form (the same result): pairwise comparisons, or a cumulative sum and
    scatters; None takes comparisons up to ``COMPARE_MAX_PAIRS`` pairs."""
    num_tokens, top_k = expert_ids.shape
    num_pairs = num_tokens * top_k
    if compare is None:
        compare = num_pairs <= COMPARE_MAX_PAIRS
    flat, local = _local_pairs(expert_ids, num_experts)
    flat = jnp.where(local, flat, 0)
    experts = jnp.arange(num_experts, dtype=jnp.int32)
    one_hot = (flat[:, None] == experts[None, :]) & local[:, None]
    counts = jnp.sum(one_hot, axis=0, dtype=jnp.int32)
    pair = jnp.arange(num_pairs, dtype=jnp.int32)
    if compare:  # earlier local pairs of the same expert
        same = (flat[None, :] == flat[:, None]) & local[None, :] & (pair[None, :] < pair[:, None])
        rank = jnp.sum(same, axis=1, dtype=jnp.int32)
    else:
        before = jnp.cumsum(one_hot, axis=0, dtype=jnp.int32) - one_hot  # earlier pairs, same e
        rank = jnp.take_along_axis(before, flat[:, None], axis=1)[:, 0]
    tiles = (counts + block_rows - 1) // block_rows
    # inclusive prefix sum over the experts as one reduction (a cumsum is a reduce_window,
    # a kernel of its own on GPUs)
    tile_end = jnp.sum(jnp.where(experts[None, :] <= experts[:, None], tiles[None, :], 0), axis=1)
    tile = jnp.arange(max_tiles(num_pairs, num_experts, block_rows), dtype=jnp.int32)
    num_rows = tile.shape[0] * block_rows
    # a dropped pair's row is one past the staged rows: written nowhere, combined as 0
    pair_row = jnp.where(local, (tile_end - tiles)[flat] * block_rows + rank, num_rows)
    # the expert of tile t is the first whose tiles end after t
    tile_expert = jnp.sum(tile_end[None, :] <= tile[:, None], axis=1, dtype=jnp.int32)
    tile_expert = jnp.where(tile < tile_end[-1], tile_expert, UNUSED_TILE)
    pair_token = pair // top_k
    pair_weight = weights.reshape(-1).astype(jnp.float32)
    if compare:  # each staged row is some pair's or none's
        hit = pair_row[None, :] == jnp.arange(num_rows, dtype=jnp.int32)[:, None]
        row_token = jnp.sum(jnp.where(hit, pair_token[None, :], 0), axis=1, dtype=jnp.int32)
        row_weight = jnp.sum(jnp.where(hit, pair_weight[None, :], 0.0), axis=1)
    else:
        row_token = jnp.zeros((num_rows,), jnp.int32).at[pair_row].set(pair_token, mode="drop")
        row_weight = jnp.zeros((num_rows,), jnp.float32).at[pair_row].set(pair_weight, mode="drop")
    return ExpertTiles(tile_expert, row_token, row_weight, pair_row.reshape(num_tokens, top_k))


# Up to this many tokens ``moe_experts_pallas`` takes ``group_tokens``: every tile's rows are
# the tokens themselves, so no staged copy of x is gathered and a pair's tile is found by one
# comparison of the pairs (two small reductions in all, where ``group_pairs`` takes about
# eight kernels on a GPU).
TOKEN_ROWS_MAX_TOKENS = 8


def group_tokens(
    weights: jax.Array, expert_ids: jax.Array, num_experts: int, block_rows: int
) -> ExpertTiles:
    """The grouping of at most ``block_rows`` tokens with one tile per (token, expert) pair
    and row r of every tile = token r: the tile of a pair is the first local pair routed to
    its expert, which names that tile's expert; the other pairs' tiles are unused (-1). Row r
    of tile t carries token r's weight for tile t's expert (0 where token r does not route
    to it: its row is computed, weighted 0 and combined by nobody). Same contract as
    ``group_pairs``; row_token is r on row r of every tile (0 past the tokens)."""
    num_tokens, top_k = expert_ids.shape
    if num_tokens > block_rows:
        raise ValueError(f"group_tokens takes at most block_rows={block_rows} tokens")
    num_pairs = num_tokens * top_k
    flat, local = _local_pairs(expert_ids, num_experts)
    pair = jnp.arange(num_pairs, dtype=jnp.int32)
    same = (flat[None, :] == flat[:, None]) & local[None, :] & (pair[None, :] <= pair[:, None])
    first = jnp.min(jnp.where(same, pair[None, :], num_pairs), axis=1)  # itself if first
    tile_expert = jnp.where(local & (first == pair), flat, UNUSED_TILE)
    num_rows = num_pairs * block_rows
    token = pair // top_k
    pair_row = jnp.where(local, first * block_rows + token, num_rows)
    row = jnp.arange(block_rows, dtype=jnp.int32)
    pair_weight = weights.reshape(-1).astype(jnp.float32)
    hit = (  # [tile, row, pair]: the pair is row r's token's, routed to tile t's expert
        (flat[None, None, :] == tile_expert[:, None, None])
        & (token[None, None, :] == row[None, :, None])
        & local[None, None, :]
    )
    row_weight = jnp.sum(jnp.where(hit, pair_weight[None, None, :], 0.0), axis=2).reshape(-1)
    row_token = token_row_tokens(num_tokens, block_rows, num_pairs)
    return ExpertTiles(tile_expert, row_token, row_weight, pair_row.reshape(num_tokens, top_k))


def token_row_tokens(num_tokens: int, block_rows: int, num_tiles: int) -> jax.Array:
    """``row_token`` of a grouping by token rows: row r of every tile is token r (0 past
    the tokens)."""
    row = jnp.arange(block_rows, dtype=jnp.int32)
    return jnp.tile(jnp.where(row < num_tokens, row, 0), num_tiles)


def combine_pairs(rows: jax.Array, pair_row: jax.Array) -> jax.Array:
    """Each token's sum of its pairs' weighted rows ``[N, d_out]`` (a gather, no
    scatter-add); a dropped pair (row past ``rows``: another shard's expert) adds 0."""
    # pair_row computed once, before: left to itself XLA folds the pairwise reductions that
    # find it into this gather, which then redoes them for every output element (on an
    # H200, 7 us of a layer's 8 at one token)
    pair_row = jax.lax.optimization_barrier(pair_row)
    kept = pair_row < rows.shape[0]
    picked = rows[jnp.where(kept, pair_row, 0)]
    return jnp.sum(jnp.where(kept[..., None], picked, 0.0), axis=1)
