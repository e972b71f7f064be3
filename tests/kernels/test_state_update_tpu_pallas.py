"""The TPU-layout state updates (scalar-prefetched slots) against the scans the GPU forms
are checked against, run in TPU interpret mode on CPU (the interpreter's fresh buffers are
NaN, so an output the kernel leaves unwritten fails), and their lowering to Mosaic at the
model shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.kernels import common
from lazyspec.kernels.gdn import update_tpu as gdn_tpu
from lazyspec.kernels.mamba2 import update_tpu as mamba2_tpu
from lazyspec.kernels.state import dispatch as state_dispatch
from lazyspec.kernels.state import update_common as su
from tests.kernels.kernel_checks import TpuInterpret, launch_names
from tests.kernels.test_state_update_pallas import (
    BF16_OUT_TOL,
    FP32_TOL,
    check_result,
    gdn_case,
    gdn_reference_run,
    mamba2_case,
    mamba2_reference_run,
)

pytestmark = pytest.mark.pallas

GDN_CASES = [  # seed, batch, tokens, heads, key_dim, value_dim, slots, bh, mode, dtype
    (31, 3, 1, 16, 8, 16, 6, 8, "decode", jnp.float32),
    (32, 5, 4, 24, 16, 8, 9, 8, "verify", jnp.float32),
    (33, 7, 2, 6, 8, 8, 10, 8, "decode", jnp.float32),  # fewer heads than 8: one whole tile
    (34, 3, 3, 16, 8, 16, 5, 16, "verify", jnp.bfloat16),
]


@pytest.mark.parametrize("case", GDN_CASES, ids=lambda c: f"gdn{c[0]}-{c[8]}")
def test_gdn_tpu_layout_matches_scan(case):
    seed, batch, tokens, heads, dk, dv, slots, bh, mode, dtype = case
    rng = np.random.default_rng(seed)
    pool, slot, inputs = gdn_case(rng, batch, tokens, heads, dk, dv, slots, dtype)
    outs, expected_pool, states = gdn_reference_run(pool, slot, inputs)
    tpu = TpuInterpret()
    got = gdn_tpu.gdn_state_update_tpu(
        pool, slot, inputs, mode=mode, block_heads=bh, interpret=tpu.params
    )
    assert tpu.ran(batch * max(heads // bh, 1))
    out_tol = FP32_TOL if dtype == jnp.float32 else BF16_OUT_TOL
    check_result(got, pool, slot, mode, outs, expected_pool, states, out_tol)


MAMBA2_CASES = [  # seed, batch, tokens, heads, groups, P, N, slots, bh, mode, dtype
    (41, 3, 1, 16, 2, 8, 16, 5, 8, "decode", jnp.float32),
    (42, 5, 4, 32, 2, 8, 16, 8, 8, "verify", jnp.float32),
    (43, 6, 3, 48, 3, 4, 8, 9, 8, "decode", jnp.float32),
    (44, 3, 2, 8, 1, 8, 16, 4, 8, "verify", jnp.bfloat16),
    (49, 4, 1, 4, 2, 8, 16, 5, 4, "decode", jnp.float32),  # tiny Nemotron-H: 2 groups a tile
    (48, 3, 2, 16, 4, 4, 8, 6, 8, "verify", jnp.float32),  # 8 heads a tile over 2 groups
]


@pytest.mark.parametrize("case", MAMBA2_CASES, ids=lambda c: f"mamba{c[0]}-{c[9]}")
def test_mamba2_tpu_layout_matches_scan(case):
    seed, batch, tokens, heads, groups, p, n, slots, bh, mode, dtype = case
    rng = np.random.default_rng(seed)
    pool, slot, inputs = mamba2_case(rng, batch, tokens, heads, groups, p, n, slots, dtype)
    outs, expected_pool, states = mamba2_reference_run(pool, slot, inputs)
    tpu = TpuInterpret()
    got = mamba2_tpu.mamba2_state_update_tpu(
        pool, slot, inputs, mode=mode, block_heads=bh, interpret=tpu.params
    )
    assert tpu.ran(batch * (heads // bh))
    out_tol = FP32_TOL if dtype == jnp.float32 else BF16_OUT_TOL
    check_result(got, pool, slot, mode, outs, expected_pool, states, out_tol)


def test_tpu_layout_rejects_illegal_tiles():
    rng = np.random.default_rng(45)
    pool, slot, inputs = gdn_case(rng, 2, 1, 16, 8, 256, 3, jnp.float32)
    with pytest.raises(ValueError, match="multiple of 8"):
        gdn_tpu.gdn_state_update_tpu(pool, slot, inputs, mode="decode", block_heads=4)
    with pytest.raises(ValueError, match="multiple of 128"):
        gdn_tpu.gdn_state_update_tpu(pool, slot, inputs, mode="decode", block_value=64)
    pool, slot, inputs = mamba2_case(rng, 2, 1, 24, 4, 4, 8, 3, jnp.float32)
    with pytest.raises(ValueError, match="multiple of 8"):
        mamba2_tpu.mamba2_state_update_tpu(pool, slot, inputs, mode="verify", block_heads=12)


def test_tpu_head_tile_fits_the_tuning_or_gives_none():
    tile = common.tpu_head_tile
    assert [tile(h, 8) for h in (128, 32, 24, 16, 8)] == [8] * 5
    assert [tile(h, 16) for h in (128, 24, 40)] == [16, 8, 8]
    assert [tile(h, 8) for h in (4, 6, 1)] == [4, 6, 1]  # all heads: fewer than the tile
    assert tile(12, 8) is None and tile(20, 16) is None  # no legal tile: the XLA scan


@pytest.mark.parametrize("heads, groups, kernel", [(4, 2, True), (12, 3, False)])
def test_dispatch_on_tpu_takes_the_tuned_tile_or_the_scan(heads, groups, kernel):
    """With platform="tpu" the default is XLA, and kernel_backend="pallas" runs the TPU
    layout with the tuning's head tile (4 heads: all of them, over 2 groups) in TPU interpret
    mode, or, where no tile fits (12 heads, a tile of 8), the XLA scan; all agree with it."""
    rng = np.random.default_rng(46 + heads)
    pool, slot, inputs = mamba2_case(rng, 4, 2, heads, groups, 8, 16, 6, jnp.float32)
    assert common.resolve_backend(None, "tpu") == "xla"
    outs, _, states = mamba2_reference_run(pool, slot, inputs)
    for kernel_backend in (None, "pallas"):
        tpu = TpuInterpret()

        def update(pool, slot, inputs, kernel_backend=kernel_backend, tpu=tpu):
            return state_dispatch.state_update(
                pool, slot, inputs, mode="verify", platform="tpu",
                kernel_backend=kernel_backend, interpret=tpu.params,
            )  # fmt: skip

        launches = launch_names(jax.make_jaxpr(update)(pool, slot, inputs).eqns)
        assert len(launches) == (1 if kernel_backend and kernel else 0)
        check_result(update(pool, slot, inputs), pool, slot, "verify", outs, None, states, FP32_TOL)
        assert tpu.ran(4 if launches else 0)


def test_tpu_layout_lowers_to_mosaic_at_model_shapes():
    """Qwen3-Next GDN (32 heads, 128 x 128) and Nemotron-H Mamba2 (128 heads, 64 x 128, 8
    groups) lower to Mosaic (block legality and scalar prefetch are checked by that step;
    the TPU compiler itself is not run here)."""
    spec = jax.ShapeDtypeStruct
    batch, slot = 6, spec((6,), jnp.int32)
    for tokens, mode in ((1, "decode"), (4, "verify")):
        gdn = su.GdnTokens(
            *(spec((batch, tokens, 32, 128), jnp.bfloat16),) * 3,
            *(spec((batch, tokens, 32), jnp.float32),) * 2,
        )
        mamba = su.Mamba2Tokens(
            spec((batch, tokens, 128, 64), jnp.bfloat16),
            *(spec((batch, tokens, 8, 128), jnp.bfloat16),) * 2,
            spec((batch, tokens, 128), jnp.float32),
            *(spec((128,), jnp.float32),) * 2,
        )
        for fn, pool, inputs in (
            (gdn_tpu.gdn_state_update_tpu, (9, 32, 128, 128), gdn),
            (mamba2_tpu.mamba2_state_update_tpu, (9, 128, 64, 128), mamba),
        ):
            lowered = (
                jax.jit(lambda p, s, t, fn=fn: fn(p, s, t, mode=mode))
                .trace(spec(pool, jnp.float32), slot, inputs)
                .lower(lowering_platforms=("tpu",))
            )
            assert "tpu_custom_call" in lowered.as_text()
            # layer 2 of a stacked 3-layer pool, as the engine's decode step passes it
            lowered = (
                jax.jit(lambda p, s, t, fn=fn: fn(p, s, t, mode=mode, layer=2))
                .trace(spec((3,) + pool, jnp.float32), slot, inputs)
                .lower(lowering_platforms=("tpu",))
            )
            assert "tpu_custom_call" in lowered.as_text()
