"""Routed experts of a sparse MoE for a few tokens: a Pallas grouped matmul that reads only
the experts that have tokens.

Contract. x ``[N, d]``, routing ``weights [N, k]`` and ``expert_ids [N, k]`` (distinct
experts per token), expert stacks ``up [E, d, I]``, ``down [E, I, d_out]`` and, for SwiGLU
experts, ``gate [E, d, I]``. Returns float32 ``[N, d_out]``: ``sum_j weights[n, j] *
expert_{ids[n, j]}(x[n])`` where an expert is ``down(silu(gate(x)) * up(x))`` with a gate,
else ``down(relu(up(x))^2)`` (Nemotron-H). A pair whose id is outside ``[0, E)`` adds
nothing and takes no staged row (expert parallelism: the stacks are one shard's experts,
ids shifted by the shard's first expert). This is ``layers.moe.grouped_experts`` with the
SwiGLU or relu^2 expert function, computed with float32 accumulation (the intermediate is
rounded once to the weights' dtype, as the XLA form rounds it). A ``SharedExpert`` (one
expert's matrices and a weight per token) runs as expert E, which every token routes to:
one more tile in each launch, whose programs read the shared matrices instead of a stack.

Grouping (``group_pairs``, XLA, no sort): the N * k (token, expert) pairs are counted per
expert (a one-hot sum) and each pair's rank among its expert's pairs is the count of
earlier pairs of that expert (pairwise comparisons for a few pairs, a cumulative sum for
many), so pair p goes to staged row ``tile_start[e] * block_rows + rank``. Every expert with
tokens owns ``ceil(count / block_rows)`` consecutive tiles of ``block_rows`` rows; the
table ``tile_expert`` names each tile's expert and -1 marks the unused tiles of the
static grid, whose size bounds the worst case: ``min(E, N * k) + N * k // block_rows``.
A few tokens (``group_tokens``, up to ``TOKEN_ROWS_MAX_TOKENS``) skip the staging: one tile
per pair, the first pair of each expert names its tile and the others' are unused, and row
r of every tile is token r, so every tile reads x itself (zeros after its rows).

Kernels, two launches (the second needs the whole intermediate row of a tile):
  up    grid ``(tile, inner tile)``: reads the tile's staged rows of x and one column tile
        of its expert's gate and up (each weight tile once for all the tile's rows),
        accumulates over d in float32, applies SwiGLU / relu^2 -> intermediate ``[rows, I]``;
  down  grid ``(tile, output tile)``: intermediate rows times one column tile of the
        expert's down, scaled by each row's routing weight -> float32 ``[rows, d_out]``.
A tile of -1 returns at once: no weight of an expert without tokens is ever read. The
combine sums each token's k staged rows (a gather, no scatter-add, so it is deterministic).
For a few tokens two launches fold into one (``moe_experts_pallas``' options): routed by
the router's logits, the routing program's work runs at the start of every up program
(``route_in_up``), and each up program may apply its intermediate columns' rows of the
down projection itself (``down_in_up``), writing partial sums that are summed after it
(again a sum in a fixed order, no atomics).

Backends: ``interpret=True`` anywhere (the tests, on CPU); NVIDIA GPUs through the Triton
lowering (the expert id is read from a whole-array operand and indexes whole-array weight
refs inside the kernel; dots need ``block_rows`` >= 16 and power-of-two tiles). Not for
TPUs: Mosaic would stage the whole-array weight refs into VMEM. The TPU layout, with
``tile_expert`` scalar-prefetched into the weights' index maps, is ``moe_experts_tpu``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pallas_triton

from lazyspec.kernels.state_update import check_tile, load_rows, whole

UNUSED_TILE = -1
_HIGHEST = jax.lax.Precision.HIGHEST  # IEEE float32 dots in Triton (its default is TF32)


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
    row_token = _token_row_tokens(num_tokens, block_rows, num_pairs)
    return ExpertTiles(tile_expert, row_token, row_weight, pair_row.reshape(num_tokens, top_k))


def _token_row_tokens(num_tokens: int, block_rows: int, num_tiles: int) -> jax.Array:
    """``row_token`` of a grouping by token rows: row r of every tile is token r (0 past
    the tokens)."""
    row = jnp.arange(block_rows, dtype=jnp.int32)
    return jnp.tile(jnp.where(row < num_tokens, row, 0), num_tiles)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["logits", "real", "shared_gate"],
    meta_fields=["top_k", "norm_topk_prob"],
)
@dataclasses.dataclass(frozen=True)
class TokenRouting:
    """A router's scores, for ``moe_experts_pallas`` to pick a few tokens' experts itself
    (``route_tokens``) instead of taking ``weights`` and ``expert_ids``. ``logits [N, E]``:
    the router's output over the E routed experts; ``top_k`` and ``norm_topk_prob`` as
    ``layers.moe.route`` (the top-k logits' softmax, else the softmax's top k); ``real``
    ``[N]`` bool or None: a padding token (false) takes token 0's experts and keeps its own
    weights, as ``layers.moe.padding_follows_token_zero``. ``shared_gate [d]``: the shared
    expert's gate (Qwen3-Next's ``shared_expert_gate``, a linear d -> 1 without bias);
    given, the routing program computes each token's gate logit from x, rounded to the
    gate's dtype as ``layers.linear.linear`` returns it, and weights the shared expert by
    its sigmoid, so the caller computes neither (``SharedExpert.weight`` is not used where
    the program runs)."""

    logits: jax.Array
    top_k: int
    norm_topk_prob: bool
    real: jax.Array | None = None
    shared_gate: jax.Array | None = None


# Up to this many comparisons (tokens x experts x experts) the routing program ranks the
# experts in one comparison of every pair; more take k rounds of max (a few tokens of 512
# experts would hold millions of elements, over Triton's limit for one tensor). 8192 takes
# it up to 2 tokens of 64 experts, the sizes timed (backend's MOE_ROUTE_IN_UP_MAX_TOKENS).
RANK_MAX_ELEMENTS = 8192


def _top_k_by_rank(scores: jax.Array, slots: int) -> tuple[jax.Array, jax.Array]:
    """Each row's experts and scores in order of rank, ``[n, slots]`` (``slots`` <= E): expert
    e's rank is the count of experts scoring above it, or equal with a lower id (as
    ``lax.top_k`` orders equal scores), and slot j takes the expert of rank j: three
    reductions where k rounds of max and argmin are 2k dependent ones."""
    n, num_experts = scores.shape
    mine = jax.lax.broadcasted_iota(jnp.int32, (n, num_experts, num_experts), 1)
    other = jax.lax.broadcasted_iota(jnp.int32, (n, num_experts, num_experts), 2)
    mine_score, other_score = scores[:, :, None], scores[:, None, :]
    ahead = (other_score > mine_score) | ((other_score == mine_score) & (other < mine))
    rank = jnp.sum(ahead.astype(jnp.int32), axis=2)  # [n, E]: a permutation of 0..E-1
    at_slot = rank[:, None, :] == jax.lax.broadcasted_iota(jnp.int32, (n, slots, num_experts), 1)
    expert = jax.lax.broadcasted_iota(jnp.int32, (n, slots, num_experts), 2)
    ids = jnp.sum(jnp.where(at_slot, expert, 0), axis=2)
    return ids, jnp.sum(jnp.where(at_slot, scores[:, None, :], 0.0), axis=2)


def _top_k_by_rounds(scores: jax.Array, slots: int, top_k: int) -> tuple[jax.Array, jax.Array]:
    """``_top_k_by_rank``'s first ``top_k`` slots (the others 0) by k rounds of max, the
    lowest expert id first among equal scores."""
    n, num_experts = scores.shape
    expert = jax.lax.broadcasted_iota(jnp.int32, (n, num_experts), 1)
    slot = jax.lax.broadcasted_iota(jnp.int32, (n, slots), 1)
    ids = jnp.zeros((n, slots), jnp.int32)
    top = jnp.zeros((n, slots), jnp.float32)
    for j in range(top_k):
        best = jnp.max(scores, axis=1)
        pick = jnp.min(jnp.where(scores == best[:, None], expert, num_experts), axis=1)
        ids = jnp.where(slot == j, pick[:, None], ids)
        top = jnp.where(slot == j, best[:, None], top)
        scores = jnp.where(expert == pick[:, None], -jnp.inf, scores)
    return ids, top


def _route_tables(
    refs, *, top_k, norm_topk_prob, num_tokens, shared_expert, shared_gate, slots, block_rows
):
    """Each token's top-k experts and weights from its logits, padding tokens following
    token 0, the shared expert appended, then ``group_tokens``' tables over tiles
    ``t = token * slots + slot`` (``route_tokens``): (tile expert ``[n, slots]``, row weight
    ``[n, slots, block_rows]``, pair row ``[n, slots]``), values of the program that calls it.
    Top-k by rank (``_top_k_by_rank``) up to ``RANK_MAX_ELEMENTS`` comparisons, else by
    rounds of max. The first pair of an expert and each row's weight by comparing every pair
    with each token's pairs (a few tokens). ``refs``: logits, real, then with a shared
    expert its weights ``[n]`` or, with ``shared_gate``, x ``[n, d]`` and the gate ``[d]``."""
    logits_ref, real_ref = refs[:2]
    scores = logits_ref[...].astype(jnp.float32)  # [n, E]
    n, num_experts = scores.shape
    slot = jax.lax.broadcasted_iota(jnp.int32, (n, slots), 1)
    token = jax.lax.broadcasted_iota(jnp.int32, (n, slots), 0)
    if not norm_topk_prob:  # the softmax over every expert, then its top k
        exp = jnp.exp(scores - jnp.max(scores, axis=1)[:, None])
        scores = exp / jnp.sum(exp, axis=1)[:, None]
    if n * num_experts * num_experts <= RANK_MAX_ELEMENTS:
        ids, top = _top_k_by_rank(scores, slots)
    else:
        ids, top = _top_k_by_rounds(scores, slots, top_k)
    routed = slot < top_k
    if norm_topk_prob:  # the top-k logits' softmax; slot 0 holds the largest
        largest = jnp.max(jnp.where(routed, top, -jnp.inf), axis=1)
        exp = jnp.where(routed, jnp.exp(top - largest[:, None]), 0.0)
        weights = exp / jnp.sum(exp, axis=1)[:, None]
    else:
        weights = jnp.where(routed, top, 0.0)
    first_ids = jnp.sum(jnp.where(token == 0, ids, 0), axis=0)  # token 0's experts
    ids = jnp.where(real_ref[...][:, None] != 0, ids, first_ids[None, :])
    pairs = top_k
    if shared_expert is not None:
        ids = jnp.where(slot == top_k, shared_expert, ids)
        if shared_gate:  # the gate's logit rounded to its dtype, as ``linear`` returns it
            x_ref, gate_ref = refs[2:4]
            x, gate = x_ref[...].astype(jnp.float32), gate_ref[...].astype(jnp.float32)
            logit = jnp.sum(x * gate[None, :], axis=1).astype(gate_ref.dtype)
            shared_weight = jax.nn.sigmoid(logit.astype(jnp.float32))
        else:
            shared_weight = refs[2][...].astype(jnp.float32)
        weights = jnp.where(slot == top_k, shared_weight[:, None], weights)
        pairs += 1
    valid = (slot < pairs) & (token < num_tokens)
    num_tiles = n * slots
    # for every pair: the first tile naming its expert, and token r's weight for that expert
    first = jnp.full((n, slots), num_tiles, jnp.int32)
    row_weight = jnp.zeros((n, slots, block_rows), jnp.float32)
    row = jax.lax.broadcasted_iota(jnp.int32, (n, slots, block_rows), 2)
    slot_r = jax.lax.broadcasted_iota(jnp.int32, (slots,), 0)
    for r in range(num_tokens):
        ids_r = jnp.sum(jnp.where(token == r, ids, 0), axis=0)  # [slots]
        weights_r = jnp.sum(jnp.where(token == r, weights, 0.0), axis=0)
        match = (ids[:, :, None] == ids_r[None, None, :]) & (slot_r < pairs)[None, None, :]
        tile_r = jnp.where(match, r * slots + slot_r[None, None, :], num_tiles)
        first = jnp.minimum(first, jnp.min(tile_r, axis=2))
        weight_r = jnp.sum(jnp.where(match, weights_r[None, None, :], 0.0), axis=2)
        row_weight = jnp.where(row == r, weight_r[:, :, None], row_weight)
    used = valid & (first == token * slots + slot)
    tile_expert = jnp.where(used, ids, UNUSED_TILE)
    row_weight = jnp.where(used[:, :, None], row_weight, 0.0)
    pair_row = jnp.where(valid, first * block_rows + token, num_tiles * block_rows)
    return tile_expert, row_weight, pair_row


def _route_kernel(*refs, num_args, **route):
    """One program: ``_route_tables`` of the first ``num_args`` refs into the outputs."""
    tile_ref, weight_ref, pair_ref = refs[num_args:]
    tile_ref[...], weight_ref[...], pair_ref[...] = _route_tables(refs[:num_args], **route)


def _power_of_two(size: int) -> int:
    return 1 << max(size - 1, 0).bit_length()


def pairs_a_token(routing: TokenRouting, shared: bool) -> int:
    """The (token, expert) pairs a token routes to: its top-k, and the shared expert where
    one runs in the same launches."""
    return routing.top_k + shared


def _route_args(
    routing: TokenRouting,
    shared_weight: jax.Array | None,
    block_rows: int,
    x: jax.Array | None,
) -> tuple[list[jax.Array], dict[str, Any]]:
    """The routing program's operands (padded to powers of two for Triton) and the keyword
    arguments of ``_route_tables``, after checking ``routing`` (``route_tokens``)."""
    logits = routing.logits
    num_tokens, num_experts = logits.shape
    if num_tokens > block_rows:
        raise ValueError(f"route_tokens takes at most block_rows={block_rows} tokens")
    if not 0 < routing.top_k <= num_experts:
        raise ValueError(f"top_k={routing.top_k} must be in [1, {num_experts}]")
    shared_expert = None if shared_weight is None else num_experts
    n = _power_of_two(num_tokens)
    slots = _power_of_two(pairs_a_token(routing, shared_weight is not None))
    real = jnp.ones((num_tokens,), jnp.int32) if routing.real is None else routing.real
    pad = ((0, n - num_tokens), (0, _power_of_two(num_experts) - num_experts))
    args = [
        jnp.pad(logits.astype(jnp.float32), pad, constant_values=-jnp.inf),
        jnp.pad(real.astype(jnp.int32), (0, n - num_tokens)),
    ]
    shared_gate = shared_weight is not None and routing.shared_gate is not None
    if shared_gate:
        if x is None or x.shape[0] != num_tokens or x.shape[1:] != routing.shared_gate.shape:
            shape = None if x is None else x.shape
            raise ValueError(
                f"x {shape} must be [{num_tokens}, d] for the shared gate "
                f"{routing.shared_gate.shape}"
            )
        width = _power_of_two(x.shape[1])  # zero columns add nothing to the logit
        x = x.astype(routing.shared_gate.dtype)  # as ``linear`` casts its input
        args.append(jnp.pad(x, ((0, n - num_tokens), (0, width - x.shape[1]))))
        args.append(jnp.pad(routing.shared_gate, (0, width - x.shape[1])))
    elif shared_weight is not None:
        args.append(jnp.pad(shared_weight.astype(jnp.float32), (0, n - num_tokens)))
    route = {
        "top_k": routing.top_k,
        "norm_topk_prob": routing.norm_topk_prob,
        "num_tokens": num_tokens,
        "shared_expert": shared_expert,
        "shared_gate": shared_gate,
        "slots": slots,
        "block_rows": block_rows,
    }
    return args, route


def _route_shapes(num_tokens: int, route: dict[str, Any]) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The shapes of ``_route_tables``' three tables."""
    n, slots, block_rows = _power_of_two(num_tokens), route["slots"], route["block_rows"]
    return (
        jax.ShapeDtypeStruct((n, slots), jnp.int32),
        jax.ShapeDtypeStruct((n, slots, block_rows), jnp.float32),
        jax.ShapeDtypeStruct((n, slots), jnp.int32),
    )


def _tables_as_tiles(tables, num_tokens: int, block_rows: int) -> ExpertTiles:
    """``ExpertTiles`` of the routing tables ``[n, slots]``, ``[n, slots, block_rows]``,
    ``[n, slots]``."""
    tile_expert, row_weight, pair_row = tables
    row_token = _token_row_tokens(num_tokens, block_rows, tile_expert.size)
    return ExpertTiles(
        tile_expert.reshape(-1), row_token, row_weight.reshape(-1), pair_row[:num_tokens]
    )


def route_tokens(
    routing: TokenRouting,
    shared_weight: jax.Array | None,
    block_rows: int,
    interpret: bool = False,
    compiler_params: Any = None,
    x: jax.Array | None = None,
) -> ExpertTiles:
    """``group_tokens``' grouping straight from ``routing``'s logits, in one Pallas program
    (where routing, top-k, the padding rule and the grouping take about six small kernels
    a layer on a GPU). ``shared_weight`` ``[N]``: the shared expert (id E) is each token's
    last pair, with that weight, or, where ``routing.shared_gate`` is given, with the
    sigmoid of its logit computed in the program from the tokens ``x [N, d]``. Tiles are
    ``t = token * slots + slot`` (slots: the pairs per token rounded up to a power of two,
    as are tokens and experts for Triton): each expert's first pair names its tile, the
    others' tiles are unused; ``pair_row`` is ``[N, slots]``, a slot past the pairs
    pointing past the rows (combined as 0)."""
    args, route = _route_args(routing, shared_weight, block_rows, x)
    num_tokens = routing.logits.shape[0]
    tables = pl.pallas_call(
        functools.partial(_route_kernel, num_args=len(args), **route),
        grid=(1,),
        in_specs=[whole()] * len(args),
        out_specs=(whole(), whole(), whole()),
        out_shape=_route_shapes(num_tokens, route),
        name="moe_route",
        interpret=interpret,
        compiler_params=compiler_params,
    )(*args)
    return _tables_as_tiles(tables, num_tokens, block_rows)


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


# ---------------------------------------------------------------- kernels


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.dot(a, b, precision=_HIGHEST, preferred_element_type=jnp.float32)


def _by_expert(expert, shared_expert, compute) -> None:
    """Run ``compute(load)`` for a used tile: ``load(ref, rows, cols)`` reads the tile's
    expert's block of a routed stack ``[E, ...]``, or with ``shared_expert`` (the id E of
    the shared expert, None without one) of the shared expert's matrix for its tiles."""

    def routed(ref, rows, cols):
        return ref[0][expert, rows, cols]

    def shared(ref, rows, cols):
        return ref[1][rows, cols]

    if shared_expert is None:
        pl.when(expert != UNUSED_TILE)(lambda: compute(routed))
        return
    pl.when((expert != UNUSED_TILE) & (expert != shared_expert))(lambda: compute(routed))
    pl.when(expert == shared_expert)(lambda: compute(shared))


def _split_up_refs(refs, gated, shared_expert, down_in_up):
    """(gate / up pairs, the down pair or None, the rest) of the up launch's weight refs:
    the routed stacks, then as many shared matrices with ``shared_expert``; with
    ``down_in_up`` the routed down stack and the shared down matrix after them. A pair is
    (routed ref, shared ref or None), as ``_by_expert``'s ``load`` takes it."""
    num = 2 if gated else 1
    shared = shared_expert is not None
    pairs = [(refs[j], refs[num + j] if shared else None) for j in range(num)]
    refs = refs[num * (1 + shared) :]
    if not down_in_up:
        return pairs, None, refs
    return pairs, (refs[0], refs[1] if shared else None), refs[1 + shared :]


def _up_kernel(tile_expert_ref, x_ref, *refs, gated, shared_expert, down_in_up, **tiles):
    """One tile's rows times one column tile of its expert's gate / up, then the activation
    (``_up_tile``), the tile's expert read from the table. ``refs``: the weights
    (``_split_up_refs``), with ``down_in_up`` the tile's row weights, then the output."""
    pairs, down, rest = _split_up_refs(refs, gated, shared_expert, down_in_up)
    row_weight = rest[0][...] if down_in_up else None
    expert = tile_expert_ref[pl.program_id(0)]
    at = (pl.program_id(0), pl.program_id(1))
    _up_tile(expert, x_ref, pairs, down, row_weight, rest[-1], gated, shared_expert, at, **tiles)


def _routed_up_kernel(
    *refs, num_route_args, route, gated, shared_expert, down_in_up, pair_grid, **tiles
):
    """``_up_kernel`` that routes the tokens itself: every program computes the routing
    tables from the first ``num_route_args`` refs (``_route_tables``, a few tokens' logits)
    and takes its tile's expert (and with ``down_in_up`` its row weights) from them;
    program (0, 0) writes the tables (the last three refs) for the launches and the
    combine after it. One launch fewer than ``route_tokens`` and this launch in turn.
    ``pair_grid`` (pairs a token, with ``down_in_up``): the grid is (inner tile, pair
    ``p``), program p taking tile ``p // pairs * slots + p % pairs`` and writing partials
    ``p``: no programs for the slots past a token's pairs, and a tile's programs
    adjacent."""
    route_refs, refs = refs[:num_route_args], refs[num_route_args:]
    tables = _route_tables(route_refs, **route)
    tile_expert, row_weight = tables[:2]
    slots = tile_expert.shape[1]
    if pair_grid is None:
        at = (pl.program_id(0), pl.program_id(1))
        my_tile = pl.program_id(0)
    else:
        at = (pl.program_id(1), pl.program_id(0))
        my_tile = at[0] // pair_grid * slots + at[0] % pair_grid
    tile = jax.lax.broadcasted_iota(jnp.int32, tile_expert.shape, 0) * slots
    tile = tile + jax.lax.broadcasted_iota(jnp.int32, tile_expert.shape, 1)
    mine = tile == my_tile
    expert = jnp.sum(jnp.where(mine, tile_expert, 0))

    x_ref, refs, table_refs = refs[0], refs[1:-3], refs[-3:]

    @pl.when((pl.program_id(0) == 0) & (pl.program_id(1) == 0))
    def _():
        for ref, table in zip(table_refs, tables):
            ref[...] = table

    pairs, down, rest = _split_up_refs(refs, gated, shared_expert, down_in_up)
    if down_in_up:  # this tile's rows' weights
        row_weight = jnp.sum(jnp.where(mine[:, :, None], row_weight, 0.0), axis=(0, 1))
    else:
        row_weight = None
    _up_tile(expert, x_ref, pairs, down, row_weight, rest[-1], gated, shared_expert, at, **tiles)


def _up_tile(
    expert,
    x_ref,
    pairs,
    down,
    row_weight,
    out_ref,
    gated,
    shared_expert,
    at,
    *,
    block_rows,
    block_inner,
    block_k,
    block_out=None,
    num_tokens=None,
):
    """The rows of a tile of ``expert`` times one column tile of its gate / up
    (``pairs``), then the activation; x is rounded to the weights' dtype as it is read.
    Without ``down`` the intermediate block goes to ``out_ref``. With ``down`` (the down
    pair, ``down_in_up``) the block, rounded to the weights' dtype, times its rows of the
    expert's down, ``block_out`` columns at a time, scaled by ``row_weight [block_rows]``,
    is this program's partial output: ``out_ref[at[0], at[1], :num_tokens]``
    (``[d_out]`` float32 rows; the rows past the tokens are not written, so a few tokens'
    partials move a few rows' bytes). ``at``: (this program's tile or pair, its inner
    tile)."""
    tile, inner_tile = at
    cols = pl.ds(inner_tile * block_inner, block_inner)
    dtype = pairs[0][0].dtype

    def write_partials(part_of):
        """This program's partial rows, ``part_of(chunk)`` a ``block_out``-column chunk at
        a time (rows past the tokens masked out)."""
        row = jax.lax.broadcasted_iota(jnp.int32, (block_rows, block_out), 0)

        def step(j, carry):
            chunk = pl.ds(j * block_out, block_out)
            out = out_ref.at[tile, inner_tile, :, chunk]
            pallas_triton.store(out, part_of(chunk), mask=row < num_tokens)
            return carry

        jax.lax.fori_loop(0, out_ref.shape[-1] // block_out, step, 0)

    def compute(load):
        def step(i, accs):
            chunk = pl.ds(i * block_k, block_k)
            # x's block, or the tokens themselves with zeros after them
            xs = load_rows(x_ref.at[pl.ds(0, block_rows), chunk], 0, x_ref.shape[0])
            xs = xs.astype(dtype)
            products = (_dot(xs, load(w, chunk, cols)) for w in pairs)
            return tuple(acc + p for acc, p in zip(accs, products))

        zeros = jnp.zeros((block_rows, block_inner), jnp.float32)
        accs = jax.lax.fori_loop(0, x_ref.shape[1] // block_k, step, (zeros,) * len(pairs))
        if gated:
            gate, up = accs
            h = gate / (1.0 + jnp.exp(-gate)) * up
        else:
            up = jnp.maximum(accs[0], 0.0)
            h = up * up
        h = h.astype(dtype)
        if down is None:
            out_ref[...] = h
            return
        write_partials(lambda chunk: _dot(h, load(down, cols, chunk)) * row_weight[:, None])

    _by_expert(expert, shared_expert, compute)


def _down_kernel(tile_expert_ref, h_ref, *refs, block_out, block_k, shared_expert):
    """One tile's intermediate rows times a column tile of its expert's down, weighted.
    ``refs``: the routed down stack, the shared down matrix with ``shared_expert``, the
    rows' weights, the output."""
    down = (refs[0], refs[1] if shared_expert is not None else None)
    row_weight_ref, out_ref = refs[-2], refs[-1]
    expert = tile_expert_ref[pl.program_id(0)]
    cols = pl.ds(pl.program_id(1) * block_out, block_out)

    def compute(load):
        def step(i, acc):
            chunk = pl.ds(i * block_k, block_k)
            return acc + _dot(h_ref[:, chunk], load(down, chunk, cols))

        zeros = jnp.zeros((h_ref.shape[0], block_out), jnp.float32)
        acc = jax.lax.fori_loop(0, h_ref.shape[1] // block_k, step, zeros)
        out_ref[...] = acc * row_weight_ref[...][:, None]

    _by_expert(expert, shared_expert, compute)


def check_experts(
    x: jax.Array, expert_ids: jax.Array, up: jax.Array, down: jax.Array, gate: jax.Array | None
) -> None:
    """ValueError unless the shapes fit the module docstring's contract."""
    num_experts, width, inner = up.shape
    if x.ndim != 2 or x.shape[1] != width:
        raise ValueError(f"x {x.shape} must be [N, {width}] for experts {up.shape}")
    if expert_ids.ndim != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"expert_ids {expert_ids.shape} must be [{x.shape[0]}, k]")
    if down.shape[:2] != (num_experts, inner):
        raise ValueError(f"down {down.shape} must be [{num_experts}, {inner}, d_out]")
    if gate is not None and gate.shape != up.shape:
        raise ValueError(f"gate {gate.shape} must match up {up.shape}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SharedExpert:
    """An expert every token runs beside its routed ones (Qwen3-Next's gated shared expert):
    ``up [d, I]``, ``down [I, d_out]``, ``gate [d, I]`` (None for relu^2 experts), the
    widths and dtype of one routed expert, and ``weight [N]`` float32, each token's scale
    of its output (the sigmoid of the shared gate)."""

    up: jax.Array
    down: jax.Array
    gate: jax.Array | None
    weight: jax.Array


def check_routing(x: jax.Array, routing: TokenRouting, up, down, gate) -> None:
    """``check_experts`` for a call routed by ``routing`` (logits over the stacks' experts)."""
    num_experts = up.shape[0]
    if routing.logits.shape != (x.shape[0], num_experts):
        raise ValueError(
            f"routing logits {routing.logits.shape} must be [{x.shape[0]}, {num_experts}]"
        )
    if routing.real is not None and routing.real.shape != (x.shape[0],):
        raise ValueError(f"routing real {routing.real.shape} must be [{x.shape[0]}]")
    if routing.shared_gate is not None and routing.shared_gate.shape != x.shape[1:]:
        raise ValueError(f"routing shared_gate {routing.shared_gate.shape} must be {x.shape[1:]}")
    ids = jax.ShapeDtypeStruct((x.shape[0], routing.top_k), jnp.int32)
    check_experts(x, ids, up, down, gate)


def check_shared(shared: SharedExpert, num_tokens: int, up, down, gate) -> None:
    """ValueError unless ``shared``'s matrices are one routed expert's shapes and dtype."""
    pairs = [("up", shared.up, up), ("down", shared.down, down)]
    if (shared.gate is None) != (gate is None):
        raise ValueError("the shared expert has a gate exactly when the routed experts do")
    if gate is not None:
        pairs.append(("gate", shared.gate, gate))
    for name, matrix, stack in pairs:
        if matrix.shape != stack.shape[1:] or matrix.dtype != stack.dtype:
            raise ValueError(
                f"shared {name} {matrix.shape} {matrix.dtype} must be one routed expert's "
                f"{stack.shape[1:]} {stack.dtype}"
            )
    if shared.weight.shape != (num_tokens,):
        raise ValueError(f"shared weight {shared.weight.shape} must be [{num_tokens}]")


def moe_experts_pallas(
    x: jax.Array,
    weights: jax.Array,
    expert_ids: jax.Array,
    up: jax.Array,
    down: jax.Array,
    gate: jax.Array | None = None,
    *,
    shared: SharedExpert | None = None,
    routing: TokenRouting | None = None,
    block_rows: int = 16,
    block_inner: int | None = None,
    block_out: int | None = None,
    block_k: int | None = None,
    token_rows: bool | None = None,
    interpret: bool = False,
    compiler_params: Any = None,
    block_k_down: int | None = None,
    down_compiler_params: Any = None,
    route_in_up: bool = False,
    down_in_up: bool = False,
    pair_grid: bool = False,
) -> jax.Array:
    """Routed experts (module docstring has the contract); float32 ``[N, d_out]``. Tiles
    None are whole axes; ``block_k`` is the contraction chunk of both launches, unless
    ``block_k_down`` gives the down launch's (a tile sweep's knob: the down launch's whole
    intermediate row may fit in one chunk where the up launch's would not);
    ``down_compiler_params``, likewise, the down launch's, else ``compiler_params``.
    ``token_rows``: group with ``group_tokens`` (every tile reads x itself, zeros after
    its rows) rather than ``group_pairs`` (tiles of staged rows); None takes
    ``group_tokens`` up to ``TOKEN_ROWS_MAX_TOKENS`` tokens (and ``block_rows``).
    ``shared``: adds ``shared.weight[n] * shared_expert(x[n])`` to each token's sum, run as
    one more expert (id E, routed to by every token with that weight) in the same two
    launches, so a step runs no kernels of its own for it. ``routing``: where the grouping
    is by token rows, ``route_tokens`` picks the experts from its logits (``weights`` and
    ``expert_ids`` unused: they may be None); elsewhere they are used as given.
    ``route_in_up``: that routing runs inside the up launch (``_routed_up_kernel``, every
    program routing the few tokens itself) instead of a launch of its own before it.
    ``down_in_up`` (token rows only): the up launch's programs apply their rows of the
    down projection too, each writing its partial sums of the tokens' outputs (a token's
    row of every used tile: rows of tokens routed elsewhere weigh 0), which are summed
    after it: no down launch and no intermediate, for a few tokens (the partials grow with
    tokens x tiles x inner tiles). ``pair_grid`` (with ``route_in_up`` and ``down_in_up``):
    the launch's grid is (inner tile, pair), a program per token's pair rather than per
    slot (the pairs rounded up to a power of two), so fewer programs and partials
    (``_routed_up_kernel``)."""
    num_tokens = x.shape[0]
    if token_rows is None:
        token_rows = num_tokens <= min(TOKEN_ROWS_MAX_TOKENS, block_rows)
    by_logits = token_rows and routing is not None
    if by_logits:
        check_routing(x, routing, up, down, gate)
    else:
        check_experts(x, expert_ids, up, down, gate)
    num_experts, width, inner = up.shape
    shared_expert = None
    if shared is not None:
        check_shared(shared, x.shape[0], up, down, gate)
        shared_expert = num_experts
        num_experts += 1
        if not by_logits:  # the shared expert as every token's last pair
            every = jnp.full((x.shape[0], 1), shared_expert, jnp.int32)
            expert_ids = jnp.concatenate([expert_ids.astype(jnp.int32), every], axis=1)
            weights = jnp.concatenate(
                [weights.astype(jnp.float32), shared.weight.astype(jnp.float32)[:, None]], axis=1
            )
    out_width = down.shape[2]
    bi = check_tile("block_inner", inner, block_inner)
    bo = check_tile("block_out", out_width, block_out)
    bk_up = check_tile("block_k", width, block_k)
    bk_down = check_tile("block_k", inner, block_k if block_k_down is None else block_k_down)
    if block_rows <= 0:
        raise ValueError(f"block_rows={block_rows} must be positive")
    route_in_up = by_logits and route_in_up
    shared_weight = None if shared is None else shared.weight
    if route_in_up:  # the tables come out of the up launch
        route_args, route = _route_args(routing, shared_weight, block_rows, x)
        table_shapes = _route_shapes(num_tokens, route)
        num_tiles = math.prod(table_shapes[0].shape)  # a tile per (token, slot)
    else:
        if by_logits:
            grouped = route_tokens(
                routing, shared_weight, block_rows, interpret, compiler_params, x
            )
        elif token_rows:
            grouped = group_tokens(weights, expert_ids, num_experts, block_rows)
        else:
            grouped = group_pairs(weights, expert_ids, num_experts, block_rows)
        num_tiles = grouped.tile_expert.shape[0]
    if token_rows:  # every tile reads the tokens themselves, as they are (no padded copy)
        staged, x_spec = x, whole()
    else:
        staged = x.astype(up.dtype)[grouped.row_token]  # [num_tiles * block_rows, d]
        x_spec = pl.BlockSpec((block_rows, width), lambda t, i: (t, 0))
    num_rows = num_tiles * block_rows
    projections = (up,) if gate is None else (gate, up)
    downs = (down,)
    if shared is not None:
        projections += (shared.up,) if gate is None else (shared.gate, shared.up)
        downs += (shared.down,)
    options = {"interpret": interpret, "compiler_params": compiler_params}

    down_in_up = token_rows and down_in_up
    up_tiles = {
        "gated": gate is not None,
        "block_rows": block_rows,
        "block_inner": bi,
        "block_k": bk_up,
        "shared_expert": shared_expert,
        "down_in_up": down_in_up,
    }
    grid = (num_tiles, inner // bi)
    # with pair_grid, the pairs a token (program p: tile p // pairs * slots + p % pairs)
    pairs = None
    if route_in_up and down_in_up and pair_grid:
        pairs = pairs_a_token(routing, shared is not None)
        grid = (inner // bi, table_shapes[0].shape[0] * pairs)
    weight_specs = [whole()] * len(projections)
    if down_in_up:  # each program's partial sums of its tokens' outputs
        up_tiles.update(block_out=bo, num_tokens=num_tokens)
        projections += downs
        weight_specs += [whole()] * len(downs)
        out_spec = whole()
        parts = grid if pairs is None else grid[::-1]  # [tile or pair, inner tile]
        out_shape = jax.ShapeDtypeStruct((*parts, block_rows, out_width), jnp.float32)
    else:
        out_spec = pl.BlockSpec((block_rows, bi), lambda t, i: (t, i))
        out_shape = jax.ShapeDtypeStruct((num_rows, inner), up.dtype)
    if route_in_up:
        hidden, *tables = pl.pallas_call(
            functools.partial(
                _routed_up_kernel,
                num_route_args=len(route_args),
                route=route,
                pair_grid=pairs,
                **up_tiles,
            ),
            grid=grid,
            in_specs=[whole()] * len(route_args) + [x_spec] + weight_specs,
            out_specs=(out_spec, whole(), whole(), whole()),
            out_shape=(out_shape, *table_shapes),
            name="moe_experts_up",
            **options,
        )(*route_args, staged, *projections)
        grouped = _tables_as_tiles(tables, num_tokens, block_rows)
    else:
        weight_args = list(projections)
        if down_in_up:
            weight_specs.append(pl.BlockSpec((block_rows,), lambda t, i: (t,)))
            weight_args.append(grouped.row_weight)
        hidden = pl.pallas_call(
            functools.partial(_up_kernel, **up_tiles),
            grid=grid,
            in_specs=[whole(), x_spec] + weight_specs,
            out_specs=out_spec,
            out_shape=out_shape,
            name="moe_experts_up",
            **options,
        )(grouped.tile_expert, staged, *weight_args)
    if down_in_up:  # every used tile's rows, each token weighted 0 where it did not route
        partial = hidden[:, :, :num_tokens]  # the rows the programs wrote
        used = grouped.tile_expert != UNUSED_TILE
        if pairs is not None:  # the partials of each token's first pairs
            used = used.reshape(table_shapes[0].shape)[:, :pairs].reshape(-1)
        return jnp.sum(jnp.where(used[:, None, None, None], partial, 0.0), axis=(0, 1))

    down_kernel = functools.partial(
        _down_kernel, block_out=bo, block_k=bk_down, shared_expert=shared_expert
    )
    rows = pl.pallas_call(
        down_kernel,
        grid=(num_tiles, out_width // bo),
        in_specs=[
            whole(),
            pl.BlockSpec((block_rows, inner), lambda t, j: (t, 0)),
            *[whole()] * len(downs),
            pl.BlockSpec((block_rows,), lambda t, j: (t,)),
        ],
        out_specs=pl.BlockSpec((block_rows, bo), lambda t, j: (t, j)),
        out_shape=jax.ShapeDtypeStruct((num_rows, out_width), jnp.float32),
        name="moe_experts_down",
        interpret=interpret,
        compiler_params=compiler_params if down_compiler_params is None else down_compiler_params,
    )(grouped.tile_expert, hidden, *downs, grouped.row_weight)
    return combine_pairs(rows, grouped.pair_row)
