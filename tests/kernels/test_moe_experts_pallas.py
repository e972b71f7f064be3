"""The routed-experts kernel (Pallas in interpret mode) against ``grouped_experts``, its
grouping of pairs by expert, the dispatch by shape and the MoE layers that call it."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.kernels import backend, common
from lazyspec.kernels.moe import dispatch as moe_dispatch
from lazyspec.kernels.moe import experts as me
from lazyspec.kernels.moe import grouping as moe_grouping
from lazyspec.kernels.moe import plan as moe_plan
from lazyspec.kernels.moe import routing as moe_routing
from lazyspec.kernels.tuning import Tuning
from lazyspec.models.layers import moe, relu2_moe
from lazyspec.models.layers.linear import linear
from lazyspec.models.plan import init_plan
from lazyspec.testing.routing import expert_picks, picks_differ, router_picks
from tests.kernels.kernel_checks import (
    INTERPRET,
    as_one_program,
    assert_close,
    dot_tile,
    launch_names,
    tolerance,
)

pytestmark = pytest.mark.pallas

WIDTH, INNER = 32, 16
FP32_TOL = tolerance(jnp.float32, reduction_length=WIDTH + INNER)
# bf16: the XLA form rounds gate, up, their product and the expert's output to bf16 (each
# within 2**-9 relative) where the kernel rounds only the intermediate; a few such roundings
# of terms of either sign, relative to the output's largest element.
BF16_TOL = tolerance(jnp.bfloat16, reduction_length=WIDTH + INNER, roundings=8)
# tiles that split the tiny widths where the kernel is interpreted
SMALL_TILES = {
    "block_inner": dot_tile(8),
    "block_out": 16,
    "block_k": dot_tile(8),
    "interpret": INTERPRET,
}
# The kernel and the groupings as the engine's steps run them, each call one program
# (``as_one_program``); tests that read a call's jaxpr trace the functions themselves.
moe_experts_pallas = as_one_program(me.moe_experts_pallas)
group_pairs = as_one_program(moe_grouping.group_pairs)
group_tokens = as_one_program(moe_grouping.group_tokens)
route_tokens = as_one_program(moe_routing.route_tokens)


def routing(rng, num_tokens, top_k, num_experts, skewed):
    """(weights [N, k] float32, expert ids [N, k]) with distinct experts per token; skewed:
    every token's first choice is expert 3."""
    scores = rng.standard_normal((num_tokens, num_experts))
    if skewed:
        scores[:, 3] = 100.0
    ids = np.argsort(-scores, axis=1)[:, :top_k].astype(np.int32)
    weights = rng.random((num_tokens, top_k)).astype(np.float32)
    return jnp.asarray(weights), jnp.asarray(ids)


def expert_stacks(rng, num_experts, dtype, gated):
    """(up, down, gate or None) with random values (scaled so outputs stay near 1)."""
    normal = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32).astype(dtype)  # noqa: E731
    up = normal(num_experts, WIDTH, INNER)
    down = normal(num_experts, INNER, WIDTH)
    return up, down, normal(num_experts, WIDTH, INNER) if gated else None


@as_one_program
def reference(x, weights, ids, up, down, gate):
    """``grouped_experts`` with the layers' own SwiGLU / relu^2 expert functions, its float32
    dots in full precision (``conftest.py``; on GPUs XLA's default is TF32, up to 8e-4 off the
    kernel's IEEE dots at these widths, where full precision agrees within 1.1e-7:
    BENCHMARKS.md)."""

    def experts(xs, sizes):
        xs = xs.astype(up.dtype)
        u = jax.lax.ragged_dot(xs, up, sizes)
        if gate is None:
            h = jax.nn.relu(u)
            return jax.lax.ragged_dot(h * h, down, sizes)
        h = jax.nn.silu(jax.lax.ragged_dot(xs, gate, sizes)) * u
        return jax.lax.ragged_dot(h, down, sizes)

    return moe.grouped_experts(x, weights, ids, up.shape[0], experts)


CASES = [  # seed, tokens, top_k, experts, skewed, gated, dtype
    (1, 1, 1, 8, False, True, jnp.float32),
    (2, 1, 10, 64, False, True, jnp.bfloat16),
    (3, 3, 2, 8, False, False, jnp.float32),
    (4, 3, 10, 64, True, True, jnp.float32),
    (5, 16, 2, 64, False, True, jnp.bfloat16),
    (6, 16, 1, 8, True, False, jnp.bfloat16),
    (7, 64, 10, 64, False, False, jnp.float32),
    (8, 64, 1, 8, True, True, jnp.float32),  # one expert holds all 64 tokens: 4 tiles
    (9, 64, 2, 8, True, False, jnp.bfloat16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"moe{c[0]}-n{c[1]}-k{c[2]}-e{c[3]}")
def test_moe_experts_pallas_matches_grouped_experts(case):
    seed, num_tokens, top_k, num_experts, skewed, gated, dtype = case
    rng = np.random.default_rng(seed)
    weights, ids = routing(rng, num_tokens, top_k, num_experts, skewed)
    up, down, gate = expert_stacks(rng, num_experts, dtype, gated)
    x = jnp.asarray(rng.standard_normal((num_tokens, WIDTH)), jnp.float32).astype(dtype)
    want = reference(x, weights, ids, up, down, gate)
    got = moe_experts_pallas(x, weights, ids, up, down, gate, **SMALL_TILES)
    assert got.dtype == jnp.float32
    assert_close(got, want, FP32_TOL if dtype == jnp.float32 else BF16_TOL, "routed experts")


@as_one_program
def shared_reference(x, shared: moe_plan.SharedExpert):
    """``weight[n] * shared_expert(x[n])`` in float32 at full precision (``conftest.py``)."""
    dot = lambda a, b: jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))  # noqa: E731
    u = dot(x, shared.up)
    if shared.gate is None:
        h = jax.nn.relu(u) ** 2
    else:
        h = jax.nn.silu(dot(x, shared.gate)) * u
    return shared.weight[:, None] * dot(h.astype(shared.up.dtype), shared.down)


# seed, tokens, top_k, experts, gated, dtype: token rows (<= 8 tokens) and staged rows
SHARED_CASES = [
    (21, 1, 2, 8, True, jnp.float32),
    (22, 3, 10, 64, True, jnp.bfloat16),
    (23, 8, 2, 8, False, jnp.float32),
    (24, 16, 2, 8, True, jnp.float32),
    (25, 64, 10, 64, False, jnp.bfloat16),
]


@pytest.mark.parametrize("case", SHARED_CASES, ids=lambda c: f"shared{c[0]}-n{c[1]}")
def test_shared_expert_runs_as_one_more_expert_pallas(case):
    """With a shared expert the kernel's sum is the routed experts' plus each token's
    weighted shared expert, through both groupings, gated and relu^2."""
    seed, num_tokens, top_k, num_experts, gated, dtype = case
    rng = np.random.default_rng(seed)
    weights, ids = routing(rng, num_tokens, top_k, num_experts, False)
    up, down, gate = expert_stacks(rng, num_experts, dtype, gated)
    s_up, s_down, s_gate = expert_stacks(rng, 1, dtype, gated)
    shared = moe_plan.SharedExpert(
        up=s_up[0],
        down=s_down[0],
        gate=None if s_gate is None else s_gate[0],
        weight=jnp.asarray(rng.random(num_tokens), jnp.float32),
    )
    x = jnp.asarray(rng.standard_normal((num_tokens, WIDTH)), jnp.float32).astype(dtype)
    want = reference(x, weights, ids, up, down, gate) + shared_reference(x, shared)
    tiles = dict(SMALL_TILES)
    got = moe_experts_pallas(x, weights, ids, up, down, gate, shared=shared, **tiles)
    assert_close(got, want, FP32_TOL if dtype == jnp.float32 else BF16_TOL, "with shared")
    # the shared part is really there: without it the sum differs by about its size
    alone = moe_experts_pallas(x, weights, ids, up, down, gate, **tiles)
    gap = float(jnp.max(jnp.abs(got - alone - shared_reference(x, shared))))
    assert gap <= BF16_TOL * float(jnp.max(jnp.abs(want))), gap


def test_down_launch_takes_its_own_chunk_pallas():
    """``block_k_down`` sets the down launch's contraction chunk apart from the up launch's
    (a tile sweep's knob): the whole intermediate row in one chunk sums as the default
    tiles do, and a chunk that does not divide it is refused."""
    rng = np.random.default_rng(27)
    weights, ids = routing(rng, 3, 2, 8, False)
    up, down, gate = expert_stacks(rng, 8, jnp.float32, True)
    x = jnp.asarray(rng.standard_normal((3, WIDTH)), jnp.float32)
    tiles = dict(SMALL_TILES)
    want = moe_experts_pallas(x, weights, ids, up, down, gate, **tiles)
    got = moe_experts_pallas(x, weights, ids, up, down, gate, **tiles, block_k_down=INNER)
    assert_close(got, want, FP32_TOL, "down chunk")
    with pytest.raises(ValueError, match="block_k"):
        moe_experts_pallas(x, weights, ids, up, down, gate, **tiles, block_k_down=INNER - 1)


def test_shared_expert_of_other_widths_is_refused_pallas():
    rng = np.random.default_rng(26)
    weights, ids = routing(rng, 2, 2, 8, False)
    up, down, gate = expert_stacks(rng, 8, jnp.float32, True)
    x = jnp.asarray(rng.standard_normal((2, WIDTH)), jnp.float32)
    wide = moe_plan.SharedExpert(
        up=jnp.zeros((WIDTH, 2 * INNER)), down=down[0], gate=gate[0], weight=jnp.ones(2)
    )
    with pytest.raises(ValueError, match="shared up"):
        moe_experts_pallas(x, weights, ids, up, down, gate, shared=wide, interpret=INTERPRET)
    ungated = moe_plan.SharedExpert(up=up[0], down=down[0], gate=None, weight=jnp.ones(2))
    with pytest.raises(ValueError, match="has a gate exactly when"):
        moe_experts_pallas(x, weights, ids, up, down, gate, shared=ungated, interpret=INTERPRET)


def test_grouping_gives_only_routed_experts_their_tiles_pallas():
    """Each routed expert gets ceil(count / rows) tiles in expert order, no other expert any
    (so no unrouted expert's weights are read); an expert's pairs fill the rows of its tiles
    from the first, in token order, and each staged row holds its pair's token and weight."""
    rng = np.random.default_rng(12)
    block_rows = 4
    for num_tokens, top_k, num_experts, skewed in ((5, 3, 16, False), (9, 2, 8, True)):
        weights, ids = routing(rng, num_tokens, top_k, num_experts, skewed)
        tiles = group_pairs(weights, ids, num_experts, block_rows)
        counts = np.bincount(np.asarray(ids).ravel(), minlength=num_experts)
        want = np.repeat(np.arange(num_experts), -(-counts // block_rows))
        bound = moe_grouping.max_tiles(num_tokens * top_k, num_experts, block_rows)
        tile_expert = np.asarray(tiles.tile_expert)
        assert tile_expert.shape == (bound,) and len(want) <= bound
        np.testing.assert_array_equal(tile_expert[: len(want)], want)
        assert (tile_expert[len(want) :] == moe_grouping.UNUSED_TILE).all()
        rows = np.asarray(tiles.pair_row)
        first_tile = np.cumsum(-(-counts // block_rows)) - (-(-counts // block_rows))
        seen = np.zeros(num_experts, np.int64)
        for pair, expert in enumerate(np.asarray(ids).ravel()):  # packed in token order
            assert rows.ravel()[pair] == first_tile[expert] * block_rows + seen[expert]
            seen[expert] += 1
        tokens = np.broadcast_to(np.arange(num_tokens)[:, None], rows.shape)
        np.testing.assert_array_equal(np.asarray(tiles.row_token)[rows], tokens)
        np.testing.assert_array_equal(np.asarray(tiles.row_weight)[rows], np.asarray(weights))
        assert (tile_expert[rows // block_rows] == np.asarray(ids)).all()


def test_pairs_outside_the_stacks_are_dropped_pallas():
    """Expert parallelism: each shard runs its block of the experts with ids shifted by its
    first expert; pairs of the other shards add nothing and take no staged row, and the
    shards' results sum to the whole call's."""
    rng = np.random.default_rng(15)
    num_experts, num_shards = 8, 2
    weights, ids = routing(rng, 5, 3, num_experts, False)
    up, down, gate = expert_stacks(rng, num_experts, jnp.float32, True)
    x = jnp.asarray(rng.standard_normal((5, WIDTH)), jnp.float32)
    want = reference(x, weights, ids, up, down, gate)
    per = num_experts // num_shards
    kernel = jax.jit(
        lambda *a: me.moe_experts_pallas(*a, block_rows=dot_tile(4), interpret=INTERPRET)
    )
    total = 0.0
    for shard in range(num_shards):
        block = slice(shard * per, (shard + 1) * per)
        local = ids - shard * per
        mine = (local >= 0) & (local < per)
        assert bool(mine.any()) and not bool(mine.all())
        got = kernel(x, weights, local, up[block], down[block], gate[block])
        tiles = group_pairs(weights, local, per, 4)
        counts = np.bincount(np.asarray(local)[np.asarray(mine)], minlength=per)
        used = int((np.asarray(tiles.tile_expert) != moe_grouping.UNUSED_TILE).sum())
        assert used == int((-(-counts // 4)).sum())  # tiles for this shard's pairs only
        only = reference(x, jnp.where(mine, weights, 0.0), ids, up, down, gate)
        assert_close(got, only, FP32_TOL, f"shard {shard}")
        total = total + got
    assert_close(total, want, FP32_TOL, "sum over shards")


def test_unrouted_experts_may_hold_nan_pallas():
    """NaN weights in every expert no token chose leave the result finite and right."""
    rng = np.random.default_rng(13)
    weights, ids = routing(rng, 3, 2, 8, False)
    up, down, gate = expert_stacks(rng, 8, jnp.float32, True)
    unrouted = np.setdiff1d(np.arange(8), np.asarray(ids))
    assert len(unrouted) >= 2
    want = reference(jnp.ones((3, WIDTH)), weights, ids, up, down, gate)
    up, down, gate = (a.at[unrouted].set(jnp.nan) for a in (up, down, gate))
    got = moe_experts_pallas(
        jnp.ones((3, WIDTH)), weights, ids, up, down, gate, interpret=INTERPRET
    )
    assert_close(got, want, FP32_TOL, "routed experts beside NaN experts")


def test_dispatch_runs_the_kernel_in_pieces_of_its_token_limit_pallas():
    """The Pallas record's ``moe_experts`` runs the kernel, never the caller's XLA form, on
    any token count: past the tuning's ``kernel_max_tokens`` in pieces of at most that many
    tokens (here 12, 12 and 5: staged rows, then token rows), each of a piece's launches
    once; the sums are each token's own, the reference's, with and without the shared
    expert. Cut in pieces it takes the router's weights and ids as given. The XLA record
    has no MoE kernel. A small limit keeps the interpreted kernel quick."""
    assert backend.XLA_KERNELS.moe_experts is None
    assert Tuning().moe.kernel_max_tokens >= 1024  # verify and prefill sizes take the kernel
    limit, num_tokens, num_experts = 12, 29, 8
    tuning = Tuning().with_overrides({"moe.kernel_max_tokens": limit})
    kernel = backend.kernels_for("pallas", "cpu", tuning=tuning).moe_experts
    run_kernel = as_one_program(kernel)
    rng = np.random.default_rng(14)
    up, down, gate = expert_stacks(rng, num_experts, jnp.float32, True)
    weights, ids = routing(rng, num_tokens, 2, num_experts, False)
    x = jnp.asarray(rng.standard_normal((num_tokens, WIDTH)), jnp.float32)
    s_up, s_down, s_gate = expert_stacks(rng, 1, jnp.float32, True)
    shared = moe_plan.SharedExpert(
        s_up[0], s_down[0], s_gate[0], jnp.asarray(rng.random(num_tokens))
    )
    logits = jnp.asarray(rng.standard_normal((num_tokens, num_experts)), jnp.float32)
    ignored = moe_routing.TokenRouting(logits, 2, True)  # picks other than weights / ids

    def no_xla():
        raise AssertionError("the kernel's dispatch ran the XLA form")

    want = reference(x, weights, ids, up, down, gate)
    for extra, add in (({}, 0.0), ({"shared": shared}, shared_reference(x, shared))):
        got = run_kernel(x, weights, ids, up, down, gate, xla_form=no_xla, routing=ignored, **extra)
        assert_close(got, want + add, FP32_TOL, f"routed experts in pieces {sorted(extra)}")

    def launches(n: int) -> list[str]:
        run = lambda *a: kernel(*a, up, down, gate, xla_form=no_xla)  # noqa: E731
        return launch_names(jax.make_jaxpr(run)(x[:n], weights[:n], ids[:n]).eqns)

    one = launches(limit)
    assert one and launches(num_tokens) == one * 2 + launches(num_tokens - 2 * limit)


@pytest.mark.parametrize("fused", (0, 2))
def test_output_tile_widens_from_sixteen_tokens_pallas(fused):
    """At Qwen3-Next's expert widths the down launch's output tile is 64 columns below
    ``wide_out_tokens`` tokens and 128 from there; the up launch's intermediate tile is 64
    columns at every count; a width below a tile keeps its fitted tile. Up to
    ``down_in_up_max_tokens`` tokens (none, or two here) the down product runs in the up
    launch, in chunks of ``fold_block_out`` columns, the intermediate tile
    ``fold_block_inner`` columns."""
    up, down = jnp.zeros((8, 2048, 512)), jnp.zeros((8, 512, 2048))
    tuning = Tuning().with_overrides({"moe.down_in_up_max_tokens": fused})
    wide = tuning.moe.wide_out_tokens

    def launch_of(tokens, tuning=tuning, up=up, down=down):
        return moe_dispatch.moe_launch(tokens, up, down, interpret=INTERPRET, tuning=tuning)

    for tokens, block_out in ((fused + 1, 64), (wide - 1, 64), (wide, 128), (2048, 128)):
        launch = launch_of(tokens)
        assert (launch["block_out"], launch["block_inner"]) == (block_out, 64), tokens
        assert not launch["down_in_up"], tokens
    for tokens in range(1, fused + 1):  # the down product in the up launch, wide chunks
        launch = launch_of(tokens)
        assert launch["down_in_up"], tokens
        assert launch["block_out"] == tuning.moe.fold_block_out, tokens
        assert launch["block_inner"] == tuning.moe.fold_block_inner, tokens
    for pair_grid in (False, True):  # a program per pair only where the fold routes too
        grid = tuning.with_overrides({"moe.pair_grid": pair_grid})
        for tokens in (1, fused, fused + 1):
            launch = launch_of(tokens, grid)
            folded = launch["down_in_up"] and launch["route_in_up"]
            assert launch["pair_grid"] == (pair_grid and folded), (pair_grid, tokens)
    inner = tuning.with_overrides({"moe.fold_block_inner": 128})  # its own tile
    assert launch_of(fused + 1, inner)["block_inner"] == 64
    if fused:
        assert launch_of(fused, inner)["block_inner"] == 128
    narrow_up, narrow_down = jnp.zeros((8, 2048, 48)), jnp.zeros((8, 48, 96))
    launch = launch_of(wide, tuning, narrow_up, narrow_down)
    assert (launch["block_inner"], launch["block_out"]) == (16, 32)


def test_dispatch_leaves_widths_below_triton_dots_to_xla_pallas(monkeypatch):
    """Compiled for Triton (not interpret), an intermediate width of 24 (largest power-of-two
    tile 8 < 16) runs the XLA form; 32 runs the kernel."""
    compiled = {"interpret": False, "compiler_params": None}
    monkeypatch.setattr(moe_dispatch, "pallas_options", lambda *args: dict(compiled))
    launched = []
    monkeypatch.setattr(moe_dispatch, "moe_experts_pallas", lambda *a, **k: launched.append(k))
    kernel = backend.kernels_for("pallas", "cpu").moe_experts
    routed = (jnp.zeros((2, WIDTH)), jnp.ones((2, 2)), jnp.zeros((2, 2), jnp.int32))
    for inner, want in ((24, "xla"), (32, None)):
        up, down = jnp.zeros((8, WIDTH, inner)), jnp.zeros((8, inner, WIDTH))
        assert kernel(*routed, up, down, up, xla_form=lambda: "xla") == want
    assert len(launched) == 1 and launched[0]["block_k"] == 32


def test_moe_layers_with_kernel_match_xla_pallas():
    """Both MoE layers (SwiGLU with shared expert; relu^2 with latent projections and grouped
    routing) give the same output through the kernel as through grouped_experts."""
    kernel = backend.kernels_for("pallas", "cpu").moe_experts
    sparse_moe, relu2_sparse_moe = map(as_one_program, (moe.sparse_moe, relu2_moe.sparse_moe))
    x = jnp.asarray(np.random.default_rng(15).standard_normal((2, 3, WIDTH)), jnp.float32)
    # a shared expert of another width runs as its own MLP; of the routed experts' width in
    # the kernel's launches (``fused_shared_expert``)
    for shared_width, fused in ((24, False), (INNER, True)):
        spec = moe.MoESpec(WIDTH, 8, 2, INNER, shared_width, norm_topk_prob=True)
        params = init_plan(moe.moe_plan("mlp", spec), jax.random.key(0), jnp.float32, 0.3)
        gate = jnp.ones(6)
        assert (moe.fused_shared_expert(params, kernel, gate) is not None) == fused
        assert moe.fused_shared_expert(params, None, gate) is None
        # more tokens than the fusion was measured to help keep the MLP of their own
        many = jnp.ones(moe.FUSE_SHARED_MAX_TOKENS + 1)
        assert moe.fused_shared_expert(params, kernel, many) is None
        assert_close(
            sparse_moe(params, spec, x, kernel), sparse_moe(params, spec, x), 1e-5, "swiglu"
        )
    spec = relu2_moe.MoESpec(8, 2, INNER, 24, 16, 2, 1, True, 2.5)
    params = init_plan(
        relu2_moe.moe_plan("mixer", WIDTH, spec, False), jax.random.key(1), jnp.float32, 0.3
    )
    assert_close(
        relu2_sparse_moe(params, spec, x, kernel),
        relu2_sparse_moe(params, spec, x),
        1e-5,
        "relu2 latent",
    )


def lower_for_cuda(fn, *args) -> str:
    """Lower ``fn`` for an NVIDIA GPU on this machine (Triton IR is built, not compiled)."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_moe_experts_lower_to_triton_at_model_shapes_pallas():
    """Qwen3-Next widths (2048 hidden, 512 experts of 512, top-10; SwiGLU) and Nemotron-H-like
    relu^2 experts lower through Pallas-Triton with the dispatch's default tiles; a
    non-power-of-two tile is rejected, which shows the lowering checks ran."""
    spec = jax.ShapeDtypeStruct
    tiles = Tuning().moe
    params = common.pallas_compiler_params("gpu", tiles.num_warps, tiles.num_stages)
    kwargs = {k: getattr(tiles, k) for k in ("block_rows", "block_inner", "block_out", "block_k")}
    routed = (spec((16, 10), jnp.float32), spec((16, 10), jnp.int32))

    def run(x, w, ids, up, down, gate=None, **extra):
        options = {**kwargs, **extra, "compiler_params": params}
        return me.moe_experts_pallas(x, w, ids, up, down, gate, **options)

    stack = spec((512, 2048, 512), jnp.bfloat16)
    text = lower_for_cuda(
        run,
        spec((16, 2048), jnp.bfloat16),
        *routed,
        stack,
        spec((512, 512, 2048), jnp.bfloat16),
        stack,
    )
    assert "triton" in text.lower()
    two_tokens = (  # the token-rows grouping, x read whole by every tile
        spec((2, 2048), jnp.bfloat16),
        spec((2, 10), jnp.float32),
        spec((2, 10), jnp.int32),
        stack,
        spec((512, 512, 2048), jnp.bfloat16),
        stack,
    )
    assert "triton" in lower_for_cuda(run, *two_tokens).lower()
    one_chunk = common.pallas_compiler_params("gpu", tiles.num_warps, 1)
    down_whole = {"block_k_down": 512, "down_compiler_params": one_chunk}  # sweep knobs
    assert "triton" in lower_for_cuda(lambda *a: run(*a, **down_whole), *two_tokens).lower()
    shared = moe_plan.SharedExpert(  # Qwen3-Next's shared expert in the same launches
        up=spec((2048, 512), jnp.bfloat16),
        down=spec((512, 2048), jnp.bfloat16),
        gate=spec((2048, 512), jnp.bfloat16),
        weight=spec((2,), jnp.float32),
    )
    text = lower_for_cuda(lambda *a: run(*a[:-1], shared=a[-1]), *two_tokens, shared)
    assert text.lower().count("triton") >= 2

    def by_logits(x, logits, real, gate, *rest, route_in_up, **fold):  # picked in the kernel
        shared = rest[-1]  # its gate's logit and sigmoid computed in the program too
        picks = moe_routing.TokenRouting(logits, 10, True, real, shared_gate=gate)
        options = {"shared": shared, "routing": picks, "route_in_up": route_in_up}
        return run(x, None, None, *rest[:-1], **options, **fold)

    # three tokens: padded to a power of two; 64 experts: top-k by rank, 512: by rounds
    for num_tokens, num_experts in ((1, 64), (2, 512), (3, 512), (8, 512), (8, 64)):
        stacks = (
            spec((num_experts, 2048, 512), jnp.bfloat16),
            spec((num_experts, 512, 2048), jnp.bfloat16),
            spec((num_experts, 2048, 512), jnp.bfloat16),
        )
        pair_grid = {"down_in_up": True, "pair_grid": True}  # the folded launch alone
        for route_in_up, launches, fold in ((False, 3, {}), (True, 2, {}), (True, 1, pair_grid)):
            text = lower_for_cuda(
                functools.partial(by_logits, route_in_up=route_in_up, **fold),
                spec((num_tokens, 2048), jnp.bfloat16),
                spec((num_tokens, num_experts), jnp.float32),
                spec((num_tokens,), jnp.bool_),
                spec((2048,), jnp.bfloat16),
                *stacks,
                dataclasses.replace(shared, weight=spec((num_tokens,), jnp.float32)),
            )
            found = text.lower().count("triton")
            assert found >= launches, (num_tokens, num_experts, route_in_up, fold, found)
    # the down product in the up launch at the tuning's tiles and the wider ones a sweep
    # takes (MoETuning.fold_block_inner, fold_block_out)
    for block_inner, block_out in ((64, 256), (128, 128), (128, 256)):
        folded = {"down_in_up": True, "block_inner": block_inner, "block_out": block_out}
        text = lower_for_cuda(lambda *a, f=folded: run(*a, **f), *two_tokens)
        assert text.lower().count("triton") == 1, (block_inner, block_out)
    relu2 = (spec((128, 1024, 1856), jnp.bfloat16), spec((128, 1856, 1024), jnp.bfloat16))
    text = lower_for_cuda(
        lambda *a: run(*a, block_inner=64, block_k=64),
        spec((16, 1024), jnp.bfloat16),
        *routed,
        *relu2,
    )
    assert "triton" in text.lower()
    with pytest.raises(Exception, match="power of 2|power-of-2|power of two"):
        lower_for_cuda(
            lambda *a: run(*a, block_rows=12),
            spec((16, 2048), jnp.bfloat16),
            *routed,
            stack,
            spec((512, 512, 2048), jnp.bfloat16),
            stack,
        )


def test_moe_runner_picks_the_routed_experts_form_pallas():
    """auto: the kernel on GPUs and in interpret mode (CPU), not on TPUs; pallas:
    everywhere; xla: nowhere."""
    assert backend.kernels_for("pallas", "cpu").moe_experts is not None
    assert backend.kernels_for("pallas", "gpu").moe_experts is not None
    assert backend.kernels_for("pallas", "tpu").moe_experts is None
    assert backend.kernels_for("pallas", "gpu", moe_runner="pallas").moe_experts is not None
    assert backend.kernels_for("pallas", "cpu", moe_runner="xla").moe_experts is None
    # the choice is part of the record's identity (the jitted steps key on it)
    assert backend.kernels_for("pallas", "cpu") != backend.kernels_for(
        "pallas", "cpu", moe_runner="xla"
    )


def test_both_grouping_forms_give_the_same_tiles_pallas():
    """The pairwise-comparison grouping (few pairs) and the cumulative-sum one (many) give
    the same tiles, rows, tokens and weights, with pairs of other shards dropped."""
    rng = np.random.default_rng(16)
    for num_tokens, top_k, num_experts, skewed in ((1, 4, 16, False), (7, 3, 8, True)):
        weights, ids = routing(rng, num_tokens, top_k, num_experts, skewed)
        for shift in (0, num_experts // 2):  # the second: half the pairs another shard's
            local = ids - shift
            mine = int(jnp.sum(local >= 0))
            assert 0 < mine <= local.size and (shift == 0) == (mine == local.size)
            forms = [
                group_pairs(weights, local, num_experts - shift, 4, compare=c)
                for c in (True, False)
            ]
            for got, want in zip(jax.tree.leaves(forms[0]), jax.tree.leaves(forms[1])):
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_token_rows_grouping_gives_each_routed_expert_one_tile_pallas():
    """``group_tokens``: each expert some local pair routes to names exactly one tile, the
    tile of its first pair; a pair's row is its token's row of that tile and carries its
    weight; every other row weighs 0; pairs of another shard take no row."""
    rng = np.random.default_rng(17)
    block_rows = 8
    for num_tokens, top_k, num_experts, skewed, shift in (
        (1, 4, 16, False, 0),
        (5, 3, 8, True, 0),
        (8, 2, 8, False, 4),  # half the experts another shard's
    ):
        weights, ids = routing(rng, num_tokens, top_k, num_experts, skewed)
        local = np.asarray(ids) - shift
        mine = (local >= 0) & (local < num_experts - shift)
        tiles = group_tokens(weights, jnp.asarray(local), num_experts - shift, block_rows)
        tile_expert = np.asarray(tiles.tile_expert)
        assert tile_expert.shape == (num_tokens * top_k,)
        used = tile_expert[tile_expert != moe_grouping.UNUSED_TILE]
        assert sorted(used) == sorted(set(local[mine].tolist()))  # one tile per expert
        rows = np.asarray(tiles.pair_row)
        num_rows = tile_expert.size * block_rows
        assert (rows[~mine] == num_rows).all()
        tokens = np.broadcast_to(np.arange(num_tokens)[:, None], rows.shape)
        np.testing.assert_array_equal(rows[mine] % block_rows, tokens[mine])
        np.testing.assert_array_equal(tile_expert[rows[mine] // block_rows], local[mine])
        row_weight = np.asarray(tiles.row_weight)
        np.testing.assert_array_equal(row_weight[rows[mine]], np.asarray(weights)[mine])
        others = np.setdiff1d(np.arange(num_rows), rows[mine])
        assert (row_weight[others] == 0.0).all()
        row_token = np.asarray(tiles.row_token).reshape(-1, block_rows)
        np.testing.assert_array_equal(
            row_token[rows[mine] // block_rows, tokens[mine]], tokens[mine]
        )


@pytest.mark.parametrize("gated", (True, False))
def test_token_rows_and_staged_rows_give_the_same_experts_pallas(gated):
    """The kernel with ``group_tokens`` (x read whole by every tile) and with ``group_pairs``
    (staged rows) agree with ``grouped_experts``: one token, a padding token routed like
    token 0 (the one-request decode step), eight tokens, and a shard's block of experts."""
    rng = np.random.default_rng(18)
    num_experts = 8
    up, down, gate = expert_stacks(rng, num_experts, jnp.float32, gated)
    kernel = jax.jit(
        lambda *a, token_rows: me.moe_experts_pallas(
            *a, block_rows=dot_tile(8), token_rows=token_rows, interpret=INTERPRET
        ),
        static_argnames="token_rows",
    )
    for num_tokens, top_k, shift in ((1, 3, 0), (2, 3, 0), (8, 2, 0), (6, 3, 4)):
        weights, ids = routing(rng, num_tokens, top_k, num_experts, False)
        if num_tokens == 2:
            ids = ids.at[1].set(ids[0])  # padding follows token 0
        x = jnp.asarray(rng.standard_normal((num_tokens, WIDTH)), jnp.float32)
        local = ids - shift
        mine = (local >= 0) & (local < num_experts - shift)
        stacks = [a[shift:] if a is not None else None for a in (up, down, gate)]
        want = reference(x, jnp.where(mine, weights, 0.0), ids, up, down, gate)
        for token_rows in (True, False):
            got = kernel(x, weights, local, *stacks, token_rows=token_rows)
            assert_close(got, want, FP32_TOL, f"n={num_tokens} token_rows={token_rows}")


def test_token_rows_read_the_tokens_as_they_are_pallas():
    """Grouped by token rows, the up launch reads x itself, unpadded and in its own dtype
    (rows past the tokens read as zeros, x rounded to the weights' dtype in the launch): no
    pad or cast of x runs before it, and the output equals the staged rows' form, which
    rounds and gathers x first, bit for bit."""
    rng = np.random.default_rng(19)
    up, down, gate = expert_stacks(rng, 8, jnp.bfloat16, True)
    weights, ids = routing(rng, 3, 2, 8, False)
    x = jnp.asarray(rng.standard_normal((3, WIDTH)), jnp.float32)

    def run(x, token_rows):
        return me.moe_experts_pallas(
            x,
            weights,
            ids,
            up,
            down,
            gate,
            block_rows=dot_tile(8),
            token_rows=token_rows,
            interpret=INTERPRET,
        )

    jaxpr = jax.make_jaxpr(lambda x: run(x, True))(x).jaxpr
    launches = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    first = launches[0]
    assert launch_names([first]) == ["moe_experts_up"]
    assert first.invars[1] is jaxpr.invars[0]  # x itself, [3, d] float32: no pad, no cast
    np.testing.assert_array_equal(np.asarray(run(x, True)), np.asarray(run(x, False)))


# seed, tokens, top_k, experts, norm_topk_prob, shared, real (None: all): ties in every
# case, powers of two and not, the padding rule, both weight rules
ROUTE_CASES = [
    (31, 1, 2, 8, True, False, None),
    (32, 2, 10, 64, True, True, (1, 0)),
    (33, 3, 2, 8, False, True, (1, 1, 0)),
    (34, 8, 4, 16, True, False, (1, 1, 1, 0, 1, 1, 1, 0)),
    (35, 5, 3, 12, False, False, None),
]


@pytest.mark.parametrize("top_k_form", ("rank", "rounds"))
@pytest.mark.parametrize("case", ROUTE_CASES, ids=lambda c: f"route{c[0]}-n{c[1]}-e{c[3]}")
def test_route_tokens_picks_the_routers_experts_pallas(case, top_k_form, monkeypatch):
    """``route_tokens`` gives each token the experts and weights of ``layers.moe.route``
    (top-k, lower id first among equal logits; both weight rules; both top-k forms),
    padding tokens token 0's experts with their own weights, the shared expert last; one
    tile per expert (``expert_picks`` refuses two), every other row weighing 0; and the
    kernel with it sums as with the router's own picks, with the routing in a launch of its
    own or in the up launch, bit for bit the same. The shared gate computed in the program
    gives the same picks, its weights within bf16's tolerance (the logit is rounded to bf16
    after a sum in the program's order)."""
    monkeypatch.setattr(moe_routing, "RANK_MAX_ELEMENTS", 16384 if top_k_form == "rank" else 0)
    seed, num_tokens, top_k, num_experts, norm, with_shared, real = case
    assert num_tokens * num_experts**2 <= moe_routing.RANK_MAX_ELEMENTS or top_k_form == "rounds"
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((num_tokens, num_experts)).astype(np.float32)
    logits[:, 1] = logits[:, 4]  # a tie
    logits[0, 5] = logits[0, 4]
    logits = jnp.asarray(logits)
    real = None if real is None else jnp.asarray(real, bool)
    # the shared gate as Qwen3-Next's layer computes it: a bf16 linear, then the sigmoid
    gate_width = 24  # not a power of two: padded with zero columns for Triton
    tokens = jnp.asarray(rng.standard_normal((num_tokens, gate_width)), jnp.bfloat16)
    shared_gate = jnp.asarray(rng.standard_normal(gate_width) * 0.3, jnp.bfloat16)
    gate_logit = linear({"weight": shared_gate[:, None]}, tokens)[:, 0].astype(jnp.float32)
    shared_weight = jax.nn.sigmoid(gate_logit) if with_shared else None
    block_rows = 16
    routing = moe_routing.TokenRouting(logits, top_k, norm, real)
    tiles = route_tokens(routing, shared_weight, block_rows, interpret=INTERPRET)
    if with_shared:  # the gate's logit and sigmoid computed in the program: the same tables
        by_gate = dataclasses.replace(routing, shared_gate=shared_gate)
        unused = jnp.zeros(num_tokens)
        also = route_tokens(by_gate, unused, block_rows, interpret=INTERPRET, x=tokens)
        for got, want in zip(jax.tree.leaves(also), jax.tree.leaves(tiles)):
            if jnp.issubdtype(want.dtype, jnp.integer):  # the picks: the same
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
            else:  # both round the gate's logit to bf16, its sum in their own orders
                assert_close(got, want, tolerance(jnp.bfloat16, gate_width), "shared weights")
    spec = moe.MoESpec(WIDTH, num_experts, top_k, INNER, INNER, norm)
    weights, ids = moe.route({}, spec, None, logits)
    ids = moe.padding_follows_token_zero(ids, real)
    shared = None if shared_weight is None else (num_experts, shared_weight)
    got = expert_picks(tiles, block_rows)
    assert len(got) == num_tokens
    differ = picks_differ(got, router_picks(weights, ids, shared), 1e-6)
    assert not differ, differ
    tile_expert = np.asarray(tiles.tile_expert)
    rows = np.asarray(tiles.pair_row)
    rows = rows[rows < tile_expert.size * block_rows]
    others = np.setdiff1d(np.arange(tile_expert.size * block_rows), rows)
    assert (np.asarray(tiles.row_weight)[others] == 0.0).all()
    # the kernel routed by the logits sums as with the router's picks
    up, down, gate = expert_stacks(rng, num_experts, jnp.float32, True)
    x = jnp.asarray(rng.standard_normal((num_tokens, WIDTH)), jnp.float32)
    extra = {}
    if with_shared:
        s_up, s_down, s_gate = expert_stacks(rng, 1, jnp.float32, True)
        extra["shared"] = moe_plan.SharedExpert(s_up[0], s_down[0], s_gate[0], shared_weight)
    tile_args = dict(SMALL_TILES)
    want = moe_experts_pallas(x, weights, ids, up, down, gate, **extra, **tile_args)
    extra["routing"] = routing
    got = moe_experts_pallas(x, None, None, up, down, gate, **extra, **tile_args)
    assert_close(got, want, FP32_TOL, "routed by logits")
    in_up = moe_experts_pallas(
        x, None, None, up, down, gate, **extra, **tile_args, route_in_up=True
    )
    np.testing.assert_array_equal(np.asarray(in_up), np.asarray(got))


@pytest.mark.parametrize("max_tokens", (0, 2, 3))
def test_routing_in_the_up_launch_saves_a_launch_pallas(max_tokens):
    """Routed by logits with ``route_in_up``, the MoE is two launches (up, which writes the
    routing tables too, and down) where the routing's own launch makes three; the dispatch
    asks for it up to the tuning's ``route_in_up_max_tokens`` tokens, and the tables it
    hands on give the same sum as the separate launch's."""
    tuning = Tuning().with_overrides({"moe.route_in_up_max_tokens": max_tokens})
    rng = np.random.default_rng(41)
    up, down, gate = expert_stacks(rng, 16, jnp.float32, True)
    logits = jnp.asarray(rng.standard_normal((3, 16)), jnp.float32)
    routing = moe_routing.TokenRouting(logits, 4, True, jnp.asarray([True, True, False]))
    x = jnp.asarray(rng.standard_normal((3, WIDTH)), jnp.float32)
    tile_args = dict(SMALL_TILES)

    def launches(route_in_up):
        run = functools.partial(
            me.moe_experts_pallas, routing=routing, route_in_up=route_in_up, **tile_args
        )
        jaxpr = jax.make_jaxpr(lambda x: run(x, None, None, up, down, gate))(x).jaxpr
        names = launch_names(jaxpr.eqns)
        return names, as_one_program(run)(x, None, None, up, down, gate)

    names, separate = launches(False)
    assert names == ["moe_route", "moe_experts_up", "moe_experts_down"], names
    names, fused = launches(True)
    assert names == ["moe_experts_up", "moe_experts_down"], names
    np.testing.assert_array_equal(np.asarray(fused), np.asarray(separate))
    for tokens in (2, 3):
        launch = moe_dispatch.moe_launch(tokens, up, down, interpret=INTERPRET, tuning=tuning)
        assert launch["route_in_up"] is (tokens <= max_tokens)


# seed, tokens, top_k, experts, gated, dtype, shared, by logits
DOWN_IN_UP_CASES = [
    (51, 1, 2, 8, True, jnp.float32, True, True),
    (52, 2, 3, 8, False, jnp.float32, False, False),
    (53, 3, 2, 16, True, jnp.bfloat16, True, False),
    (54, 8, 4, 16, True, jnp.float32, True, True),
]


@pytest.mark.parametrize("case", DOWN_IN_UP_CASES, ids=lambda c: f"s{c[0]}-n{c[1]}")
def test_down_product_in_the_up_launch_pallas(case):
    """With ``down_in_up`` the MoE is one launch (routed by logits in it, or by given picks
    after a grouping), each program writing its partial sums; summed, they give
    ``grouped_experts``' output (the two-launch form's to float32 rounding). The rows
    past the tokens are never summed, nor the rows of tiles no expert uses (masked):
    interpret mode fills unwritten rows with NaN."""
    seed, num_tokens, top_k, num_experts, gated, dtype, with_shared, by_logits = case
    rng = np.random.default_rng(seed)
    up, down, gate = expert_stacks(rng, num_experts, dtype, gated)
    x = jnp.asarray(rng.standard_normal((num_tokens, WIDTH)), jnp.float32)
    logits = jnp.asarray(rng.standard_normal((num_tokens, num_experts)), jnp.float32)
    spec = moe.MoESpec(WIDTH, num_experts, top_k, INNER, INNER, True)
    weights, ids = moe.route({}, spec, None, logits)
    extra = dict(SMALL_TILES)
    ref_weights, ref_ids = weights, ids
    if with_shared:
        s_up, s_down, s_gate = expert_stacks(rng, 1, dtype, gated)
        s_weight = jnp.asarray(rng.random(num_tokens), jnp.float32)
        extra["shared"] = moe_plan.SharedExpert(
            s_up[0], s_down[0], None if not gated else s_gate[0], s_weight
        )
        up_all = jnp.concatenate([up, s_up])
        down_all = jnp.concatenate([down, s_down])
        gate_all = None if gate is None else jnp.concatenate([gate, s_gate])
        every = jnp.full((num_tokens, 1), num_experts, jnp.int32)
        ref_ids = jnp.concatenate([ids, every], axis=1)
        ref_weights = jnp.concatenate([weights, s_weight[:, None]], axis=1)
    else:
        up_all, down_all, gate_all = up, down, gate
    want = reference(x, ref_weights, ref_ids, up_all, down_all, gate_all)
    if by_logits:
        extra.update(routing=moe_routing.TokenRouting(logits, top_k, True), route_in_up=True)
    run = functools.partial(me.moe_experts_pallas, **extra)
    one = as_one_program(run)
    tol = FP32_TOL if dtype == jnp.float32 else BF16_TOL
    fused = one(x, weights, ids, up, down, gate, down_in_up=True)
    assert_close(fused, want, tol, "down product in the up launch")
    two = one(x, weights, ids, up, down, gate)
    np.testing.assert_allclose(np.asarray(fused), np.asarray(two), rtol=0, atol=1e-5)
    if by_logits:  # a program per token's pair: the same partials, fewer of them
        pairs = top_k + with_shared
        options = {"down_in_up": True, "pair_grid": True}
        by_pair = one(x, weights, ids, up, down, gate, **options)
        np.testing.assert_allclose(np.asarray(by_pair), np.asarray(fused), rtol=0, atol=1e-6)
        jaxpr = jax.make_jaxpr(lambda x, o=options: run(x, weights, ids, up, down, gate, **o))
        (call,) = [e for e in jaxpr(x).jaxpr.eqns if e.primitive.name == "pallas_call"]
        tokens = 1 << (num_tokens - 1).bit_length()
        blocks = INNER // SMALL_TILES["block_inner"]
        assert call.params["grid_mapping"].grid == (blocks, tokens * pairs)
    jaxpr = jax.make_jaxpr(lambda x: run(x, weights, ids, up, down, gate, down_in_up=True))(x)
    names = launch_names(jaxpr.jaxpr.eqns)
    assert names == ["moe_experts_up"], names


def test_route_tokens_checks_its_inputs_pallas():
    x = jnp.zeros((2, WIDTH))
    up, down, gate = expert_stacks(np.random.default_rng(36), 8, jnp.float32, True)
    wrong = moe_routing.TokenRouting(jnp.zeros((2, 7)), 2, True)
    with pytest.raises(ValueError, match="routing logits"):
        moe_experts_pallas(x, None, None, up, down, gate, routing=wrong, interpret=INTERPRET)
    wrong = moe_routing.TokenRouting(jnp.zeros((2, 8)), 2, True, shared_gate=jnp.zeros(WIDTH + 1))
    with pytest.raises(ValueError, match="routing shared_gate"):
        moe_experts_pallas(x, None, None, up, down, gate, routing=wrong, interpret=INTERPRET)
    by_gate = moe_routing.TokenRouting(jnp.zeros((2, 8)), 2, True, shared_gate=jnp.zeros(WIDTH))
    with pytest.raises(ValueError, match="for the shared gate"):
        route_tokens(by_gate, jnp.zeros(2), 16, interpret=INTERPRET)  # no x
    with pytest.raises(ValueError, match="top_k"):
        route_tokens(
            moe_routing.TokenRouting(jnp.zeros((2, 8)), 9, True), None, 16, interpret=INTERPRET
        )
    with pytest.raises(ValueError, match="at most block_rows"):
        route_tokens(
            moe_routing.TokenRouting(jnp.zeros((9, 8)), 2, True), None, 8, interpret=INTERPRET
        )
