"""The fused residual add, norm and router logits (Pallas in interpret mode) against the
model's ops (``norms.residual_rms_norm``), and the backend's dispatch by token count."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.kernels import backend, common
from lazyspec.kernels.norm import dispatch as norm_dispatch
from lazyspec.kernels.norm.residual import residual_norm_pallas
from lazyspec.kernels.tuning import Tuning
from lazyspec.models.layers.norms import residual_rms_norm
from tests.kernels.kernel_checks import INTERPRET, assert_close, tolerance

pytestmark = pytest.mark.pallas


def _case(rng, tokens, width, experts, dtype=jnp.bfloat16):
    x, delta = (jnp.asarray(rng.standard_normal((tokens, width)), dtype) for _ in range(2))
    weight = jnp.asarray(rng.standard_normal(width) * 0.2, dtype)
    router = None
    if experts:
        router = jnp.asarray(rng.standard_normal((experts, width)) * width**-0.5, dtype)
    return x, delta, weight, router


@pytest.mark.parametrize("parts", [1, 4])
@pytest.mark.parametrize("experts", [0, 16])
def test_residual_norm_pallas_sums_partial_sums_then_rounds(experts, parts):
    """A float32 delta ``[S, N, d]`` (an output projection's partial sums) is summed in
    float32 and rounded to x's dtype before the add, as the projection's own output is:
    the launch equals the model's ops on that rounded sum (the residual exactly), and the
    XLA form (``residual_rms_norm`` given the parts) likewise."""
    rng = np.random.default_rng(7 + parts)
    x, _, weight, router = _case(rng, 3, 64, experts)
    delta = jnp.asarray(rng.standard_normal((parts, 3, 64)) * 0.3, jnp.float32)
    options = {"eps": 1e-6, "zero_centered": True}
    got = residual_norm_pallas(
        x, delta, weight, router, block_experts=4, interpret=INTERPRET, **options
    )
    want = residual_rms_norm(x, jnp.sum(delta, 0).astype(x.dtype), weight, router, **options)
    np.testing.assert_array_equal(np.asarray(got.residual), np.asarray(want.residual))
    np.testing.assert_array_equal(np.asarray(got.normed), np.asarray(want.normed))
    if experts:
        np.testing.assert_allclose(np.asarray(got.logits), np.asarray(want.logits), rtol=1e-5)
    xla = residual_rms_norm(x, delta, weight, router, **options)
    np.testing.assert_array_equal(np.asarray(xla.residual), np.asarray(want.residual))
    for bad in (jnp.concatenate([delta] * 3), delta.astype(jnp.bfloat16), delta[:, :2]):
        with pytest.raises(ValueError, match="partial sums"):
            residual_norm_pallas(x, bad, weight, router, interpret=INTERPRET, **options)


@pytest.mark.parametrize("experts,block_experts", [(0, 4), (16, 4), (16, None), (12, 4)])
@pytest.mark.parametrize("zero_centered", [True, False])
@pytest.mark.parametrize("tokens", [1, 3])
def test_residual_norm_pallas_matches_the_model_ops(tokens, zero_centered, experts, block_experts):
    x, delta, weight, router = _case(np.random.default_rng(tokens), tokens, 64, experts)
    options = {"eps": 1e-6, "zero_centered": zero_centered}
    got = residual_norm_pallas(
        x, delta, weight, router, block_experts=block_experts, interpret=INTERPRET, **options
    )
    want = residual_rms_norm(x, delta, weight, router, **options)  # op by op: rounded as written
    assert got.residual.dtype == got.normed.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(got.residual), np.asarray(want.residual))
    np.testing.assert_array_equal(np.asarray(got.normed), np.asarray(want.normed))
    if router is None:
        assert got.logits is None
        return
    # the kernel's own normed rows times the router, in float64: only the sum order differs
    exact = np.asarray(got.normed, np.float64) @ np.asarray(router, np.float64).T
    assert got.logits.dtype == jnp.float32 and got.logits.shape == (tokens, experts)
    np.testing.assert_allclose(np.asarray(got.logits), exact, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got.logits), np.asarray(want.logits), rtol=1e-5)


@pytest.mark.parametrize("tokens", [1, 3])
def test_norm_without_delta_gives_the_projection_in_its_dtype_pallas(tokens):
    """Without a delta (a GDN layer's input norm): x is normed as it is and returned as the
    residual, and the router's products (``in_proj_ba`` kept ``[out, in]``) come rounded to
    ``logits_dtype``, as the model's bf16 projection gives them."""
    x, _, weight, router = _case(np.random.default_rng(tokens + 7), tokens, 64, 16)
    options = {"eps": 1e-6, "zero_centered": True, "logits_dtype": jnp.bfloat16}
    got = residual_norm_pallas(x, None, weight, router, interpret=INTERPRET, **options)
    want = residual_rms_norm(x, None, weight, router, **options)
    assert got.residual is x and want.residual is x
    np.testing.assert_array_equal(np.asarray(got.normed), np.asarray(want.normed))
    assert got.logits.dtype == want.logits.dtype == jnp.bfloat16
    exact = np.asarray(got.normed, np.float64) @ np.asarray(router, np.float64).T
    scale = np.abs(exact).max()
    np.testing.assert_allclose(np.asarray(got.logits, np.float64), exact, atol=scale * 2.0**-8)
    np.testing.assert_allclose(
        np.asarray(got.logits, np.float32),
        np.asarray(want.logits, np.float32),
        atol=scale * 2.0**-8,
    )
    assert residual_norm_pallas(x, None, weight, interpret=INTERPRET, eps=1e-6).logits is None


def test_residual_norm_pallas_rejects_mismatched_inputs():
    x, delta, weight, router = _case(np.random.default_rng(0), 2, 64, 16)
    options = {"eps": 1e-6, "interpret": INTERPRET}
    with pytest.raises(ValueError, match="one \\[N, d\\] shape and dtype"):
        residual_norm_pallas(x, delta[:1], weight, **options)
    with pytest.raises(ValueError, match="one \\[N, d\\] shape and dtype"):
        residual_norm_pallas(x, delta.astype(jnp.float32), weight, **options)
    with pytest.raises(ValueError, match="weight"):
        residual_norm_pallas(x, delta, weight[:32], **options)
    with pytest.raises(ValueError, match="router"):
        residual_norm_pallas(x, delta, weight, router.T, **options)
    with pytest.raises(ValueError, match="block_experts"):
        residual_norm_pallas(x, delta, weight, router, block_experts=3, **options)


LIMIT = Tuning().norm.residual_max_tokens
PER_EXPERT = Tuning().norm.residual_max_token_experts


@pytest.mark.parametrize(
    "tokens,experts",
    [(LIMIT, 8), (LIMIT + 1, 8), (LIMIT, 0), (LIMIT + 1, 0)]
    + [(PER_EXPERT // 128, 128), (PER_EXPERT // 128 + 1, 128)],
)
def test_dispatch_runs_the_kernel_up_to_the_limit(tokens, experts):
    """Up to ``NormTuning.residual_max_tokens`` tokens, and tokens times experts up to
    ``residual_max_token_experts``, the backend's launch; beyond, the caller's form."""
    x, delta, weight, router = _case(np.random.default_rng(1), tokens, 32, experts)
    over = tokens > LIMIT or tokens * max(experts, 1) > PER_EXPERT
    calls = []

    def xla_form():
        calls.append(tokens)
        return residual_rms_norm(x, delta, weight, router, eps=1e-6)

    fused = backend.kernels_for("pallas", "cpu").residual_norm
    got = fused(x, delta, weight, router, eps=1e-6, xla_form=xla_form)
    assert calls == ([tokens] if over else [])
    np.testing.assert_array_equal(np.asarray(got.normed), np.asarray(xla_form().normed))


@pytest.mark.parametrize("with_delta", [True, False, "parts"])
def test_launch_lowers_to_one_triton_call_at_qwen3_next_widths(with_delta):
    """The CUDA lowering (built on CPU, not compiled) at Qwen3-Next's widths: the
    post-mixer launch with the MoE router (float32 logits), given the mixer's output or its
    output projection's four float32 parts, and the GDN input launch without a delta (64
    rows of ``in_proj_ba``, bf16 products) are one Triton call each."""
    import jax

    spec = jax.ShapeDtypeStruct
    options = {"eps": 1e-6, "zero_centered": True}
    options["compiler_params"] = common.pallas_compiler_params("gpu")
    options["logits_dtype"] = jnp.float32 if with_delta else jnp.bfloat16
    row = spec((4, 2048), jnp.bfloat16)

    def launch(x, delta, weight, router):
        return residual_norm_pallas(x, delta if with_delta else None, weight, router, **options)

    delta = spec((4, 4, 2048), jnp.float32) if with_delta == "parts" else row
    args = (row, delta, spec((2048,), jnp.bfloat16), spec((64, 2048), jnp.bfloat16))
    text = jax.jit(launch).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1


def test_dispatch_takes_the_router_tile_it_is_set_to(monkeypatch):
    """The launch's router rows a program are the tuning's ``block_experts`` (fitted to the
    router), and up to ``few_tokens`` tokens ``few_block_experts``; the warps likewise
    (``num_warps``, ``few_num_warps``): each resolved record launches with its own."""
    seen = []

    def recorder(*args, block_experts, **options):
        seen.append(block_experts)
        return residual_norm_pallas(*args, block_experts=block_experts, **options)

    def options(interpret, compiler_params, num_warps=4):
        seen.append(("warps", num_warps))
        return {"interpret": True, "compiler_params": None}

    monkeypatch.setattr(norm_dispatch, "residual_norm_pallas", recorder)
    monkeypatch.setattr(norm_dispatch, "pallas_options", options)
    x, delta, weight, router = _case(np.random.default_rng(2), 2, 32, 8)
    base = Tuning().with_overrides({"norm.few_block_experts": 2, "norm.few_num_warps": 1})
    # (few tokens, block, warps) -> the launch's (warps, block), at two tokens of 8 experts
    cases = {
        (1, 1, 2): (2, 1),
        (1, 16, 8): (8, 8),  # 16 fitted to 8 experts
        (2, 4, 4): (1, 2),  # two tokens are few: the few tokens' tile
        (4, 16, 8): (1, 2),
    }
    for (few_tokens, block, warps), (want_warps, want) in cases.items():
        tuning = base.with_overrides(
            {"norm.few_tokens": few_tokens, "norm.block_experts": block, "norm.num_warps": warps}
        )
        fused = backend.kernels_for("pallas", "cpu", tuning=tuning).residual_norm
        seen.clear()
        got = fused(x, delta, weight, router, eps=1e-6, xla_form=None)
        assert seen == [("warps", want_warps), want], (few_tokens, block, seen)
        ref = residual_rms_norm(x, delta, weight, router, eps=1e-6)
        # the launch's own normed rows times the router: whatever the tile, only the sum
        # order differs, and the rounding of the normed rows to bf16 (XLA on a GPU keeps
        # them in float32 inside the product: it drops a float32 -> bf16 -> float32 pair)
        np.testing.assert_array_equal(np.asarray(got.residual), np.asarray(ref.residual))
        exact = np.asarray(got.normed, np.float64) @ np.asarray(router, np.float64).T
        tol = tolerance(x.dtype, reduction_length=x.shape[1], roundings=1)
        assert_close(got.logits, exact, tol, f"logits at block {block}")
