"""A few tokens' routing inside Pallas: the router's top-k, the padding rule, the shared
expert and ``group_tokens``' grouping in one program (``route_tokens``), or at the start of
every program of the experts' up launch (``route_tables``, called by ``experts``).

Backends as ``experts``: interpret mode anywhere, NVIDIA GPUs through Triton (every array
padded to powers of two)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lazyspec.kernels.common import whole
from lazyspec.kernels.moe.grouping import UNUSED_TILE, ExpertTiles, token_row_tokens


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
# it up to 2 tokens of 64 experts, the sizes timed (``MoETuning.route_in_up_max_tokens``).
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


@dataclasses.dataclass(frozen=True)
class RoutePlan:
    """The static sizes of a routing program (``route_args``): the top k and its weighting
    (``TokenRouting``), the tokens, the shared expert's id (None without one) and whether
    its weight comes from ``shared_gate``, the slots a token (its pairs rounded up to a
    power of two) and the rows of a tile."""

    top_k: int
    norm_topk_prob: bool
    num_tokens: int
    shared_expert: int | None
    shared_gate: bool
    slots: int
    block_rows: int


def route_tables(refs, route: RoutePlan):
    """Each token's top-k experts and weights from its logits, padding tokens following
    token 0, the shared expert appended, then ``group_tokens``' tables over tiles
    ``t = token * slots + slot`` (``route_tokens``): (tile expert ``[n, slots]``, row weight
    ``[n, slots, block_rows]``, pair row ``[n, slots]``), values of the program that calls it.
    Top-k by rank (``_top_k_by_rank``) up to ``RANK_MAX_ELEMENTS`` comparisons, else by
    rounds of max. The first pair of an expert and each row's weight by comparing every pair
    with each token's pairs (a few tokens). ``refs``: logits, real, then with a shared
    expert its weights ``[n]`` or, with ``shared_gate``, x ``[n, d]`` and the gate ``[d]``."""
    top_k, num_tokens, slots = route.top_k, route.num_tokens, route.slots
    shared_expert, block_rows = route.shared_expert, route.block_rows
    logits_ref, real_ref = refs[:2]
    scores = logits_ref[...].astype(jnp.float32)  # [n, E]
    n, num_experts = scores.shape
    slot = jax.lax.broadcasted_iota(jnp.int32, (n, slots), 1)
    token = jax.lax.broadcasted_iota(jnp.int32, (n, slots), 0)
    if not route.norm_topk_prob:  # the softmax over every expert, then its top k
        exp = jnp.exp(scores - jnp.max(scores, axis=1)[:, None])
        scores = exp / jnp.sum(exp, axis=1)[:, None]
    if n * num_experts * num_experts <= RANK_MAX_ELEMENTS:
        ids, top = _top_k_by_rank(scores, slots)
    else:
        ids, top = _top_k_by_rounds(scores, slots, top_k)
    routed = slot < top_k
    if route.norm_topk_prob:  # the top-k logits' softmax; slot 0 holds the largest
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
        if route.shared_gate:  # the gate's logit rounded to its dtype, as ``linear`` returns it
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


def _route_kernel(*refs, num_args, route):
    """One program: ``route_tables`` of the first ``num_args`` refs into the outputs."""
    tile_ref, weight_ref, pair_ref = refs[num_args:]
    tile_ref[...], weight_ref[...], pair_ref[...] = route_tables(refs[:num_args], route)


def power_of_two(size: int) -> int:
    return 1 << max(size - 1, 0).bit_length()


def pairs_a_token(routing: TokenRouting, shared: bool) -> int:
    """The (token, expert) pairs a token routes to: its top-k, and the shared expert where
    one runs in the same launches."""
    return routing.top_k + shared


def route_args(
    routing: TokenRouting,
    shared_weight: jax.Array | None,
    block_rows: int,
    x: jax.Array | None,
) -> tuple[list[jax.Array], RoutePlan]:
    """The routing program's operands (padded to powers of two for Triton) and the keyword
    arguments of ``route_tables``, after checking ``routing`` (``route_tokens``)."""
    logits = routing.logits
    num_tokens, num_experts = logits.shape
    if num_tokens > block_rows:
        raise ValueError(f"route_tokens takes at most block_rows={block_rows} tokens")
    if not 0 < routing.top_k <= num_experts:
        raise ValueError(f"top_k={routing.top_k} must be in [1, {num_experts}]")
    shared_expert = None if shared_weight is None else num_experts
    n = power_of_two(num_tokens)
    slots = power_of_two(pairs_a_token(routing, shared_weight is not None))
    real = jnp.ones((num_tokens,), jnp.int32) if routing.real is None else routing.real
    pad = ((0, n - num_tokens), (0, power_of_two(num_experts) - num_experts))
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
        width = power_of_two(x.shape[1])  # zero columns add nothing to the logit
        x = x.astype(routing.shared_gate.dtype)  # as ``linear`` casts its input
        args.append(jnp.pad(x, ((0, n - num_tokens), (0, width - x.shape[1]))))
        args.append(jnp.pad(routing.shared_gate, (0, width - x.shape[1])))
    elif shared_weight is not None:
        args.append(jnp.pad(shared_weight.astype(jnp.float32), (0, n - num_tokens)))
    route = RoutePlan(
        routing.top_k,
        routing.norm_topk_prob,
        num_tokens,
        shared_expert,
        shared_gate,
        slots,
        block_rows,
    )
    return args, route


def route_shapes(route: RoutePlan) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The shapes of ``route_tables``' three tables."""
    n, slots, block_rows = power_of_two(route.num_tokens), route.slots, route.block_rows
    return (
        jax.ShapeDtypeStruct((n, slots), jnp.int32),
        jax.ShapeDtypeStruct((n, slots, block_rows), jnp.float32),
        jax.ShapeDtypeStruct((n, slots), jnp.int32),
    )


def tables_as_tiles(tables, num_tokens: int, block_rows: int) -> ExpertTiles:
    """``ExpertTiles`` of the routing tables ``[n, slots]``, ``[n, slots, block_rows]``,
    ``[n, slots]``."""
    tile_expert, row_weight, pair_row = tables
    row_token = token_row_tokens(num_tokens, block_rows, tile_expert.size)
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
    args, route = route_args(routing, shared_weight, block_rows, x)
    num_tokens = routing.logits.shape[0]
    tables = pl.pallas_call(
        functools.partial(_route_kernel, num_args=len(args), route=route),
        grid=(1,),
        in_specs=[whole()] * len(args),
        out_specs=(whole(), whole(), whole()),
        out_shape=route_shapes(route),
        name="moe_route",
        interpret=interpret,
        compiler_params=compiler_params,
    )(*args)
    return tables_as_tiles(tables, num_tokens, block_rows)
