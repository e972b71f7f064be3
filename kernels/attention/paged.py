"""Attention of a padded batch over the flat KV pools, read through a token table: a Pallas
kernel whose cost follows each row's context length, and the masked jnp form it replaces.

Contract (both forms, and ``backend.Kernels.paged_attention``: ``(inputs.PagedInputs,
scale, *, gate=None)``, so each stands in for the other). q ``[B, T, Hq, D]``; pools
``[R, Hkv, D]`` (``Hq % Hkv == 0``: GQA, query head j reads kv head ``j // (Hq // Hkv)``;
the kernel's plan with ``kv_head=i`` instead has every query head read kv head i, for a
shard holding part of one group of query heads next to the whole pools); ``token_table [B,
C]`` names the pool row of each context position; ``ctx_len [B]``; ``positions [B, T]``.
Query t of row b attends to the positions ``c < ctx_len[b]`` with ``c <= positions[b, t]``,
scores ``q . k * scale`` and softmax in float32. Returns ``[B, T, Hq, D]`` in q's dtype,
with ``gate`` (pre-sigmoid: Qwen3-Next's output gate) times its sigmoid, rounded as
``layers.attention``'s output rounds it (``gated``). The gate is ``[B, T, Hg, Dg]`` with
``Hg >= Hq`` and ``Dg`` a multiple of D: query head i's gate is ``gate[b, t, i, Dg - D:]``,
so ``[B, T, Hq, D]`` is the gate itself and ``q_proj``'s output as it is (each head's query
then its gate, with or without more heads after the Hq) is read in place. A query with no
visible position (padding) gets a finite output: the jnp form's is the mean of all C values
(every score is ``MASK_VALUE``), the kernel's is zero. Table entries at ``c >= ctx_len[b]``
are never read by the kernel (the jnp form gathers them, so they must be valid rows there).

Pallas layout: the G = Hq / Hkv query heads that share a kv head are stacked with the T
tokens into ``T * G`` query rows (token-major, each with its token's position), cut into
tiles of ``block_rows`` rows; a program reads its tile out of the rows and the positions as
they are (a partial tile's missing rows as zeros: nothing is padded before the launch).
Grid ``(row b, kv head, row tile, split)``: a program runs the online softmax over the
blocks of ``block_kv`` context positions below
``min(ctx_len[b], largest position in its tile + 1)``, a loop whose trip count follows the
lengths (``cdiv(visible, block_kv)``, shared among the ``num_splits`` programs of the tile;
none reads above it). Each block gathers its K/V rows by the table's indices from the kv
head's pool view. The splits' partial results (output, running max and sum) are combined
by a second launch, grid ``(row, kv head, token, column tile)``, which writes each token's
G heads in q's layout, gated (the jnp combine where G is not a power of two, for Triton);
splits let a decode step (few query rows) spread one long context over the GPU. The split
count follows the table's width (the configured context); with ``active_splits`` the
combine merges only the splits that read a block below the token's tile's length, so its
loops follow the lengths too. Decode (T = 1), verify (T small) and chunked prefill (a chunk
attending to its cached prefix and causally within itself) are the same launch with
different T.

Backends: ``interpret=True`` anywhere (the tests, on CPU); NVIDIA GPUs through Triton
``CompilerParams``. Not for TPUs: the per-head pool view is the whole pool's rows, which
Mosaic would stage into VMEM; a TPU form would want pages contiguous in the pool (page
size > 1) and the page table scalar-prefetched into the index maps, which this pool layout
(``[R, Hkv, D]``, one row per token) does not give. The dispatch keeps the jnp form there.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lazyspec.kernels.attention.inputs import PagedInputs
from lazyspec.kernels.common import check_tile, load_rows, powers_of_two

MASK_VALUE = -1e30  # finite: a fully masked query stays NaN-free in both forms


def paged_attention_reference(
    inputs: PagedInputs, scale: float, *, gate: jax.Array | None = None
) -> jax.Array:
    """The masked jnp form (module contract): gather all C table rows, mask, softmax. Its
    cost follows C, not the lengths."""
    inputs.check()
    q, k_pool, v_pool, token_table = inputs.q, inputs.k_pool, inputs.v_pool, inputs.token_table
    ctx_len, positions = inputs.ctx_len, inputs.positions
    check_gate(q, gate)
    batch, num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    k = k_pool[token_table].astype(q.dtype)  # [B, C, Hkv, D]
    v = v_pool[token_table].astype(q.dtype)
    c = jnp.arange(token_table.shape[1])[None, None, :]
    mask = (c < ctx_len[:, None, None]) & (c <= positions[:, :, None])
    q = q.reshape(batch, num_tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = jnp.einsum("btkgd,bckd->bkgtc", q, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, None, None], scores * scale, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum(
        "bkgtc,bckd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
    )
    return gated(out.reshape(batch, num_tokens, num_heads, head_dim).astype(q.dtype), gate)


def gated(attn: jax.Array, gate: jax.Array | None) -> jax.Array:
    """``attn [..., H, D]`` times the sigmoid of ``gate``, both rounded to attn's dtype:
    the output gate of ``layers.attention`` (which calls this) and of both forms here; attn
    itself without a gate. ``gate [..., Hg, Dg]`` as the module contract has it: head i's
    gate is ``gate[..., i, Dg - D:]`` (attn's shape: the gate itself)."""
    if gate is None:
        return attn
    num_heads, head_dim = attn.shape[-2:]
    gate = gate[..., :num_heads, gate.shape[-1] - head_dim :]
    return attn * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(attn.dtype)


def check_gate(q: jax.Array, gate: jax.Array | None) -> None:
    """A gate the contract allows for q ``[B, T, Hq, D]``: ``[B, T, Hg >= Hq, a multiple
    of D]`` (module docstring)."""
    if gate is None:
        return
    batch, num_tokens, num_heads, head_dim = q.shape
    if (
        gate.ndim != 4
        or gate.shape[:2] != (batch, num_tokens)
        or gate.shape[2] < num_heads
        or gate.shape[3] % head_dim
    ):
        raise ValueError(
            f"gate {gate.shape} must be [{batch}, {num_tokens}, >= {num_heads} heads, a "
            f"multiple of {head_dim}] for q {q.shape}"
        )


# ---------------------------------------------------------------- Pallas


def _attention_kernel(*refs, scale, block_rows, block_kv, num_splits, groups):
    """refs: ctx_len, the token table, the positions, q's rows, the two pools' head views,
    then the split's output, running max and running sum."""
    ctx_len_ref, table_ref, pos_ref, q_ref, k_ref, v_ref, out_ref, max_ref, sum_ref = refs
    row = pl.program_id(0)
    ctx_len = ctx_len_ref[row]
    pos, q = _tile_queries(pos_ref, q_ref, block_rows, groups)
    num_blocks, per_split = _split_blocks(ctx_len, jnp.max(pos), block_kv, num_splits)
    first = pl.program_id(3) * per_split
    count = jnp.maximum(jnp.minimum(per_split, num_blocks - first), 0)

    def body(j, carry):
        acc, run_max, run_sum = carry
        start = (first + j) * block_kv
        cols = start + jnp.arange(block_kv, dtype=jnp.int32)
        in_ctx = cols < ctx_len
        rows = jnp.where(in_ctx, table_ref[row, pl.ds(start, block_kv)], 0)
        k = k_ref[rows].astype(q.dtype)  # [block_kv, D], gathered by the table
        v = v_ref[rows].astype(q.dtype)
        scores = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale
        mask = in_ctx[None, :] & (cols[None, :] <= pos[:, None])
        scores = jnp.where(mask, scores, MASK_VALUE)
        new_max = jnp.maximum(run_max, jnp.max(scores, axis=1))
        correction = jnp.exp(run_max - new_max)
        probs = jnp.where(mask, jnp.exp(scores - new_max[:, None]), 0.0)
        run_sum = correction * run_sum + jnp.sum(probs, axis=1)
        pv = jnp.dot(probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return correction[:, None] * acc + pv, new_max, run_sum

    block_rows, head_dim = q.shape
    init = (
        jnp.zeros((block_rows, head_dim), jnp.float32),
        jnp.full((block_rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((block_rows,), jnp.float32),
    )
    acc, run_max, run_sum = jax.lax.fori_loop(0, count, body, init)
    out_ref[...] = acc
    max_ref[...] = run_max
    sum_ref[...] = run_sum


def _check_pow2(name: str, value: int) -> None:
    if value < 16 or not powers_of_two(value):
        raise ValueError(f"{name}={value} must be a power of two >= 16")


def row_tile(num_query_rows: int, most: int) -> int:
    """Rows per tile: the power of two >= ``num_query_rows`` (T * G), at least 16 and at
    most ``most``."""
    tile = 16
    while tile < min(num_query_rows, most):
        tile *= 2
    return tile


def default_row_tile(
    num_query_rows: int, head_dim: int, itemsize: int, most_rows: int, tile_bytes: int
) -> int:
    """``row_tile`` up to ``most_rows`` rows and ``tile_bytes`` of q (``AttentionTuning``)."""
    most = max(16, tile_bytes // (head_dim * itemsize))
    return row_tile(num_query_rows, min(most_rows, most))


def default_splits(programs: int, max_blocks: int, target_programs: int) -> int:
    """Splits per query tile: enough that ``programs * splits`` reaches ``target_programs``,
    never more than the table has blocks (at least 1)."""
    return max(1, min(max_blocks, -(-target_programs // programs)))


def _query_rows(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """q as ``[B, Hkv, N, D]`` rows (N = T * G, token-major, the G heads of a kv head
    adjacent); at T = 1 a reshape only."""
    batch, num_tokens, num_heads, head_dim = q.shape
    groups = num_heads // num_kv_heads
    rows = q.reshape(batch, num_tokens, num_kv_heads, groups, head_dim).transpose(0, 2, 1, 3, 4)
    return rows.reshape(batch, num_kv_heads, num_tokens * groups, head_dim)


def _tile_positions(pos_ref, row, tile, block_rows: int, groups: int) -> jax.Array:
    """Each query row's position in tile ``tile`` of row ``row``, ``[block_rows]``, out of
    ``pos_ref [B, T]`` (query row r is token r // G's; rows past the tokens take the last
    token's position)."""
    num_tokens = pos_ref.shape[1]
    index = tile * block_rows + jnp.arange(block_rows, dtype=jnp.int32)
    return pos_ref[row, jnp.minimum(index // groups, num_tokens - 1)]


def _split_blocks(ctx_len, max_pos, block_kv: int, num_splits: int):
    """(context blocks a tile reads, blocks per split) for a tile whose largest query
    position is ``max_pos``: the blocks below ``min(ctx_len, max_pos + 1)``, shared out in
    order, so splits ``0 .. cdiv(blocks, per split) - 1`` read some and the rest none."""
    visible = jnp.maximum(jnp.minimum(ctx_len, max_pos + 1), 0)
    num_blocks = pl.cdiv(visible, block_kv)
    return num_blocks, pl.cdiv(num_blocks, num_splits)


def _tile_queries(pos_ref, q_ref, block_rows: int, groups: int):
    """The program's tile of query rows (``program_id(2)``) out of the whole rows ``q_ref
    [B, Hkv, N, D]``, and each row's position (``_tile_positions``). Rows past N read as
    zeros at the last token's position (their outputs are never read), so no padded copy
    of q or of the positions is made."""
    row, head, tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_rows = q_ref.shape[2]
    pos = _tile_positions(pos_ref, row, tile, block_rows, groups)  # [block_rows]
    rows = q_ref.at[row, head, pl.ds(tile * block_rows, block_rows)]
    return pos, load_rows(rows, tile * block_rows, num_rows)  # [block_rows, D]


def _combine(out: jax.Array, run_max: jax.Array, run_sum: jax.Array) -> jax.Array:
    """Merge the splits' partial softmaxes (leading axis); rows that saw nothing give 0."""
    best = jnp.max(run_max, axis=0)
    weight = jnp.exp(run_max - best)
    total = jnp.sum(weight * run_sum, axis=0)
    merged = jnp.sum(weight[..., None] * out, axis=0)
    return merged / jnp.where(total > 0, total, 1.0)[..., None]


def _combine_kernel(*refs, groups, num_splits, gated, lengths):
    """One (row, kv head, token, column tile) program: the token's G query rows merged over
    the splits (two passes over the splits' maxima and sums, one over their outputs' column
    tile), rounded to the output's dtype and, with a gate, times its sigmoid as
    ``layers.attention``'s output rounds them. With ``lengths`` (``(block_rows, block_kv)``
    of the attention launch; the refs then start with ctx_len and the positions) only the
    splits that read a block of the token's tile are merged (``_split_blocks``): the others
    hold nothing (a sum of 0 and the maximum at ``MASK_VALUE``, which weigh exactly 0), so
    the merge is the same and its loops follow the lengths, not the table's width."""
    b, h, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    splits = num_splits
    if lengths is not None:
        ctx_len_ref, pos_ref, *refs = refs
        block_rows, block_kv = lengths
        pos = _tile_positions(pos_ref, b, t * groups // block_rows, block_rows, groups)
        blocks, per_split = _split_blocks(ctx_len_ref[b], jnp.max(pos), block_kv, num_splits)
        splits = jnp.where(blocks > 0, pl.cdiv(blocks, jnp.maximum(per_split, 1)), 0)
    if gated:
        out_ref, max_ref, sum_ref, gate_ref, merged_ref = refs
    else:
        out_ref, max_ref, sum_ref, merged_ref = refs
    rows = pl.ds(t * groups, groups)
    block_d = merged_ref.shape[-1]
    cols = pl.ds(pl.program_id(3) * block_d, block_d)

    def best_of(s, best):
        return jnp.maximum(best, max_ref[s, b, h, rows])

    best = jax.lax.fori_loop(0, splits, best_of, jnp.full((groups,), MASK_VALUE, jnp.float32))

    def add(s, carry):
        acc, total = carry
        weight = jnp.exp(max_ref[s, b, h, rows] - best)
        acc = acc + weight[:, None] * out_ref[s, b, h, rows, cols]
        return acc, total + weight * sum_ref[s, b, h, rows]

    init = (jnp.zeros((groups, block_d), jnp.float32), jnp.zeros((groups,), jnp.float32))
    acc, total = jax.lax.fori_loop(0, splits, add, init)
    dtype = merged_ref.dtype
    merged = (acc / jnp.where(total > 0, total, 1.0)[:, None]).astype(dtype)
    if gated:
        gate = jax.nn.sigmoid(gate_ref[...].astype(jnp.float32)).astype(dtype)
        merged = (merged.astype(jnp.float32) * gate.astype(jnp.float32)).astype(dtype)
    merged_ref[...] = merged


def _combine_pallas(
    out,
    run_max,
    run_sum,
    gate,
    *,
    num_tokens,
    num_heads,
    dtype,
    lengths=None,
    block_d=None,
    **options,
):
    """The splits' partial results ``[S, B, Hkv, N, ...]`` merged into ``[B, T, Hq, D]`` in
    ``dtype`` (times ``sigmoid(gate)`` where a gate is given, read in place: each head's
    last D channels, ``check_gate``), one Pallas
    launch: grid ``(row, kv head, token, column tile)``, ``block_d`` columns a program
    (None: the head's D); the partials are whole-array refs, so any number of splits is
    looped over. ``lengths``: ``(ctx_len, positions, block_rows, block_kv)`` of the
    attention launch, to merge only the splits that read a block (``_combine_kernel``);
    None merges every split."""
    num_splits, batch, num_kv_heads, _, head_dim = out.shape
    groups = num_heads // num_kv_heads
    block_d = check_tile("block_d", head_dim, block_d)
    block = pl.BlockSpec((None, None, groups, block_d), lambda b, h, t, c: (b, t, h, c))
    gate_specs = []
    if gate is not None:  # the block of D channels that ends each head
        last = (gate.shape[-1] // head_dim - 1) * (head_dim // block_d)
        spec = pl.BlockSpec((None, None, groups, block_d), lambda b, h, t, c: (b, t, h, last + c))
        gate_specs = [spec]
    in_specs = [pl.BlockSpec()] * 3 + gate_specs
    args = (out, run_max, run_sum) + ((gate,) if gate is not None else ())
    tiles = None
    if lengths is not None:
        ctx_len, positions, *tiles = lengths
        in_specs = [pl.BlockSpec()] * 2 + in_specs
        args = (ctx_len.astype(jnp.int32), positions.astype(jnp.int32)) + args
    kernel = functools.partial(
        _combine_kernel,
        groups=groups,
        num_splits=num_splits,
        gated=gate is not None,
        lengths=None if tiles is None else tuple(tiles),
    )
    return pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, num_tokens, head_dim // block_d),
        in_specs=in_specs,
        out_specs=block,
        out_shape=jax.ShapeDtypeStruct((batch, num_tokens, num_heads, head_dim), dtype),
        name="paged_attention_combine",
        **options,
    )(*args)


@dataclasses.dataclass(frozen=True)
class PagedPlan:
    """How ``paged_attention`` lays out its launches (``AttentionTuning`` holds the tuned
    values). ``block_rows``: query rows a tile (None: ``default_row_tile``, up to
    ``max_block_rows`` rows and ``query_tile_bytes`` of q); ``block_kv``: context positions
    a loop step; ``num_splits``: splits of a tile's context (None: ``default_splits``
    towards ``target_programs``). ``active_splits``: the combine launch merges only the
    splits that read a block of each token's tile (the same output; its loops then follow
    the lengths, where the split count follows the table's width). ``combine_block``: the
    combine launch's columns a program (None: a head's D; fewer spread a few rows' merge
    over more programs). ``kv_head=j``: every query head of q reads pool head j (q holds
    some of the query heads of one kv head: a tensor-parallel shard whose pools hold every
    kv head); the pools are read in place, no head is sliced out of them."""

    block_rows: int | None = None
    block_kv: int = 64
    num_splits: int | None = None
    max_block_rows: int = 64
    target_programs: int = 256
    query_tile_bytes: int = 32 * 1024
    active_splits: bool = False
    combine_block: int | None = None
    kv_head: int | None = None


DEFAULT_PAGED_PLAN = PagedPlan()


def paged_attention(
    inputs: PagedInputs,
    scale: float,
    *,
    gate: jax.Array | None = None,
    plan: PagedPlan = DEFAULT_PAGED_PLAN,
    interpret: bool = False,
    compiler_params: Any = None,
) -> jax.Array:
    """The Pallas form (module docstring has the contract and layout), laid out as ``plan``
    says; pure."""
    kv_head = plan.kv_head
    inputs.check(kv_head)
    q, k_pool, ctx_len, positions = inputs.q, inputs.k_pool, inputs.ctx_len, inputs.positions
    check_gate(q, gate)
    batch, num_tokens, num_heads, head_dim = q.shape
    num_rows_total = k_pool.shape[0]
    num_kv_heads = k_pool.shape[1] if kv_head is None else 1  # kv heads q's heads read
    head_base = 0 if kv_head is None else kv_head
    block_rows, block_kv = plan.block_rows, plan.block_kv
    if block_rows is None:
        num_query_rows = num_tokens * num_heads // num_kv_heads
        block_rows = default_row_tile(
            num_query_rows, head_dim, q.dtype.itemsize, plan.max_block_rows, plan.query_tile_bytes
        )
    _check_pow2("block_rows", block_rows)
    _check_pow2("block_kv", block_kv)
    rows = _query_rows(q, num_kv_heads)
    num_tiles = -(-rows.shape[2] // block_rows)
    groups = num_heads // num_kv_heads
    table = inputs.token_table.astype(jnp.int32)
    table = jnp.pad(table, ((0, 0), (0, -table.shape[1] % block_kv)))  # whole blocks
    num_splits = plan.num_splits
    if num_splits is None:
        max_blocks = table.shape[1] // block_kv
        programs = batch * num_kv_heads * num_tiles
        num_splits = default_splits(programs, max_blocks, plan.target_programs)
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be positive")
    kernel = functools.partial(
        _attention_kernel,
        scale=float(scale),
        block_rows=block_rows,
        block_kv=block_kv,
        num_splits=num_splits,
        groups=groups,
    )
    pool_spec = pl.BlockSpec(
        (num_rows_total, None, head_dim), lambda b, h, i, s: (0, head_base + h, 0)
    )
    grid = (batch, num_kv_heads, num_tiles, num_splits)
    out_specs, out_shape = _partial_outputs(grid, block_rows, head_dim)
    options = {"interpret": interpret, "compiler_params": compiler_params}
    partials = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[pl.BlockSpec()] * 4 + [pool_spec, pool_spec],
        out_specs=out_specs,
        out_shape=out_shape,
        name="paged_attention",
        **options,
    )(ctx_len.astype(jnp.int32), table, positions.astype(jnp.int32), rows, k_pool, inputs.v_pool)
    lengths = (ctx_len, positions, block_rows, block_kv) if plan.active_splits else None
    return _merge_splits(partials, q, gate, plan.combine_block, lengths, options)


def _partial_outputs(grid: tuple[int, ...], block_rows: int, head_dim: int):
    """(specs, shapes) of the split launch's float32 partials over ``grid`` (row, kv head,
    row tile, split): each split's output rows ``[splits, B, kv heads, rows, D]``, then
    their running max and sum ``[splits, B, kv heads, rows]``."""
    batch, num_kv_heads, num_tiles, num_splits = grid
    partial_shape = (num_splits, batch, num_kv_heads, num_tiles * block_rows)
    specs = (
        pl.BlockSpec((None, None, None, block_rows, head_dim), lambda b, h, i, s: (s, b, h, i, 0)),
        pl.BlockSpec((None, None, None, block_rows), lambda b, h, i, s: (s, b, h, i)),
        pl.BlockSpec((None, None, None, block_rows), lambda b, h, i, s: (s, b, h, i)),
    )
    shapes = (
        jax.ShapeDtypeStruct(partial_shape + (head_dim,), jnp.float32),
        jax.ShapeDtypeStruct(partial_shape, jnp.float32),
        jax.ShapeDtypeStruct(partial_shape, jnp.float32),
    )
    return specs, shapes


def _merge_splits(partials, q, gate, combine_block, lengths, options) -> jax.Array:
    """The splits' partials merged into ``[B, T, H, D]`` in q's dtype, gated: the combine
    launch (``_combine_pallas``; ``lengths`` given, over the active splits only) where its
    blocks fit Triton or in interpret mode, else in jnp."""
    out, run_max, run_sum = partials
    batch, num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = out.shape[2]
    groups = num_heads // num_kv_heads
    if options["interpret"] or powers_of_two(groups, head_dim):
        shape = {"num_tokens": num_tokens, "num_heads": num_heads, "dtype": q.dtype}
        shape["block_d"] = combine_block
        if lengths is not None:
            shape["lengths"] = lengths
        return _combine_pallas(out, run_max, run_sum, gate, **shape, **options)
    merged = _combine(out, run_max, run_sum)[:, :, : num_tokens * groups]
    merged = merged.reshape(batch, num_kv_heads, num_tokens, -1, head_dim).transpose(0, 2, 1, 3, 4)
    return gated(merged.reshape(batch, num_tokens, num_heads, head_dim).astype(q.dtype), gate)
