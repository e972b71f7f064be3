"""Masked commit / checkpoint copy (Pallas in interpret mode and XLA) against a numpy model."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.kernels import common
from lazyspec.kernels.state import dispatch as state_dispatch
from lazyspec.kernels.state import scatter as ss
from lazyspec.kernels.tuning import Tuning
from tests.kernels.kernel_checks import (
    INTERPRET,
    launch_compiled,
    launch_names,
    pallas_or_dispatch,
)

pytestmark = pytest.mark.pallas


def scatter_case(
    rng, layers, slots, scratch_rows, rows, tokens, heads, d_a, d_b, channels, kernel, conv_dtype
):
    """Random pools and scratch; rows with distinct slots, some masked by step = -1 and some
    by dst_slot = 0 (with a valid step), at least one of each."""
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    pools = (
        normal(layers, slots + 1, heads, d_a, d_b),
        normal(layers, slots + 1, channels, kernel - 1).astype(conv_dtype),
    )
    steps = (
        normal(layers, scratch_rows, tokens, heads, d_a, d_b),
        normal(layers, scratch_rows, tokens, channels, kernel - 1).astype(conv_dtype),
    )
    dst = rng.choice(np.arange(1, slots + 1), size=rows, replace=False).astype(np.int32)
    step = rng.integers(0, tokens, size=rows).astype(np.int32)
    masked = rng.permutation(rows)[:2]
    step[masked[0]] = -1
    dst[masked[1]] = 0
    return pools, steps, jnp.asarray(dst), jnp.asarray(step)


def expected_pools(pools, steps, dst, step):
    out = [np.array(p.astype(jnp.float32)) for p in pools]
    for row, (d, t) in enumerate(zip(np.asarray(dst), np.asarray(step))):
        if t >= 0 and d != 0:
            for pool, src in zip(out, steps):
                pool[:, d] = np.asarray(src[:, row, t].astype(jnp.float32))
    return out


def check(got, pools, expected, dst, step):
    written = np.asarray(dst)[(np.asarray(step) >= 0) & (np.asarray(dst) != 0)]
    untouched = np.setdiff1d(np.arange(pools[0].shape[1]), written)
    assert 0 in untouched and len(untouched) > 1 and len(written) > 0
    for new, old, want in zip(got, pools, expected):
        assert new.shape == old.shape and new.dtype == old.dtype
        new = np.asarray(new.astype(jnp.float32))
        # copies are exact; every slot is compared, written or not
        np.testing.assert_array_equal(new, want)
        np.testing.assert_array_equal(
            new[:, untouched], np.asarray(old.astype(jnp.float32))[:, untouched]
        )


CASES = [  # seed, L, slots, scratch rows, rows, T, H, d_a, d_b, C, K, conv dtype, tiles
    (1, 2, 7, 6, 5, 3, 3, 4, 8, 12, 4, jnp.bfloat16, (1, 2, 4)),
    (2, 3, 9, 4, 4, 1, 5, 8, 4, 10, 4, jnp.float32, (5, None, None)),
    (3, 1, 12, 9, 7, 4, 2, 4, 4, 6, 3, jnp.float32, (1, 4, 3)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"scatter{c[0]}")
def test_state_scatter_pallas_and_xla_match_numpy(case):
    seed, *shape, conv_dtype, (bh, br, bc) = case
    rng = np.random.default_rng(seed)
    pools, steps, dst, step = scatter_case(rng, *shape, conv_dtype)
    expected = expected_pools(pools, steps, dst, step)
    blocks = ss.PoolBlocks(block_heads=bh, block_rows=br, block_channels=bc)
    # compiled, tiles Triton cannot lower are refused and the dispatch runs the XLA form
    pallas = pallas_or_dispatch(
        ss.pool_tiles_triton_error("state_scatter_pallas", *pools, blocks),
        functools.partial(ss.state_scatter_pallas, blocks=blocks, interpret=INTERPRET),
        functools.partial(
            state_dispatch.state_scatter,
            kernel_backend="pallas",
            interpret=INTERPRET,
            **dataclasses.asdict(blocks),
        ),
    )
    got = pallas(*pools, *steps, dst, step)
    check(got, pools, expected, dst, step)
    got = jax.jit(ss.state_scatter_xla)(*pools, *steps, dst, step)
    check(got, pools, expected, dst, step)


def test_state_scatter_donated_under_jit_pallas():
    """The engine calls it inside a jitted step with the pools donated (aliased in place)."""
    rng = np.random.default_rng(4)
    pools, steps, dst, step = scatter_case(rng, 2, 6, 5, 5, 2, 2, 4, 4, 8, 4, jnp.float32)
    expected = expected_pools(pools, steps, dst, step)
    originals = [jnp.array(p, copy=True) for p in pools]
    commit = jax.jit(
        lambda s, c, *rest: state_dispatch.state_scatter(
            s, c, *rest, kernel_backend="pallas", block_channels=4, interpret=INTERPRET
        ),
        donate_argnums=(0, 1),
    )
    got = commit(*pools, *steps, dst, step)
    check(got, originals, expected, dst, step)


@pytest.mark.parametrize("layer", [0, 2])
def test_state_scatter_one_layer_pallas(layer):
    """``layer=l`` with that layer's scratch writes pool layer l exactly as the all-layer call
    does and leaves every other layer bit-identical; chained over the layers (as the engine
    commits) it equals the all-layer call. Both backends."""
    rng = np.random.default_rng(6 + layer)
    pools, steps, dst, step = scatter_case(rng, 3, 8, 5, 4, 3, 2, 4, 8, 8, 4, jnp.bfloat16)
    expected = expected_pools(pools, steps, dst, step)

    def pallas(*args, **kwargs):
        return ss.state_scatter_pallas(
            *args, blocks=ss.PoolBlocks(block_channels=4), interpret=INTERPRET, **kwargs
        )

    for name, fn in (("pallas", pallas), ("xla", ss.state_scatter_xla)):
        got = fn(*pools, steps[0][layer], steps[1][layer], dst, step, layer=layer)
        for new, old, want in zip(got, pools, expected):
            new, old = (np.asarray(a.astype(jnp.float32)) for a in (new, old))
            np.testing.assert_array_equal(new[layer], want[layer], err_msg=name)
            others = [i for i in range(old.shape[0]) if i != layer]
            np.testing.assert_array_equal(new[others], old[others], err_msg=name)
        chained = pools
        for i in range(3):
            chained = fn(*chained, steps[0][i], steps[1][i], dst, step, layer=i)
        check(chained, pools, expected, dst, step)
    with pytest.raises(ValueError, match="layer=3"):
        ss.state_scatter_xla(*pools, steps[0][0], steps[1][0], dst, step, layer=3)
    with pytest.raises(ValueError, match="does not match"):  # all-layer scratch, one layer
        ss.state_scatter_xla(*pools, *steps, dst, step, layer=0)


def test_pool_tiles_triton_error_names_the_dims_that_are_not_powers_of_two_pallas(monkeypatch):
    """``pool_tiles_triton_error`` passes power-of-two tiles of a state whose last axis is a
    power of two and names every dim that is not (the whole axis a None tile stands for
    included); the scatter and the copy refuse such tiles compiled, before tracing; the
    dispatches, compiled, launch at power-of-two tiles and take the XLA form (no launch)
    at the others."""
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    ssm, conv = spec(2, 5, 6, 8, 16), spec(2, 5, 12, 3)
    error = functools.partial(ss.pool_tiles_triton_error, "scatter", ssm, conv)
    assert error(ss.PoolBlocks(2, 4, 4)) is None and error(ss.PoolBlocks(1, 8, 4)) is None
    assert "block_heads=3, block_channels=12 are not" in error(ss.PoolBlocks(3, 8, None))
    wide = ss.pool_tiles_triton_error("copy", spec(2, 5, 6, 8, 12), conv, ss.PoolBlocks(1, 8, 4))
    assert "copy" in wide and "d_b=12 is not" in wide
    with pytest.raises(ValueError, match="block_rows=3"):
        error(ss.PoolBlocks(1, 3, 4))
    rng = np.random.default_rng(10)
    pools, steps, dst, step = scatter_case(rng, 2, 6, 4, 4, 2, 3, 4, 8, 8, 4, jnp.float32)
    src = jnp.asarray([0, 6, 5, 0], jnp.int32)
    blocks = ss.PoolBlocks(block_heads=3)
    refused = re.escape(ss.pool_tiles_triton_error("state_scatter_pallas", *pools, blocks))
    with pytest.raises(ValueError, match=refused):
        ss.state_scatter_pallas(*pools, *steps, dst, step, blocks=blocks, interpret=False)
    with pytest.raises(ValueError, match="state_copy_pallas.*block_heads=3 is not"):
        ss.state_copy_pallas(*pools, src, dst, blocks=blocks, interpret=False)
    launch_compiled(monkeypatch, state_dispatch)
    for block_heads, launches in ((1, 1), (3, 0)):
        tiles = {"kernel_backend": "pallas", "block_heads": block_heads}
        runs = (
            functools.partial(state_dispatch.state_scatter, **tiles),
            functools.partial(state_dispatch.state_copy, **tiles),
        )
        for run, args in zip(runs, ((*pools, *steps, dst, step), (*pools, src, dst))):
            jaxpr = jax.make_jaxpr(run)(*args)
            assert len(launch_names(jaxpr.eqns)) == launches, block_heads


def test_state_scatter_bad_arguments_pallas():
    rng = np.random.default_rng(5)
    pools, steps, dst, step = scatter_case(rng, 2, 6, 4, 4, 2, 2, 4, 4, 8, 4, jnp.float32)
    with pytest.raises(ValueError, match="block_rows=3"):
        ss.state_scatter_pallas(*pools, *steps, dst, step, blocks=ss.PoolBlocks(block_rows=3))
    with pytest.raises(ValueError, match="ssm_steps"):
        ss.state_scatter_xla(pools[0], pools[1], steps[0][:, :, :, :1], steps[1], dst, step)
    with pytest.raises(ValueError, match="B <= 4"):
        ss.state_scatter_xla(*pools, *steps, jnp.zeros(6, jnp.int32), jnp.zeros(6, jnp.int32))
    with pytest.raises(ValueError, match="kernel_backend"):
        state_dispatch.state_scatter(*pools, *steps, dst, step, kernel_backend="cuda")


def test_state_scatter_lowers_to_triton_at_model_shapes_pallas():
    """Nemotron-H-sized pools (128 x 64 x 128 fp32 state, 10240 x 3 bf16 conv) lower through
    Pallas-Triton with the benchmark's tiles; Triton IR is built here, not compiled."""
    spec = jax.ShapeDtypeStruct
    layers, slots, rows, tokens, channels = 4, 9, 4, 4, 10240
    args = (
        spec((layers, slots, 128, 64, 128), jnp.float32),
        spec((layers, slots, channels, 3), jnp.bfloat16),
        spec((layers, rows, tokens, 128, 64, 128), jnp.float32),
        spec((layers, rows, tokens, channels, 3), jnp.bfloat16),
        spec((rows,), jnp.int32),
        spec((rows,), jnp.int32),
    )
    lowered = jax.jit(
        lambda *a: ss.state_scatter_pallas(
            *a,
            blocks=ss.PoolBlocks(block_rows=32, block_channels=1024),
            compiler_params=common.pallas_compiler_params("gpu"),
        )
    ).trace(*args)
    assert "triton" in lowered.lower(lowering_platforms=("cuda",)).as_text().lower()


def copy_case(rng, layers, slots, rows, heads, d_a, d_b, channels, kernel, conv_dtype):
    """Random pools; rows with distinct source and destination slots (no destination is a
    source), one row masked by dst_slot = 0 and one padding row reading the null slot."""
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    pools = (
        normal(layers, slots + 1, heads, d_a, d_b),
        normal(layers, slots + 1, channels, kernel - 1).astype(conv_dtype),
    )
    ids = rng.permutation(np.arange(1, slots + 1))
    src, dst = ids[:rows].astype(np.int32), ids[rows : 2 * rows].astype(np.int32)
    src[0], dst[0] = 0, 0  # padding
    dst[1] = 0  # masked (after the padding row: a scatter keeps the last of equal indices)
    return pools, jnp.asarray(src), jnp.asarray(dst)


COPY_CASES = [  # seed, L, slots, rows, H, d_a, d_b, C, K, conv dtype, tiles
    (1, 2, 9, 4, 3, 4, 8, 12, 4, jnp.bfloat16, (1, 2, 4)),
    (2, 3, 12, 5, 5, 8, 4, 10, 4, jnp.float32, (5, None, None)),
]


@pytest.mark.parametrize("case", COPY_CASES, ids=lambda c: f"copy{c[0]}")
def test_state_copy_pallas_and_xla_match_numpy(case):
    """``pool[l, dst[b]] = pool[l, src[b]]`` for rows with a real destination, exactly; every
    other slot (the null slot among them) bit-identical. Both backends, the Pallas one
    with the pools donated under jit."""
    seed, *shape, conv_dtype, (bh, br, bc) = case
    rng = np.random.default_rng(seed)
    pools, src, dst = copy_case(rng, *shape, conv_dtype)
    expected = [np.array(p.astype(jnp.float32)) for p in pools]
    for s, d in zip(np.asarray(src), np.asarray(dst)):
        if d != 0:
            for want in expected:
                want[:, d] = want[:, s]
    written = np.asarray(dst)[np.asarray(dst) != 0]
    untouched = np.setdiff1d(np.arange(pools[0].shape[1]), written)
    assert 0 in untouched and len(written) >= 2
    originals = [np.asarray(p.astype(jnp.float32)) for p in pools]

    blocks = ss.PoolBlocks(block_heads=bh, block_rows=br, block_channels=bc)

    def direct(s, c, src, dst, tiles_per_program=1):
        return ss.state_copy_pallas(
            s, c, src, dst, blocks=blocks, tiles_per_program=tiles_per_program,
            interpret=INTERPRET,
        )  # fmt: skip

    def dispatched(s, c, src, dst, tiles_per_program=1):  # the tuning's tiles a program
        return state_dispatch.state_copy(
            s, c, src, dst, kernel_backend="pallas", interpret=INTERPRET,
            **dataclasses.asdict(blocks),
        )  # fmt: skip

    # compiled, tiles Triton cannot lower are refused and the dispatch runs the XLA form
    error = ss.pool_tiles_triton_error("state_copy_pallas", *pools, blocks)
    pallas = pallas_or_dispatch(error, direct, dispatched)

    # tile groups of one tile, of four (the last one short) and of more than a row has
    grouped = [
        (f"pallas, {n} tiles a program", functools.partial(pallas, tiles_per_program=n))
        for n in (1, 4, 64)
    ]
    for name, fn in (*grouped, ("xla", ss.state_copy_xla)):
        copies = [jnp.array(p, copy=True) for p in pools]
        got = jax.jit(fn, donate_argnums=(0, 1))(*copies, src, dst)
        for new, old, want in zip(got, originals, expected):
            new = np.asarray(new.astype(jnp.float32))
            np.testing.assert_array_equal(new, want, err_msg=name)
            np.testing.assert_array_equal(new[:, untouched], old[:, untouched], err_msg=name)
    none = jnp.zeros_like(dst)  # no row copies: the pools come back unchanged
    for fn in (pallas, ss.state_copy_xla, state_dispatch.state_copy):
        for new, old in zip(fn(*pools, src, none), originals):
            np.testing.assert_array_equal(np.asarray(new.astype(jnp.float32)), old)
    with pytest.raises(ValueError, match="src_slot"):
        ss.state_copy_xla(*pools, src[:2], dst)
    with pytest.raises(ValueError, match="tiles_per_program=0"):
        direct(*pools, src, dst, tiles_per_program=0)


def test_state_copy_lowers_to_triton_at_model_shapes_pallas():
    """Qwen3-Next-sized pools (6 layers of 32 x 128 x 128 fp32 state, 8192 x 3 bf16 conv)
    with the dispatch's tiles and tile groups lower through Pallas-Triton (IR built, not
    compiled)."""
    spec = jax.ShapeDtypeStruct
    args = (
        spec((6, 9, 32, 128, 128), jnp.float32),
        spec((6, 9, 8192, 3), jnp.bfloat16),
        spec((4,), jnp.int32),
        spec((4,), jnp.int32),
    )
    lowered = jax.jit(
        lambda *a: ss.state_copy_pallas(
            *a,
            blocks=ss.PoolBlocks(
                block_rows=Tuning().state.scatter_block_rows,
                block_channels=Tuning().state.scatter_block_channels,
            ),
            tiles_per_program=Tuning().state.copy_tiles_per_program,
            compiler_params=common.pallas_compiler_params("gpu"),
        )
    ).trace(*args)
    assert "triton" in lowered.lower(lowering_platforms=("cuda",)).as_text().lower()
