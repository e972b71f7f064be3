"""The jnp attention over the pools (``layers.attention.paged_attend``, the form that runs
where no paged-attention kernel does) walks the table in blocks up to the batch's longest
context: the function of the masked reference (``paged_attention_reference``), a loop whose
trip count follows the lengths, and no gather as wide as the table."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.kernels.attention.inputs import PagedInputs
from lazyspec.kernels.attention.paged import paged_attention_reference
from lazyspec.kernels.attention.tuning import TABLE
from lazyspec.kernels.backend import XLA_KERNELS
from lazyspec.kernels.tuning import Tuning
from lazyspec.models.layers import attention
from lazyspec.models.layers.attention import paged_attend
from lazyspec.testing.tiny_models import tiny_model
from tests.kernels.kernel_checks import assert_close
from tests.kernels.test_paged_attention_pallas import (
    BF16_TOL,
    FP32_TOL,
    attention_case,
    paged_inputs,
)
from tests.models.test_attention_kernel import _random_caches
from tests.models.test_pool_rows import WIDTH, _verify_inputs, first_tokens, step_eqns

ARGS = ("k_pool", "v_pool", "token_table", "ctx_len", "positions")


def _check(case, block_kv: int, tol: float) -> np.ndarray:
    """``paged_attend`` on the poisoned table (NaN K/V past each row's context) against the
    reference on the clean one, on the real queries; padding queries give zeros."""
    scale = case["q"].shape[-1] ** -0.5
    got = paged_attend(paged_inputs(case), scale, block_kv)
    want = paged_attention_reference(paged_inputs(case, "clean_table"), scale)
    real = np.asarray(case["positions"] >= 0)
    assert real.any() and not real.all()  # real and padding queries both checked
    assert got.shape == case["q"].shape and got.dtype == case["q"].dtype
    got32 = np.asarray(got, np.float32)
    assert np.isfinite(got32).all(), "padding or poison leaked"
    assert_close(got32[real], np.asarray(want, np.float32)[real], tol, "out")
    assert not got32[~real].any()  # a query that sees nothing: zeros
    return got32


@pytest.mark.parametrize("block_kv", [0, 1, 16, 64])
@pytest.mark.parametrize("groups,head_dim", [(1, 32), (2, 16), (4, 8)])
@pytest.mark.parametrize("num_tokens", [1, 4, 20])
def test_matches_the_reference_on_ragged_batches(num_tokens, groups, head_dim, block_kv):
    """Decode, verify and a prefill chunk over ragged contexts of 1 to C positions (and an
    empty row), GQA 1/2/4, blocks of one position, of some, wider than the table, and the
    whole table (0)."""
    rng = np.random.default_rng(num_tokens * 100 + groups * 10 + head_dim)
    lengths = [1, 0, 37, 50, int(rng.integers(2, 50)), num_tokens - 1]
    case = attention_case(rng, 6, num_tokens, 2 * groups, 2, head_dim, lengths, jnp.float32)
    _check(case, block_kv, FP32_TOL)


def test_bfloat16():
    rng = np.random.default_rng(7)
    case = attention_case(rng, 3, 4, 8, 2, 64, [33, 0, 70], jnp.bfloat16)
    _check(case, 16, BF16_TOL)


def test_negative_block_is_rejected():
    rng = np.random.default_rng(8)
    case = attention_case(rng, 2, 1, 4, 2, 8, [3, 1], jnp.float32)
    with pytest.raises(ValueError, match="block_kv=-1"):
        paged_attend(paged_inputs(case), 1.0, -1)


def test_shapes_off_the_contract_are_rejected():
    """The walk takes the paged forms' contract and its check (``PagedInputs.check``)."""
    rng = np.random.default_rng(9)
    case = attention_case(rng, 2, 3, 4, 2, 8, [3, 1], jnp.float32)
    args = [case[a] for a in ARGS]
    args[4] = args[4][:, :2]  # positions of 2 tokens for 3 queries
    with pytest.raises(ValueError, match="positions"):
        paged_attend(PagedInputs(case["q"], *args), 1.0, 16)


def test_the_loop_runs_to_the_longest_visible_context(monkeypatch):
    """The loop runs cdiv(longest visible context, block) times, whatever the table's width:
    a chunk's visible context stops at its last query's position, not at ``ctx_len``."""
    trips = []
    loop = jax.lax.fori_loop

    def counted(lower, upper, body, init):
        def step(j, carry):
            jax.debug.callback(lambda: trips.append(1))
            return body(j, carry)

        return loop(lower, upper, step, init)

    monkeypatch.setattr(attention.jax.lax, "fori_loop", counted)
    rng = np.random.default_rng(9)
    for lengths, num_tokens, cut, want in (
        ([70, 0, 1, 33], 1, None, math.ceil(70 / 16)),
        ([9, 3], 1, None, 1),
        ([45, 12], 20, 30, math.ceil(31 / 16)),  # queries at positions <= 30 of 45
    ):
        case = attention_case(rng, len(lengths), num_tokens, 4, 2, 8, lengths, jnp.float32)
        if cut is not None:  # the chunk's queries end at position ``cut``
            case["positions"] = jnp.minimum(case["positions"], cut)
        case["token_table"] = jnp.pad(case["token_table"], ((0, 0), (0, 200)))  # a wide table
        trips.clear()
        jax.block_until_ready(paged_attend(paged_inputs(case), 1.0, 16))
        jax.effects_barrier()
        assert len(trips) == want, (lengths, len(trips), want)
        assert case["token_table"].shape[1] > 16 * want  # the table is wider than the loop


def _kv_gather_widths(step, k_pool_shape) -> set[int]:
    """The context widths of the gathers from a K/V pool in ``step``'s jaxpr."""
    widths = set()
    for eqn in step_eqns(jax.make_jaxpr(step)().jaxpr):
        if eqn.primitive.name == "gather" and eqn.invars[0].aval.shape == k_pool_shape:
            widths.add(eqn.outvars[0].aval.shape[1])  # [B, width, Hkv, D]
    return widths


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_forward_reads_blocks_of_the_tuned_width(family):
    """The XLA forward reads the pools in blocks of the tuning's ``xla_block_kv`` (0: the
    whole table, the guard that the check sees a full-width read) and gives the forward of
    the reference attention on every real token, gate (Qwen3-Next) or not."""
    model = tiny_model(family)
    cfg = model.config
    rng = np.random.default_rng(17)
    kv, rec = _random_caches(rng, cfg, 3)
    inputs = _verify_inputs(rng, cfg.vocab_size, [WIDTH, 0, 3])
    table_width = inputs.kv_read_idx.shape[1]

    def forward(kernels, inputs=inputs, mode="verify"):
        def step():
            return model.family.forward(
                model.params, cfg, inputs, kv, rec, mode=mode, kernels=kernels
            )

        return step

    reference = dataclasses.replace(XLA_KERNELS, paged_attention=paged_attention_reference)
    real = np.arange(WIDTH)[None, :] < np.asarray(inputs.num_new)[:, None]
    want = np.asarray(jax.jit(forward(reference))()[0])[real]
    for block, widths in ((3, {3}), (0, {table_width})):
        tuning = Tuning().with_overrides({"attention.xla_block_kv": block})
        kernels = dataclasses.replace(XLA_KERNELS, tuning=tuning)
        assert _kv_gather_widths(forward(kernels), kv.k[0].shape) == widths
        got = np.asarray(jax.jit(forward(kernels))()[0])[real]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    decode = forward(dataclasses.replace(XLA_KERNELS, tuning=tuning), first_tokens(inputs))
    assert np.isfinite(np.asarray(jax.jit(decode)()[0])).all()


def test_every_device_kind_has_a_block():
    assert all(record.xla_block_kv > 0 for record in TABLE.values())
    assert Tuning().with_overrides({"attention.xla_block_kv": 128}).attention.xla_block_kv == 128
