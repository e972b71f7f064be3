"""The TPU-layout routed-experts kernel (scalar-prefetched tile experts) against
``grouped_experts``, the GPU form's reference, run in TPU interpret mode on CPU (fresh
buffers NaN: an unwritten row fails), and its lowering to Mosaic at model widths."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.kernels import backend
from lazyspec.kernels.moe import experts_tpu as tpu
from tests.kernels.kernel_checks import TPU_INTERPRET, TpuInterpret, assert_close
from tests.kernels.test_moe_experts_pallas import (
    BF16_TOL,
    FP32_TOL,
    WIDTH,
    expert_stacks,
    reference,
    routing,
)

pytestmark = pytest.mark.pallas

CASES = [  # seed, tokens, top_k, experts, skewed, gated, dtype, block_rows
    (41, 1, 10, 64, False, True, jnp.float32, 8),
    (42, 16, 2, 8, False, False, jnp.bfloat16, 16),
    (43, 40, 1, 8, True, True, jnp.float32, 16),  # one expert holds 40 tokens: 3 tiles
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"tpu{c[0]}-n{c[1]}-k{c[2]}-e{c[3]}")
def test_moe_experts_tpu_layout_matches_grouped_experts(case):
    seed, num_tokens, top_k, num_experts, skewed, gated, dtype, block_rows = case
    rng = np.random.default_rng(seed)
    weights, ids = routing(rng, num_tokens, top_k, num_experts, skewed)
    up, down, gate = expert_stacks(rng, num_experts, dtype, gated)
    x = jnp.asarray(rng.standard_normal((num_tokens, WIDTH)), jnp.float32).astype(dtype)
    interpreter = TpuInterpret()
    got = tpu.moe_experts_tpu(
        x, weights, ids, up, down, gate, block_rows=block_rows, interpret=interpreter.params
    )
    # both launches ran in the TPU interpreter: a tile per row block at least, each launch
    # over one column block (the test widths are whole blocks)
    min_tiles = -(-num_tokens * top_k // block_rows)
    assert len(interpreter.grid_points) >= 2 * min_tiles or not TPU_INTERPRET
    want = reference(x, weights, ids, up, down, gate)
    assert_close(got, want, FP32_TOL if dtype == jnp.float32 else BF16_TOL, "routed experts")


def test_tpu_layout_rejects_illegal_tiles_and_dispatches():
    """Tiles that break Mosaic's block rule are refused; the Pallas record on a TPU runs this
    layout up to MOE_TPU_KERNEL_MAX_TOKENS tokens."""
    rng = np.random.default_rng(44)
    weights, ids = routing(rng, 3, 2, 8, False)
    up, down, gate = expert_stacks(rng, 8, jnp.float32, True)
    x = jnp.asarray(rng.standard_normal((3, WIDTH)), jnp.float32)
    with pytest.raises(ValueError, match="block_rows"):
        tpu.moe_experts_tpu(x, weights, ids, up, down, gate, block_rows=12)
    with pytest.raises(ValueError, match="multiple of 128"):
        tpu.moe_experts_tpu(x, weights, ids, up, down, gate, block_out=16)
    kernel = backend.kernels_for("pallas", "tpu", moe_runner="pallas").moe_experts

    def no_xla():
        raise AssertionError("the kernel's shape ran the XLA form")

    got = kernel(x, weights, ids, up, down, gate, xla_form=no_xla, interpret=TPU_INTERPRET)
    assert_close(got, reference(x, weights, ids, up, down, gate), FP32_TOL, "dispatched")


def test_tpu_layout_lowers_to_mosaic_at_model_shapes():
    """Qwen3-Next widths (2048 hidden, 512 experts of 512, top-10) with the dispatch's TPU
    tiles, SwiGLU and relu^2, lower to a Mosaic custom call."""
    spec = jax.ShapeDtypeStruct
    stack, down = spec((512, 2048, 512), jnp.bfloat16), spec((512, 512, 2048), jnp.bfloat16)
    routed = (
        spec((16, 2048), jnp.bfloat16),
        spec((16, 10), jnp.float32),
        spec((16, 10), jnp.int32),
    )
    for gated in (True, False):

        def run(x, w, ids, up, dn, gate=None):
            return tpu.moe_experts_tpu(x, w, ids, up, dn, gate, block_inner=128, block_out=512)

        stacks = (stack, down, stack) if gated else (stack, down)
        lowered = jax.jit(run).trace(*routed, *stacks).lower(lowering_platforms=("tpu",))
        assert "tpu_custom_call" in lowered.as_text()
