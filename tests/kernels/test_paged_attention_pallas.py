"""Paged attention: the Pallas kernel (interpret mode) against the masked jnp form."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.kernels import backend, common
from lazyspec.kernels.attention import paged as pa
from lazyspec.kernels.attention.inputs import PagedInputs
from lazyspec.kernels.tuning import Tuning
from tests.kernels.kernel_checks import INTERPRET, as_one_program, assert_close, tolerance

pytestmark = pytest.mark.pallas

FP32_TOL = tolerance(jnp.float32, reduction_length=256)  # head dims and contexts <= 256
# bf16: the kernel rounds the unnormalised probabilities to bf16 before the value product,
# the jnp form the normalised ones; each is a few bf16 roundings from the exact result.
BF16_TOL = tolerance(jnp.bfloat16, reduction_length=256, roundings=4)


def attention_case(rng, batch, num_tokens, num_heads, num_kv_heads, head_dim, ctx_len, dtype):
    """q, pools and a table of distinct shuffled rows (row 0 is never named), every row's
    queries at the last ``num_tokens`` positions of its context (position -1 where the row
    is shorter: padding). Entries of the table at ``c >= ctx_len`` name the poison row,
    whose K/V are NaN; ``clean_table`` names row 1 there instead."""
    width = max(ctx_len) + 5
    num_rows = batch * width + 3
    pools = [rng.standard_normal((num_rows, num_kv_heads, head_dim)) for _ in "kv"]
    poison = num_rows - 1
    for pool in pools:
        pool[poison] = np.nan
    table = rng.permutation(np.arange(1, num_rows - 1))[: batch * width].reshape(batch, width)
    ctx = np.asarray(ctx_len, np.int32)
    beyond = np.arange(width)[None, :] >= ctx[:, None]
    positions = ctx[:, None] - num_tokens + np.arange(num_tokens)[None, :]
    return {
        "q": jnp.asarray(rng.standard_normal((batch, num_tokens, num_heads, head_dim)), dtype),
        "k_pool": jnp.asarray(pools[0], dtype),
        "v_pool": jnp.asarray(pools[1], dtype),
        "token_table": jnp.asarray(np.where(beyond, poison, table), jnp.int32),
        "clean_table": jnp.asarray(np.where(beyond, 1, table), jnp.int32),
        "ctx_len": jnp.asarray(ctx),
        "positions": jnp.asarray(np.maximum(positions, -1), jnp.int32),
    }


def paged_inputs(case, table: str = "token_table", q=None) -> PagedInputs:
    """The case's operands as the attention forms take them: ``table`` names which of its
    tables, ``q`` (None: the case's) the queries."""
    q = case["q"] if q is None else q
    pools = (case["k_pool"], case["v_pool"])
    return PagedInputs(q, *pools, case[table], case["ctx_len"], case["positions"])


# The kernel and the jnp form as the engine's steps run them, each call one program
# (``as_one_program``); the tests that read a call's jaxpr, and those that compare a gated
# output bit for bit with an op-by-op gating, call the forms themselves.
paged_attention = as_one_program(pa.paged_attention)
paged_attention_reference = as_one_program(pa.paged_attention_reference)


def run_both(case, **tiles):
    """(kernel on the poisoned table, jnp form on the clean one, mask of real queries)."""
    scale = case["q"].shape[-1] ** -0.5
    plan = pa.PagedPlan(**tiles)
    got = paged_attention(paged_inputs(case), scale, plan=plan, interpret=INTERPRET)
    want = paged_attention_reference(paged_inputs(case, "clean_table"), scale)
    real = np.asarray(case["positions"] >= 0)
    return got, want, real


def check_case(case, tol, **tiles):
    got, want, real = run_both(case, **tiles)
    assert got.shape == case["q"].shape and got.dtype == case["q"].dtype
    assert real.any() and not real.all()  # real and padding queries both checked
    assert np.isfinite(np.asarray(got, np.float32)).all(), "padding or poison leaked"
    assert_close(np.asarray(got, np.float32)[real], np.asarray(want, np.float32)[real], tol, "out")


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, FP32_TOL), (jnp.bfloat16, BF16_TOL)])
@pytest.mark.parametrize("groups,head_dim", [(1, 256), (2, 64), (8, 128)])
def test_decode_pallas(groups, head_dim, dtype, tol):
    """T = 1 over ragged contexts (one empty) split two ways; GQA 1/2/8, head dims 64-256."""
    rng = np.random.default_rng(groups * head_dim)
    case = attention_case(rng, 4, 1, 2 * groups, 2, head_dim, [70, 0, 1, 33], dtype)
    check_case(case, tol, block_kv=16, num_splits=2)


def test_verify_pallas():
    """T = 4 draft positions per row, one row shorter than T (its first queries pad)."""
    rng = np.random.default_rng(1)
    case = attention_case(rng, 3, 4, 8, 2, 64, [40, 2, 17], jnp.float32)
    check_case(case, FP32_TOL, block_kv=16, num_splits=3)


def test_prefill_chunk_with_prefix_pallas():
    """A 20-token chunk after a cached prefix attends to the prefix and causally within
    itself (the second row's chunk is its first 12 tokens, padded); the query rows (20 x 4
    heads) span several row tiles, the last one partial."""
    rng = np.random.default_rng(2)
    case = attention_case(rng, 2, 20, 8, 2, 64, [45, 12], jnp.float32)
    check_case(case, FP32_TOL, block_rows=16, block_kv=16, num_splits=1)
    check_case(case, FP32_TOL, block_kv=16)  # default row tile: 64 of the 80 rows


def test_query_rows_are_read_unpadded_pallas():
    """A decode step's 8 query rows a kv head (16 q / 2 kv heads) sit in a 16-row tile: the
    attention launch reads q (reshaped only) and the positions as they are, with nothing
    padded before it, and matches the jnp form."""
    rng = np.random.default_rng(5)
    case = attention_case(rng, 3, 1, 16, 2, 64, [30, 0, 9], jnp.float32)  # one row empty
    args = [case[a] for a in ("k_pool", "v_pool", "token_table", "ctx_len", "positions")]
    jaxpr = jax.make_jaxpr(
        lambda *a: pa.paged_attention(
            PagedInputs(*a), 0.125, plan=pa.PagedPlan(num_splits=2), interpret=INTERPRET
        )
    )(case["q"], *args).jaxpr
    launch = next(e for e in jaxpr.eqns if e.primitive.name == "pallas_call")
    assert launch.invars[2] is jaxpr.invars[5]  # the positions themselves
    assert launch.invars[3].aval.shape == (3, 2, 8, 64)  # q's rows, 8 of a 16-row tile
    made_by = {out: e for e in jaxpr.eqns for out in e.outvars}
    rows = launch.invars[3]
    while rows in made_by:  # back to q through reshapes and transposes only
        assert made_by[rows].primitive.name in ("reshape", "transpose"), made_by[rows]
        rows = made_by[rows].invars[0]
    assert rows is jaxpr.invars[0]
    check_case(case, FP32_TOL, num_splits=2)


def test_default_row_tile_keeps_q_within_its_bytes_pallas():
    """A 64-token chunk of 8 heads per kv head (512 rows) takes 64-row tiles in bf16 and
    32-row tiles in fp32 at head dim 256 (shared memory), 64 in fp32 at head dim 128; decode
    keeps 16."""
    tiles = Tuning().attention
    most = (tiles.block_rows, tiles.query_tile_bytes)
    assert pa.default_row_tile(512, 256, 2, *most) == 64
    assert pa.default_row_tile(512, 256, 4, *most) == 32
    assert pa.default_row_tile(512, 128, 4, *most) == 64
    assert pa.default_row_tile(8, 256, 4, *most) == 16


def test_row_tile_grows_with_the_query_rows_pallas():
    assert [pa.row_tile(n, 64) for n in (1, 8, 16, 17, 32, 80, 512)] == [
        16,
        16,
        16,
        32,
        32,
        64,
        64,
    ]


def test_splits_more_than_blocks_pallas():
    """Splits beyond the blocks a row has (empty splits) and the default split choice."""
    rng = np.random.default_rng(3)
    case = attention_case(rng, 3, 1, 4, 4, 64, [5, 30, 0], jnp.float32)
    check_case(case, FP32_TOL, block_kv=16, num_splits=4)
    check_case(case, FP32_TOL)


def test_empty_rows_give_zero_not_nan_pallas():
    """Rows with no context and padding queries give finite output (zero), like the jnp form
    gives finite output through MASK_VALUE."""
    rng = np.random.default_rng(4)
    case = attention_case(rng, 2, 2, 4, 2, 64, [0, 1], jnp.bfloat16)
    got, want, real = run_both(case, block_kv=16)
    got = np.asarray(got, np.float32)
    assert np.isfinite(np.asarray(want, np.float32)).all()
    assert np.isfinite(got).all() and not got[~real].any()
    assert real.sum() == 1 and np.abs(got[real]).max() > 0


def test_kv_head_reads_one_pool_head_for_part_of_its_group_pallas():
    """``kv_head=j``: a shard's query heads (one, then two of a group of four) read pool
    head j in place, as the whole call's heads of that group do."""
    rng = np.random.default_rng(7)
    case = attention_case(rng, 2, 3, 8, 2, 64, [30, 9], jnp.float32)
    scale = 64**-0.5
    want = np.asarray(paged_attention_reference(paged_inputs(case, "clean_table"), scale))
    real = np.asarray(case["positions"] >= 0)
    for kv_head, heads in ((0, slice(1, 2)), (1, slice(6, 8))):
        got = paged_attention(
            paged_inputs(case, q=case["q"][:, :, heads]),
            scale,
            plan=pa.PagedPlan(kv_head=kv_head, block_kv=16),
            interpret=INTERPRET,
        )
        assert got.shape == case["q"][:, :, heads].shape
        assert_close(np.asarray(got)[real], want[:, :, heads][real], FP32_TOL, f"kv {kv_head}")
    with pytest.raises(ValueError, match="kv_head=2"):
        pa.paged_attention(
            paged_inputs(case, q=case["q"][:, :, :1]),
            scale,
            plan=pa.PagedPlan(kv_head=2),
            interpret=INTERPRET,
        )


def test_tiles_are_validated_pallas():
    rng = np.random.default_rng(5)
    case = attention_case(rng, 1, 1, 2, 2, 64, [3], jnp.float32)
    for tiles in ({"block_kv": 24}, {"block_rows": 8}, {"num_splits": 0}):
        with pytest.raises(ValueError):
            run_both(case, **tiles)
    with pytest.raises(ValueError, match="query heads"):
        pa.paged_attention_reference(
            paged_inputs(case, q=case["q"][:, :, :1].repeat(3, axis=2)), 1.0
        )


def test_kernels_record_has_attention_where_pallas_runs_pallas():
    """The dispatch gives the kernel on GPUs and CPU (interpreted), none on XLA; a TPU's
    is the ragged Mosaic kernel (``test_attention_tpu_pallas.py``)."""
    assert backend.kernels_for("xla").paged_attention is None
    tpu = backend.kernels_for("pallas", "tpu").paged_attention
    assert tpu.func.__name__ == "tpu_paged_attention"
    assert backend.kernels_for("pallas", "gpu").paged_attention is not None
    rng = np.random.default_rng(6)
    case = attention_case(rng, 2, 1, 4, 2, 64, [9, 4], jnp.float32)
    scale = 64**-0.5
    inputs = paged_inputs(case, "clean_table")
    got = as_one_program(backend.kernels_for("pallas", "cpu").paged_attention)(inputs, scale)
    want = paged_attention_reference(inputs, scale)
    assert_close(got, want, FP32_TOL, "dispatch")


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("with_gate", [False, True])
@pytest.mark.parametrize("block_d", [None, 8])
def test_combine_launch_equals_the_jnp_combine_pallas(num_splits, with_gate, block_d):
    """The splits' merge in its launch equals the jnp merge, laid out and gated as the
    attention layer does it, bit for bit: with a split that saw nothing (its maximum at
    ``MASK_VALUE``) and query rows no split saw (zero); a program a head's columns or a
    tile of them (``block_d``)."""
    rng = np.random.default_rng(num_splits)
    batch, num_kv_heads, groups, num_tokens, head_dim, rows = 2, 2, 4, 3, 32, 16
    part = (num_splits, batch, num_kv_heads, rows)
    out = jnp.asarray(rng.standard_normal(part + (head_dim,)), jnp.float32)
    run_max = jnp.asarray(rng.standard_normal(part) * 3, jnp.float32)
    run_max = run_max.at[0, 1, 0].set(pa.MASK_VALUE)
    run_sum = jnp.asarray(rng.uniform(0.5, 4.0, part), jnp.float32)
    # token 0 of row 0, kv head 1: no split saw a position (no sum, no output)
    run_sum = run_sum.at[:, 0, 1, :groups].set(0.0)
    out = out.at[:, 0, 1, :groups].set(0.0)
    heads = num_kv_heads * groups
    gate = None
    if with_gate:
        gate = jnp.asarray(rng.standard_normal((batch, num_tokens, heads, head_dim)) * 2)
        gate = gate.astype(jnp.bfloat16)
    got = pa._combine_pallas(
        out,
        run_max,
        run_sum,
        gate,
        num_tokens=num_tokens,
        num_heads=heads,
        dtype=jnp.bfloat16,
        block_d=block_d,
        interpret=INTERPRET,
    )
    merged = pa._combine(out, run_max, run_sum)[:, :, : num_tokens * groups]
    merged = merged.reshape(batch, num_kv_heads, num_tokens, groups, head_dim)
    merged = merged.transpose(0, 2, 1, 3, 4).reshape(got.shape).astype(jnp.bfloat16)
    want = pa.gated(merged, gate)
    assert got.dtype == jnp.bfloat16 and got.shape == (batch, num_tokens, heads, head_dim)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert not np.asarray(got, np.float32)[0, 0, groups : 2 * groups].any()


# batch, tokens, query heads, kv heads, head dim, contexts, tiles
ACTIVE_SPLIT_CASES = [
    (4, 1, 16, 2, 64, [70, 0, 1, 33], {"block_kv": 16, "num_splits": 8}),  # decode
    (3, 4, 8, 2, 64, [40, 2, 17], {"block_kv": 16, "num_splits": 5}),  # verify
    (2, 20, 8, 2, 64, [45, 12], {"block_rows": 16, "block_kv": 16, "num_splits": 4}),
    (2, 1, 64, 1, 32, [50, 9], {"block_rows": 16, "block_kv": 16, "num_splits": 6}),  # G > tile
]


@pytest.mark.parametrize("case_args", ACTIVE_SPLIT_CASES)
@pytest.mark.parametrize("with_gate", [False, True])
def test_merging_only_the_active_splits_gives_the_same_output_pallas(case_args, with_gate):
    """``active_splits``: the combine merges only the splits that read a block of each
    token's tile; the output equals the every-split merge bit for bit (decode with an empty
    row and more splits than blocks, verify, a prefill chunk over several tiles, and 64
    query heads a kv head, whose token spans several 16-row tiles), and the jnp form."""
    batch, num_tokens, heads, kv_heads, head_dim, contexts, tiles = case_args
    rng = np.random.default_rng(len(contexts) + num_tokens)
    case = attention_case(rng, batch, num_tokens, heads, kv_heads, head_dim, contexts, jnp.float32)
    gate = None
    if with_gate:
        gate = jnp.asarray(rng.standard_normal(case["q"].shape), jnp.float32)

    def attend(active):
        return paged_attention(
            paged_inputs(case),
            0.1,
            gate=gate,
            plan=pa.PagedPlan(active_splits=active, **tiles),
            interpret=INTERPRET,
        )

    got, every = np.asarray(attend(True)), np.asarray(attend(False))
    np.testing.assert_array_equal(got, every)
    want = paged_attention_reference(paged_inputs(case, "clean_table"), 0.1, gate=gate)
    real = np.asarray(case["positions"] >= 0)
    assert_close(got[real], np.asarray(want)[real], FP32_TOL, "active splits")


def test_the_combine_reads_only_the_active_splits_pallas():
    """With ``lengths`` the combine loops over the splits that read a block of the token's
    tile and no further: splits past them filled with NaN leave its output finite and equal
    to the merge of the splits before them (to float32's accumulation tolerance: the merge
    may sum in another order); the every-split merge reads them (NaN)."""
    rng = np.random.default_rng(11)
    batch, kv_heads, groups, num_tokens, head_dim, rows = 2, 2, 4, 1, 32, 16
    num_splits, block_kv = 6, 16
    ctx_len = jnp.asarray([40, 16], jnp.int32)  # 3 and 1 blocks: 3 and 1 splits read one
    positions = ctx_len[:, None] - 1
    active = [3, 1]
    part = (num_splits, batch, kv_heads, rows)
    out = rng.standard_normal(part + (head_dim,))
    run_max = rng.standard_normal(part)
    run_sum = rng.uniform(0.5, 4.0, part)
    for b, n in enumerate(active):
        out[n:, b], run_max[n:, b], run_sum[n:, b] = np.nan, np.nan, np.nan
    parts = [jnp.asarray(a, jnp.float32) for a in (out, run_max, run_sum)]
    shape = {"num_tokens": num_tokens, "num_heads": kv_heads * groups, "dtype": jnp.float32}
    lengths = (ctx_len, positions, rows, block_kv)
    got = pa._combine_pallas(*parts, None, **shape, lengths=lengths, interpret=INTERPRET)
    got = np.asarray(got)
    assert np.isfinite(got).all()
    for b, n in enumerate(active):
        merged = pa._combine(*(p[:n, b : b + 1] for p in parts))[:, :, :groups]
        want = np.asarray(merged).reshape(1, 1, kv_heads * groups, head_dim)  # h * G + g
        tol = tolerance(jnp.float32, reduction_length=n)  # the same n splits, own order
        assert_close(got[b : b + 1], want, tol, f"row {b}: the merge of its {n} splits")
    every = pa._combine_pallas(*parts, None, **shape, interpret=INTERPRET)
    assert np.isnan(np.asarray(every)).any()


def test_the_dispatch_merges_as_attention_active_splits_says_pallas():
    """The record's paged attention hands the tuning's ``active_splits`` on: with it on, the
    combine launch takes the lengths (two inputs more)."""
    rng = np.random.default_rng(12)
    case = attention_case(rng, 2, 1, 8, 2, 64, [30, 5], jnp.float32)

    def attend_with(**overrides):
        tuning = Tuning().with_overrides(overrides)
        return backend.kernels_for("pallas", "cpu", tuning=tuning).paged_attention

    inputs = {}
    for switch in (False, True):
        attend = attend_with(**{"attention.active_splits": switch})
        jaxpr = jax.make_jaxpr(lambda x: attend(x, 0.125))(paged_inputs(case)).jaxpr
        launches = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
        inputs[switch] = len(launches[-1].invars)
    assert inputs[True] == inputs[False] + 2, inputs
    # and ``combine_block``: the combine's programs a head up to ``small_step_max_tokens``
    # tokens (0: one)
    three = attention_case(rng, 3, 1, 8, 2, 64, [30, 5, 9], jnp.float32)
    grids = {}
    for block, each in ((0, case), (16, case), (16, three)):
        attend = attend_with(**{"attention.combine_block": block})
        jaxpr = jax.make_jaxpr(lambda x: attend(x, 0.125))(paged_inputs(each)).jaxpr
        launches = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
        grids[block, each["q"].shape[0]] = launches[-1].params["grid_mapping"].grid
    assert Tuning().small_step_max_tokens == 2
    assert grids == {(0, 2): (2, 2, 1, 1), (16, 2): (2, 2, 1, 4), (16, 3): (3, 2, 1, 1)}, grids


def test_gated_output_equals_the_gated_reference_pallas():
    """With a gate, the kernel's output and the jnp form's are the ungated ones times the
    gate's sigmoid (rounded as the attention layer rounds them)."""
    rng = np.random.default_rng(8)
    case = attention_case(rng, 2, 2, 8, 2, 64, [40, 7], jnp.bfloat16)
    gate = jnp.asarray(rng.standard_normal(case["q"].shape) * 2, jnp.bfloat16)
    scale = 64**-0.5
    inputs = paged_inputs(case, "clean_table")
    real = np.asarray(case["positions"] >= 0)
    for attend in (
        lambda gate: pa.paged_attention(inputs, scale, gate=gate, interpret=INTERPRET),
        lambda gate: pa.paged_attention_reference(inputs, scale, gate=gate),
    ):
        got, plain = np.asarray(attend(gate), np.float32), attend(None)
        want = np.asarray(pa.gated(plain, gate), np.float32)
        np.testing.assert_array_equal(got[real], want[real])
        assert not np.allclose(got[real], np.asarray(plain, np.float32)[real])


@pytest.mark.parametrize("active", [False, True])
@pytest.mark.parametrize("combine_block", [None, 16])
def test_gate_is_read_in_place_out_of_a_wider_array_pallas(active, combine_block):
    """A gate handed as ``q_proj``'s output is (each head's query then its gate, and more
    heads after the query heads: the one product's k and v) gives the output of the gate
    alone bit for bit, in the kernel and the jnp form: each head's last D channels are
    read, no other (the combine a head's columns a program, or 16)."""
    rng = np.random.default_rng(9)
    case = attention_case(rng, 2, 2, 8, 2, 64, [40, 7], jnp.bfloat16)
    gate = jnp.asarray(rng.standard_normal(case["q"].shape) * 2, jnp.bfloat16)
    wide = jnp.asarray(rng.standard_normal((2, 2, 10, 128)) * 2, jnp.bfloat16)
    wide = wide.at[:, :, :8, 64:].set(gate)
    scale = 64**-0.5
    inputs = paged_inputs(case, "clean_table")
    real = np.asarray(case["positions"] >= 0)
    for attend in (
        lambda g: pa.paged_attention(
            inputs,
            scale,
            gate=g,
            plan=pa.PagedPlan(active_splits=active, combine_block=combine_block),
            interpret=INTERPRET,
        ),
        lambda g: pa.paged_attention_reference(inputs, scale, gate=g),
    ):
        got, want = (np.asarray(attend(g), np.float32) for g in (wide, gate))
        np.testing.assert_array_equal(got[real], want[real])
    for bad in (wide[..., :96], wide[:, :, :7], wide[:1]):  # D does not divide; too few
        with pytest.raises(ValueError, match="gate"):
            pa.paged_attention(inputs, scale, gate=bad, interpret=INTERPRET)


def test_paged_attention_lowers_to_triton_at_model_shapes_pallas():
    """Qwen3-Next's decode shapes (16 q / 2 kv heads, head dim 256, bf16) and a 64-token
    prefill chunk lower through Pallas-Triton with the default tiles, with the gate too
    (alone, or read in place out of q, k and v's one product): the attention launch and
    the combine's (merging every split or the active ones);
    Triton IR is built here, not compiled."""
    spec = jax.ShapeDtypeStruct
    tiles = Tuning().attention
    params = common.pallas_compiler_params("gpu", tiles.num_warps, tiles.num_stages)
    for num_tokens in (1, 64):
        args = (
            spec((4, num_tokens, 16, 256), jnp.bfloat16),
            spec((1000, 2, 256), jnp.bfloat16),
            spec((1000, 2, 256), jnp.bfloat16),
            spec((4, 300), jnp.int32),
            spec((4,), jnp.int32),
            spec((4, num_tokens), jnp.int32),
        )
        for gate, active in (
            (spec((4, num_tokens, 16, 256), jnp.bfloat16), False),
            (spec((4, num_tokens, 16, 256), jnp.bfloat16), True),
            (spec((4, num_tokens, 18, 512), jnp.bfloat16), True),  # q, k, v's one product
        ):
            for block in (None, 32):  # the combine a head's columns a program, or 32
                attend = jax.jit(
                    lambda *a, active=active, block=block: pa.paged_attention(
                        PagedInputs(*a[:6]),
                        0.0625,
                        gate=a[6],
                        plan=pa.PagedPlan(active_splits=active, combine_block=block),
                        compiler_params=params,
                    )
                )
                text = attend.trace(*args, gate).lower(lowering_platforms=("cuda",)).as_text()
                assert text.count("__gpu$xla.gpu.triton") == 2


def test_merge_stays_in_jnp_where_the_heads_of_a_kv_head_are_not_a_power_of_two_pallas():
    """Five query heads a kv head (Triton blocks are powers of two): the CUDA lowering has
    the attention launch only, the merge in XLA."""
    spec = jax.ShapeDtypeStruct
    params = common.pallas_compiler_params("gpu", 8, 2)
    args = (
        spec((4, 1, 10, 128), jnp.bfloat16),
        *(spec((1000, 2, 128), jnp.bfloat16),) * 2,
        spec((4, 300), jnp.int32),
        spec((4,), jnp.int32),
        spec((4, 1), jnp.int32),
    )
    attend = jax.jit(lambda *a: pa.paged_attention(PagedInputs(*a), 0.1, compiler_params=params))
    text = attend.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
