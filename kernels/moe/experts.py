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

The pairs are grouped by expert into tiles of rows first (``grouping``: staged rows, or for
a few tokens the tokens themselves as every tile's rows). Kernels, two launches (the second
needs the whole intermediate row of a tile):
  up    grid ``(tile, inner tile)``: reads the tile's staged rows of x and one column tile
        of its expert's gate and up (each weight tile once for all the tile's rows),
        accumulates over d in float32, applies SwiGLU / relu^2 -> intermediate ``[rows, I]``;
  down  grid ``(tile, output tile)``: intermediate rows times one column tile of the
        expert's down, scaled by each row's routing weight -> float32 ``[rows, d_out]``.
A tile of -1 returns at once: no weight of an expert without tokens is ever read. The
combine sums each token's k staged rows (a gather, no scatter-add, so it is deterministic).
For a few tokens two launches fold into one (``MoELaunch``): routed by the router's logits,
the routing program's work (``routing``) runs at the start of every up program
(``route_in_up``, the form ``_routed_in_up``), and each up program may apply its
intermediate columns' rows of the down projection itself (``down_in_up``, the form
``_folded`` or ``_routed_in_up``), writing partial sums that are summed after it (again a
sum in a fixed order, no atomics). ``_up_then_down`` is the two-launch form.

Backends: ``interpret=True`` anywhere (the tests, on CPU); NVIDIA GPUs through the Triton
lowering (the expert id is read from a whole-array operand and indexes whole-array weight
refs inside the kernel; dots need ``block_rows`` >= 16 and power-of-two tiles). Not for
TPUs: Mosaic would stage the whole-array weight refs into VMEM. The TPU layout, with
``tile_expert`` scalar-prefetched into the weights' index maps, is ``experts_tpu``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pallas_triton

from lazyspec.kernels.common import load_rows, whole
from lazyspec.kernels.moe.grouping import (
    UNUSED_TILE,
    ExpertTiles,
    combine_pairs,
    group_pairs,
    group_tokens,
)
from lazyspec.kernels.moe.plan import ExpertsPlan, MoELaunch, SharedExpert, plan_experts
from lazyspec.kernels.moe.routing import (
    RoutePlan,
    TokenRouting,
    pairs_a_token,
    route_args,
    route_shapes,
    route_tables,
    route_tokens,
    tables_as_tiles,
)

_HIGHEST = jax.lax.Precision.HIGHEST  # IEEE float32 dots in Triton (its default is TF32)


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


def _split_up_refs(refs, plan: ExpertsPlan):
    """(gate / up pairs, the down pair or None, the rest) of the up launch's weight refs:
    the routed stacks, then as many shared matrices with ``shared_expert``; with
    ``down_in_up`` the routed down stack and the shared down matrix after them. A pair is
    (routed ref, shared ref or None), as ``_by_expert``'s ``load`` takes it."""
    num = 2 if plan.gated else 1
    shared = plan.shared_expert is not None
    pairs = [(refs[j], refs[num + j] if shared else None) for j in range(num)]
    refs = refs[num * (1 + shared) :]
    if not plan.down_in_up:
        return pairs, None, refs
    return pairs, (refs[0], refs[1] if shared else None), refs[1 + shared :]


def _up_kernel(tile_expert_ref, x_ref, *refs, plan: ExpertsPlan):
    """One tile's rows times one column tile of its expert's gate / up, then the activation
    (``_up_tile``), the tile's expert read from the table. ``refs``: the weights
    (``_split_up_refs``), with ``down_in_up`` the tile's row weights, then the output."""
    pairs, down, rest = _split_up_refs(refs, plan)
    row_weight = rest[0][...] if plan.down_in_up else None
    expert = tile_expert_ref[pl.program_id(0)]
    at = (pl.program_id(0), pl.program_id(1))
    _up_tile(expert, x_ref, (pairs, down), row_weight, rest[-1], at, plan)


def _routed_up_kernel(*refs, num_route_args, route: RoutePlan, pair_grid, plan: ExpertsPlan):
    """``_up_kernel`` that routes the tokens itself: every program computes the routing
    tables from the first ``num_route_args`` refs (``route_tables``, a few tokens' logits)
    and takes its tile's expert (and with ``down_in_up`` its row weights) from them;
    program (0, 0) writes the tables (the last three refs) for the launches and the
    combine after it. One launch fewer than ``route_tokens`` and this launch in turn.
    ``pair_grid`` (pairs a token, with ``down_in_up``): the grid is (inner tile, pair
    ``p``), program p taking tile ``p // pairs * slots + p % pairs`` and writing partials
    ``p``: no programs for the slots past a token's pairs, and a tile's programs
    adjacent."""
    route_refs, refs = refs[:num_route_args], refs[num_route_args:]
    tables = route_tables(route_refs, route)
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

    pairs, down, rest = _split_up_refs(refs, plan)
    if plan.down_in_up:  # this tile's rows' weights
        row_weight = jnp.sum(jnp.where(mine[:, :, None], row_weight, 0.0), axis=(0, 1))
    else:
        row_weight = None
    _up_tile(expert, x_ref, (pairs, down), row_weight, rest[-1], at, plan)


def _up_tile(expert, x_ref, weights, row_weight, out_ref, at, plan: ExpertsPlan):
    """The rows of a tile of ``expert`` times one column tile of its gate / up
    (``weights``: the gate / up pairs and the down pair or None), then the activation; x
    is rounded to the weights' dtype as it is read. Without ``down`` the intermediate block
    goes to ``out_ref``. With ``down`` (the down pair, ``down_in_up``) the block, rounded
    to the weights' dtype, times its rows of the expert's down, ``block_out`` columns at a
    time, scaled by ``row_weight [block_rows]``, is this program's partial output:
    ``out_ref[at[0], at[1], :num_tokens]`` (``[d_out]`` float32 rows; the rows past the
    tokens are not written, so a few tokens' partials move a few rows' bytes). ``at``:
    (this program's tile or pair, its inner tile)."""
    pairs, down = weights
    block_rows, block_inner, block_k = plan.block_rows, plan.block_inner, plan.block_k
    block_out, num_tokens = plan.block_out, plan.num_tokens
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
        if plan.gated:
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

    _by_expert(expert, plan.shared_expert, compute)


def _down_kernel(tile_expert_ref, h_ref, *refs, plan: ExpertsPlan):
    """One tile's intermediate rows times a column tile of its expert's down, weighted.
    ``refs``: the routed down stack, the shared down matrix with a shared expert, the
    rows' weights, the output."""
    block_out, block_k, shared_expert = plan.block_out, plan.block_k_down, plan.shared_expert
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


# ---------------------------------------------------------------- launches


def _expert_weights(up, down, gate, shared) -> tuple[tuple, tuple]:
    """(the gate / up matrices the up launch reads, the down ones): the routed stacks, then
    the shared expert's matrices."""
    projections = (up,) if gate is None else (gate, up)
    downs = (down,)
    if shared is not None:
        projections += (shared.up,) if gate is None else (shared.gate, shared.up)
        downs += (shared.down,)
    return projections, downs


def _group(x, weights, expert_ids, shared, routing, plan: ExpertsPlan) -> ExpertTiles:
    """The pairs grouped by expert ahead of the up launch: routed from the logits in a
    program of its own (``route_tokens``), else by token rows or staged rows, the shared
    expert as every token's last pair."""
    if plan.by_logits:
        shared_weight = None if shared is None else shared.weight
        args = (plan.block_rows, plan.interpret, plan.compiler_params, x)
        return route_tokens(routing, shared_weight, *args)
    if shared is not None:  # the shared expert as every token's last pair
        every = jnp.full((x.shape[0], 1), plan.shared_expert, jnp.int32)
        expert_ids = jnp.concatenate([expert_ids.astype(jnp.int32), every], axis=1)
        weights = jnp.concatenate(
            [weights.astype(jnp.float32), shared.weight.astype(jnp.float32)[:, None]], axis=1
        )
    group = group_tokens if plan.token_rows else group_pairs
    return group(weights, expert_ids, plan.num_experts, plan.block_rows)


def _staged_rows(x: jax.Array, grouped: ExpertTiles, plan: ExpertsPlan):
    """(x as the up launch reads it, its spec): by token rows the tokens themselves, as
    they are (no padded copy); else the staged rows ``[num_tiles * block_rows, d]``."""
    if plan.token_rows:
        return x, whole()
    staged = x.astype(plan.dtype)[grouped.row_token]
    return staged, pl.BlockSpec((plan.block_rows, x.shape[1]), lambda t, i: (t, 0))


def _intermediate(num_tiles: int, plan: ExpertsPlan):
    """(spec, shape) of the up launch's intermediate rows ``[num_tiles * block_rows, I]``."""
    spec = pl.BlockSpec((plan.block_rows, plan.block_inner), lambda t, i: (t, i))
    return spec, jax.ShapeDtypeStruct((num_tiles * plan.block_rows, plan.inner), plan.dtype)


def _partials(parts: tuple[int, int], plan: ExpertsPlan):
    """(spec, shape) of the folded up launch's partial sums ``[*parts, block_rows, d_out]``
    float32, ``parts`` (tiles or pairs, inner tiles)."""
    shape = (*parts, plan.block_rows, plan.out_width)
    return whole(), jax.ShapeDtypeStruct(shape, jnp.float32)


def _up_call(kernel, grid, in_specs, out_specs, out_shape, plan: ExpertsPlan):
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        name="moe_experts_up",
        interpret=plan.interpret,
        compiler_params=plan.compiler_params,
    )


def _sum_partials(partials, tile_expert, plan: ExpertsPlan, pairs=None, table_shape=None):
    """Each token's output: the sum of every used tile's partial rows (a token weighs 0
    in a tile of an expert it did not route to); with ``pairs`` (the pair grid) the
    partials of each token's first ``pairs`` slots of the ``table_shape`` tables."""
    partial = partials[:, :, : plan.num_tokens]  # the rows the programs wrote
    used = tile_expert != UNUSED_TILE
    if pairs is not None:
        used = used.reshape(table_shape)[:, :pairs].reshape(-1)
    return jnp.sum(jnp.where(used[:, None, None, None], partial, 0.0), axis=(0, 1))


def _down_and_combine(hidden, grouped: ExpertTiles, downs, plan: ExpertsPlan) -> jax.Array:
    """The down launch over the intermediate rows, then each token's combine."""
    num_tiles = grouped.tile_expert.shape[0]
    rows = pl.pallas_call(
        functools.partial(_down_kernel, plan=plan),
        grid=(num_tiles, plan.out_width // plan.block_out),
        in_specs=[
            whole(),
            pl.BlockSpec((plan.block_rows, plan.inner), lambda t, j: (t, 0)),
            *[whole()] * len(downs),
            pl.BlockSpec((plan.block_rows,), lambda t, j: (t,)),
        ],
        out_specs=pl.BlockSpec((plan.block_rows, plan.block_out), lambda t, j: (t, j)),
        out_shape=jax.ShapeDtypeStruct((num_tiles * plan.block_rows, plan.out_width), jnp.float32),
        name="moe_experts_down",
        interpret=plan.interpret,
        compiler_params=plan.down_compiler_params,
    )(grouped.tile_expert, hidden, *downs, grouped.row_weight)
    return combine_pairs(rows, grouped.pair_row)


def _up_then_down(grouped, staged, x_spec, projections, downs, plan: ExpertsPlan):
    """Two launches: the intermediate rows, then the down launch and the combine."""
    num_tiles = grouped.tile_expert.shape[0]
    out_spec, out_shape = _intermediate(num_tiles, plan)
    specs = [whole(), x_spec] + [whole()] * len(projections)
    kernel = functools.partial(_up_kernel, plan=plan)
    grid = (num_tiles, plan.inner // plan.block_inner)
    up_call = _up_call(kernel, grid, specs, out_spec, out_shape, plan)
    hidden = up_call(grouped.tile_expert, staged, *projections)
    return _down_and_combine(hidden, grouped, downs, plan)


def _folded(grouped, staged, x_spec, projections, downs, plan: ExpertsPlan):
    """One launch (``down_in_up``): each program's partial sums of its tokens' outputs,
    weighted by its tile's row weights, then their sum."""
    grid = (grouped.tile_expert.shape[0], plan.inner // plan.block_inner)
    specs = [whole(), x_spec] + [whole()] * (len(projections) + len(downs))
    specs.append(pl.BlockSpec((plan.block_rows,), lambda t, i: (t,)))
    out_spec, out_shape = _partials(grid, plan)
    kernel = functools.partial(_up_kernel, plan=plan)
    up_call = _up_call(kernel, grid, specs, out_spec, out_shape, plan)
    partials = up_call(grouped.tile_expert, staged, *projections, *downs, grouped.row_weight)
    return _sum_partials(partials, grouped.tile_expert, plan)


def _routed_in_up(x, routing, shared, projections, downs, plan: ExpertsPlan):
    """The up launch routing the few tokens itself (``_routed_up_kernel``), which writes the
    routing tables too; then the partials' sum (``down_in_up``) or the down launch."""
    shared_weight = None if shared is None else shared.weight
    args, route = route_args(routing, shared_weight, plan.block_rows, x)
    table_shapes = route_shapes(route)
    num_tiles = math.prod(table_shapes[0].shape)  # a tile per (token, slot)
    grid = (num_tiles, plan.inner // plan.block_inner)
    pairs = None
    if plan.pair_grid:  # the pairs a token (program p: tile p // pairs * slots + p % pairs)
        pairs = pairs_a_token(routing, shared is not None)
        grid = (plan.inner // plan.block_inner, table_shapes[0].shape[0] * pairs)
    weights = projections + downs if plan.down_in_up else projections
    if plan.down_in_up:  # [tile or pair, inner tile]
        out_spec, out_shape = _partials(grid if pairs is None else grid[::-1], plan)
    else:
        out_spec, out_shape = _intermediate(num_tiles, plan)
    kernel = functools.partial(
        _routed_up_kernel, num_route_args=len(args), route=route, pair_grid=pairs, plan=plan
    )
    specs = [whole()] * (len(args) + 1 + len(weights))
    outs = (out_spec, whole(), whole(), whole())
    up_call = _up_call(kernel, grid, specs, outs, (out_shape, *table_shapes), plan)
    hidden, *tables = up_call(*args, x, *weights)
    grouped = tables_as_tiles(tables, plan.num_tokens, plan.block_rows)
    if plan.down_in_up:
        return _sum_partials(hidden, grouped.tile_expert, plan, pairs, table_shapes[0].shape)
    return _down_and_combine(hidden, grouped, downs, plan)


def moe_experts_pallas(
    x: jax.Array,
    weights: jax.Array | None,
    expert_ids: jax.Array | None,
    up: jax.Array,
    down: jax.Array,
    gate: jax.Array | None = None,
    *,
    shared: SharedExpert | None = None,
    routing: TokenRouting | None = None,
    **options: Any,
) -> jax.Array:
    """Routed experts (module docstring has the contract); float32 ``[N, d_out]``.
    ``options``: the tiles and folds of ``MoELaunch`` (TypeError on another name).
    ``shared``: adds ``shared.weight[n] * shared_expert(x[n])`` to each token's sum, run as
    one more expert (id E, routed to by every token with that weight) in the same
    launches, so a step runs no kernels of its own for it. ``routing``: where the grouping
    is by token rows, ``route_tokens`` picks the experts from its logits (``weights`` and
    ``expert_ids`` unused: they may be None); elsewhere they are used as given."""
    plan = plan_experts(x, expert_ids, up, down, gate, shared, routing, MoELaunch(**options))
    projections, downs = _expert_weights(up, down, gate, shared)
    if plan.route_in_up:
        return _routed_in_up(x, routing, shared, projections, downs, plan)
    grouped = _group(x, weights, expert_ids, shared, routing, plan)
    staged, x_spec = _staged_rows(x, grouped, plan)
    if plan.down_in_up:
        return _folded(grouped, staged, x_spec, projections, downs, plan)
    return _up_then_down(grouped, staged, x_spec, projections, downs, plan)
