"""The TPU ragged paged attention (``attention.ragged_tpu``) in TPU interpret mode against
the masked jnp form (``paged_attention_reference``, the GPU kernel's reference too): decode,
verify and prefill chunks over ragged batches, page sizes 1-16, GQA 1-8, lengths from empty
to several blocks; its dispatch on a TPU record (gate, the jnp walk past the SMEM bound);
and its lowering to Mosaic at Qwen3-Next's shapes.

Inputs are fresh random draws; the pools' rows past each row's context (the rest of its last
page, and the pages its table names past it) are NaN, so a read the kernel should not make
shows; its output buffer starts NaN (the interpreter's fresh memory), so does a row it fails
to write."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.kernels import backend
from lazyspec.kernels.attention import paged as pa
from lazyspec.kernels.attention import ragged_tpu as rt
from lazyspec.kernels.attention.inputs import PagedInputs
from lazyspec.kernels.tuning import tuning_for
from tests.kernels.kernel_checks import (
    TPU_INTERPRET,
    TpuInterpret,
    assert_close,
    launch_names,
    tolerance,
)

pytestmark = pytest.mark.pallas

ARGS = ("k_pool", "v_pool", "token_table", "ctx_len", "positions")


def attention_tolerance(dtype, lengths, head_dim: int) -> float:
    """``kernel_checks.tolerance`` over the longer of the context and the head dim (the
    float32 sums of the scores and of the softmax), with the GPU form's four roundings in
    bf16 (probabilities rounded before the value product, normalised on one side and not on
    the other; the output)."""
    roundings = 1 if dtype == jnp.float32 else 4
    return tolerance(dtype, max(max(lengths), head_dim), roundings)


def paged_case(rng, lengths, num_tokens, heads, head_dim, page_size, dtype):
    """q, pools of pages (page 0 the null page, zeros) and each row's table of whole shuffled
    pages; a row's queries at its last ``num_tokens`` positions (-1 where it is shorter:
    padding). Past each row's context the pools are NaN and the table names a row past the
    pool; ``clean_*`` hold zeros and the null page there, for the reference."""
    num_q_heads, num_kv_heads = heads
    pages_per_row = max(-(-max(lengths) // page_size), 1) + 1
    num_pages = len(lengths) * pages_per_row
    num_rows = (num_pages + 1) * page_size
    pools = rng.standard_normal((2, num_rows, num_kv_heads, head_dim)).astype(np.float32)
    pools[:, :page_size] = 0.0
    pages = rng.permutation(np.arange(1, num_pages + 1)).reshape(len(lengths), pages_per_row)
    table = (pages[:, :, None] * page_size + np.arange(page_size)).reshape(len(lengths), -1)
    clean = table.copy()
    for row, length in enumerate(lengths):
        pools[:, table[row, length:]] = np.nan  # the last page's rest and the pages past it
        clean[row, length:] = 0
        table[row, -(-length // page_size) * page_size :] = num_rows + 7  # never read
    ctx = np.asarray(lengths, np.int32)
    positions = ctx[:, None] - num_tokens + np.arange(num_tokens)[None, :]
    q = rng.standard_normal((len(lengths), num_tokens, num_q_heads, head_dim))
    return {
        "q": jnp.asarray(q, dtype),
        "k_pool": jnp.asarray(pools[0], dtype),
        "v_pool": jnp.asarray(pools[1], dtype),
        "clean_pools": [jnp.asarray(np.nan_to_num(p), dtype) for p in pools],
        "token_table": jnp.asarray(table, jnp.int32),
        "clean_table": jnp.asarray(clean, jnp.int32),
        "ctx_len": jnp.asarray(ctx),
        "positions": jnp.asarray(np.maximum(positions, -1), jnp.int32),
    }


def reference(case, scale: float, kv_head: int | None = None, gate=None) -> np.ndarray:
    k_pool, v_pool = case["clean_pools"]
    if kv_head is not None:  # every query head reads that pool head
        k_pool, v_pool = k_pool[:, kv_head : kv_head + 1], v_pool[:, kv_head : kv_head + 1]
    tables = (case["clean_table"], case["ctx_len"], case["positions"])
    out = pa.paged_attention_reference(
        PagedInputs(case["q"], k_pool, v_pool, *tables), scale, gate=gate
    )
    return np.asarray(out, np.float32)


def check(case, got, want, tol) -> None:
    real = np.asarray(case["positions"] >= 0)
    assert real.any()
    got = np.asarray(got, np.float32)
    assert got.shape == case["q"].shape
    assert_close(got[real], want[real], tol, "attention")
    assert not got[~real].any()  # padding queries: zeros, not NaN


CASES = [  # lengths, T, (Hq, Hkv), head_dim, page_size, pages a block, rows a tile, dtype
    ([17, 0, 1, 40], 1, (8, 2), 128, 4, 2, 8, jnp.float32),  # decode, 5 blocks at most
    ([20, 3, 9], 3, (2, 2), 128, 8, 1, 8, jnp.float32),  # verify; a row all chunk
    ([53, 16, 10], 16, (4, 2), 128, 16, 2, 8, jnp.bfloat16),  # prefill chunks, 4 tiles
    ([7, 31], 2, (8, 1), 128, 1, 8, 16, jnp.float32),  # pages of one row, GQA 8
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[1]}-ps{c[4]}-g{c[2][0] // c[2][1]}")
def test_ragged_paged_attention_matches_the_reference(case):
    lengths, num_tokens, heads, head_dim, page_size, pages, block_rows, dtype = case
    rng = np.random.default_rng(sum(lengths) * 10 + num_tokens)
    data = paged_case(rng, lengths, num_tokens, heads, head_dim, page_size, dtype)
    scale = head_dim**-0.5
    tiles = rt.RaggedTiles(page_size, pages, block_rows)
    tpu = TpuInterpret()
    inputs = PagedInputs(data["q"], *(data[a] for a in ARGS))
    got = rt.ragged_paged_attention_tpu(inputs, scale, tiles, interpret=tpu.params)
    assert got.dtype == dtype
    group = heads[0] // heads[1]
    tiles_a_row = num_tokens // rt.tokens_per_tile(num_tokens, group, block_rows)
    assert tpu.ran(len(lengths) * tiles_a_row)
    check(data, got, reference(data, scale), attention_tolerance(dtype, lengths, head_dim))


def test_kv_head_reads_one_pool_head():
    """``kv_head=i`` (a tensor-parallel shard holding part of one group): every query head
    reads pool head i; through the TPU record as ``shard_kernels`` calls it (the scale as a
    keyword) and the kernel itself."""
    rng = np.random.default_rng(61)
    data = paged_case(rng, [12, 26], 2, (4, 2), 128, 4, jnp.float32)
    want = reference(data, 0.1, kv_head=1)
    attend = backend.kernels_for("pallas", "tpu", page_size=4).paged_attention
    inputs = PagedInputs(data["q"], *(data[a] for a in ARGS))
    got = attend(inputs, scale=0.1, kv_head=1, gate=None, interpret=TPU_INTERPRET)
    check(data, got, want, attention_tolerance(jnp.float32, [26], 128))
    tiles = rt.RaggedTiles(4, 2, 8)
    got = rt.ragged_paged_attention_tpu(inputs, 0.1, tiles, kv_head=1, interpret=TPU_INTERPRET)
    check(data, got, want, attention_tolerance(jnp.float32, [26], 128))


def test_tpu_record_runs_the_kernel_gated_or_the_walk_past_smem():
    """The Pallas record on a TPU runs the kernel with the table's TPU tiles and applies the
    gate; a table past ``tpu_table_max_bytes`` runs the jnp walk instead, same result."""
    rng = np.random.default_rng(62)
    data = paged_case(rng, [30, 5, 0], 4, (4, 2), 128, 8, jnp.float32)
    gate = jnp.asarray(rng.standard_normal(data["q"].shape), jnp.float32)
    want = reference(data, 0.2, gate=gate)
    tuning = tuning_for("tpu_v5e")
    assert tuning.attention.tpu_table_max_bytes >= data["token_table"].size * 4
    walk = tuning.with_overrides({"attention.tpu_table_max_bytes": 0})
    for form, launches in ((tuning, 1), (walk, 0)):
        attend = backend.kernels_for("pallas", "tpu", tuning=form, page_size=8).paged_attention

        def run(inputs, gate=gate, attend=attend):
            return attend(inputs, 0.2, gate=gate, interpret=TPU_INTERPRET)

        inputs = PagedInputs(data["q"], *(data[a] for a in ARGS))
        assert len(launch_names(jax.make_jaxpr(run)(inputs).eqns)) == launches
        check(data, run(inputs), want, attention_tolerance(jnp.float32, [30], 128))


def test_rejects_tables_that_are_not_whole_pages():
    rng = np.random.default_rng(63)
    data = paged_case(rng, [5, 9], 1, (2, 2), 128, 4, jnp.float32)
    table = data["token_table"][:, :-1]  # a width that is not whole pages
    pools = (data["k_pool"], data["v_pool"])
    inputs = PagedInputs(data["q"], *pools, table, data["ctx_len"], data["positions"])
    with pytest.raises(ValueError, match="whole pages of 4"):
        rt.ragged_paged_attention_tpu(inputs, 1.0, rt.RaggedTiles(4, 1, 8))
    inputs = PagedInputs(data["q"], *(data[a] for a in ARGS))
    with pytest.raises(ValueError, match="multiple of 8"):
        rt.ragged_paged_attention_tpu(inputs, 1.0, rt.RaggedTiles(4, 1, 12))


@pytest.mark.parametrize("num_tokens", [1, 4, 64])
def test_lowers_to_mosaic_at_qwen3_next_shapes(num_tokens):
    """Qwen3-Next's attention (16 q / 2 kv heads of 256, bf16) with the v5e and v6e tiles
    over pages of 16 and 64 rows lowers to one Mosaic call (block legality, scalar prefetch,
    the DMAs; the TPU compiler itself is not run here)."""
    spec = jax.ShapeDtypeStruct
    for kind, page_size in (("tpu_v5e", 16), ("tpu_v6e", 64)):
        batch, width = 8, 4096
        rows = (batch * width // page_size + 1) * page_size
        attention = tuning_for(kind).attention
        tiles = rt.RaggedTiles(
            page_size, attention.tpu_block_kv // page_size, attention.tpu_block_rows
        )
        args = (
            spec((batch, num_tokens, 16, 256), jnp.bfloat16),
            *(spec((rows, 2, 256), jnp.bfloat16),) * 2,
            spec((batch, width), jnp.int32),
            spec((batch,), jnp.int32),
            spec((batch, num_tokens), jnp.int32),
        )

        def attend(*args, tiles=tiles):
            return rt.ragged_paged_attention_tpu(PagedInputs(*args), 0.0625, tiles)

        exported = jax.export.export(jax.jit(attend), platforms=["tpu"])(*args)
        assert exported.mlir_module().count("tpu_custom_call") == 1


def test_every_tpu_kind_has_tiles():
    for kind in ("tpu_v5e", "tpu_v6e"):
        attention = tuning_for(kind).attention
        assert attention.tpu_block_kv > 0 and attention.tpu_block_rows % 8 == 0
