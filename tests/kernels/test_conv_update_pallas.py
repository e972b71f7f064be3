"""Conv-update kernels (Pallas in interpret mode and XLA) against ``cu.conv_scan``."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.kernels import common
from lazyspec.kernels.state import conv as cu
from lazyspec.kernels.state import dispatch as state_dispatch
from tests.kernels.kernel_checks import (
    INTERPRET,
    assert_close,
    draw_slots,
    launch_compiled,
    launch_names,
    pallas_or_dispatch,
    tolerance,
)

pytestmark = pytest.mark.pallas

FP32_TOL = tolerance(jnp.float32, reduction_length=4)  # the conv's window
# bf16 x and windows are upcast exactly; a bf16 output is the float32 result rounded once:
# half a bf16 ulp, at most 2**-8 of the value, apart.
BF16_OUT_TOL = tolerance(jnp.bfloat16, reduction_length=4)


def conv_case(rng, batch, tokens, channels, kernel, num_slots, pool_dtype, x_dtype, with_bias):
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    pool = jnp.asarray(normal(num_slots + 1, channels, kernel - 1)).astype(pool_dtype)
    x = jnp.asarray(normal(batch, tokens, channels)).astype(x_dtype)
    weight = jnp.asarray(normal(channels, kernel) * 0.5)
    bias = jnp.asarray(normal(channels)) if with_bias else None
    return pool, jnp.asarray(draw_slots(rng, batch, num_slots)), x, weight, bias


def reference(pool, slot, x, weight, bias):
    """Per-row ``conv_scan`` from pool[slot]; the expected pool written with numpy."""
    scan = lambda w0, xs: cu.conv_scan(w0, xs, weight, bias)  # noqa: E731
    outs, final, windows = jax.vmap(scan)(pool[slot], x)
    expected_pool = np.array(pool.astype(jnp.float32))
    for row, s in enumerate(np.asarray(slot)):
        if s:
            expected_pool[s] = np.asarray(final[row].astype(jnp.float32))
    return outs, expected_pool, windows


def check_result(result, pool, slot, mode, outs, expected_pool, windows, out_tol):
    assert_close(result.outputs, outs, out_tol, "outputs")
    if mode == "verify":
        assert result.pool is None and result.step_windows.dtype == pool.dtype
        # windows hold raw inputs: copies, so they must match exactly
        np.testing.assert_array_equal(
            np.asarray(result.step_windows.astype(jnp.float32)),
            np.asarray(windows.astype(jnp.float32)),
        )
        return
    assert result.step_windows is None and result.pool.dtype == pool.dtype
    new_pool = np.asarray(result.pool.astype(jnp.float32))
    written = np.asarray(slot)[np.asarray(slot) != 0]
    untouched = np.setdiff1d(np.arange(pool.shape[0]), written)
    assert 0 in untouched and len(untouched) > 1
    np.testing.assert_array_equal(
        new_pool[untouched], np.asarray(pool.astype(jnp.float32))[untouched]
    )
    np.testing.assert_array_equal(new_pool[written], expected_pool[written])


CASES = [  # seed, batch, tokens, channels, K, slots, block, mode, pool dtype, x dtype, bias
    (1, 3, 1, 12, 4, 6, 4, "decode", jnp.float32, jnp.float32, True),
    (2, 5, 4, 20, 4, 7, None, "verify", jnp.float32, jnp.float32, False),
    (3, 6, 3, 24, 3, 9, 8, "decode", jnp.bfloat16, jnp.bfloat16, True),
    (4, 3, 2, 18, 4, 5, 6, "verify", jnp.bfloat16, jnp.float32, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"conv{c[0]}-{c[7]}")
def test_conv_pallas_and_xla_match_scan(case):
    seed, batch, tokens, channels, kernel, slots, block, mode, pool_dtype, x_dtype, bias = case
    rng = np.random.default_rng(seed)
    pool, slot, x, weight, bias = conv_case(
        rng, batch, tokens, channels, kernel, slots, pool_dtype, x_dtype, bias
    )
    expected = reference(pool, slot, x, weight, bias)
    out_tol = FP32_TOL if x_dtype == jnp.float32 else BF16_OUT_TOL
    # compiled, a tile Triton cannot lower is refused and the dispatch runs the XLA form
    pallas = pallas_or_dispatch(
        cu.conv_triton_error(block or channels),
        functools.partial(
            cu.conv_update_pallas,
            options=cu.ConvOptions(mode=mode),
            block_channels=block,
            interpret=INTERPRET,
        ),
        functools.partial(
            state_dispatch.conv_update,
            mode=mode,
            kernel_backend="pallas",
            block_channels=block or channels,
            interpret=INTERPRET,
        ),
    )
    got = pallas(pool, slot, x, weight, bias)
    check_result(got, pool, slot, mode, *expected, out_tol)
    got = jax.jit(cu.conv_update_xla, static_argnames="options")(
        pool, slot, x, weight, bias, options=cu.ConvOptions(mode)
    )
    check_result(got, pool, slot, mode, *expected, out_tol)


def test_conv_tile_step_matches_conv_step_pallas():
    rng = np.random.default_rng(5)
    channels, kernel = 7, 4
    window = jnp.asarray(rng.standard_normal((channels, kernel - 1)), jnp.float32)
    x = jnp.asarray(rng.standard_normal(channels), jnp.float32)
    weight = jnp.asarray(rng.standard_normal((channels, kernel)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(channels), jnp.float32)
    for silu in (True, False):
        columns, y = cu.conv_tile_step(
            [window[:, j] for j in range(kernel - 1)],
            x,
            [weight[:, j] for j in range(kernel)],
            bias,
            silu,
        )
        want_window, want_y = cu.conv_step(window, x, weight, bias, silu)
        assert_close(y, want_y, 1e-6, "conv tile output")
        np.testing.assert_array_equal(np.stack(columns, axis=1), np.asarray(want_window))


def test_conv_triton_error_names_a_tile_that_is_not_a_power_of_two_pallas(monkeypatch):
    """``conv_triton_error`` passes power-of-two channel tiles and names any other; the
    kernel refuses such a tile compiled, before tracing; the dispatch, compiled, launches
    the kernel at a power-of-two tile and takes the XLA form (no launch) at the other."""
    assert cu.conv_triton_error(1) is None and cu.conv_triton_error(256) is None
    error = cu.conv_triton_error(6)
    assert "block_channels=6 is not" in error and "power" in error
    rng = np.random.default_rng(9)
    args = conv_case(rng, 3, 2, 12, 4, 5, jnp.float32, jnp.float32, True)
    with pytest.raises(ValueError, match=re.escape(error)):
        cu.conv_update_pallas(
            *args, options=cu.ConvOptions("decode"), block_channels=6, interpret=False
        )
    launch_compiled(monkeypatch, state_dispatch)
    for block, launches in ((4, 1), (6, 0), (12, 0)):
        run = functools.partial(
            state_dispatch.conv_update, mode="verify", kernel_backend="pallas", block_channels=block
        )
        assert len(launch_names(jax.make_jaxpr(run)(*args).eqns)) == launches, block


def test_conv_bad_arguments_and_dispatch_pallas():
    rng = np.random.default_rng(6)
    pool, slot, x, weight, bias = conv_case(rng, 3, 2, 12, 4, 5, jnp.float32, jnp.float32, True)
    with pytest.raises(ValueError, match="block_channels=5"):
        cu.conv_update_pallas(
            pool, slot, x, weight, bias, options=cu.ConvOptions(mode="decode"), block_channels=5
        )
    with pytest.raises(ValueError, match="weight shape"):
        cu.conv_update_xla(
            pool, slot, x, weight[:, :3], bias, options=cu.ConvOptions(mode="decode")
        )
    with pytest.raises(ValueError, match="mode"):
        cu.conv_update_xla(pool, slot, x, weight, bias, options=cu.ConvOptions(mode="draft"))
    via_pallas = state_dispatch.conv_update(
        pool,
        slot,
        x,
        weight,
        bias,
        mode="decode",
        kernel_backend="pallas",
        block_channels=6,
        interpret=INTERPRET,
    )
    via_xla = state_dispatch.conv_update(
        pool, slot, x, weight, bias, mode="decode", kernel_backend="xla"
    )
    assert_close(via_pallas.outputs, via_xla.outputs, FP32_TOL, "dispatch outputs")
    np.testing.assert_array_equal(np.asarray(via_pallas.pool), np.asarray(via_xla.pool))


def test_conv_update_lowers_to_triton_at_model_shapes_pallas():
    """Nemotron-H's 10240 conv channels (not a power of two) lower through Pallas-Triton in
    1024-channel tiles, with a bf16 pool; Triton IR is built here, not compiled."""
    spec = jax.ShapeDtypeStruct
    params = common.pallas_compiler_params("gpu")
    channels = 10240
    args = (
        spec((9, channels, 3), jnp.bfloat16),
        spec((4,), jnp.int32),
        spec((4, 4, channels), jnp.bfloat16),
        spec((channels, 4), jnp.float32),
        spec((channels,), jnp.float32),
    )
    for mode in ("decode", "verify"):
        lowered = jax.jit(
            lambda *a: cu.conv_update_pallas(
                *a, options=cu.ConvOptions(mode=mode), block_channels=1024, compiler_params=params
            )
        ).trace(*args)
        assert "triton" in lowered.lower(lowering_platforms=("cuda",)).as_text().lower()


@pytest.mark.parametrize("mode", ["decode", "verify"])
def test_conv_stacked_pool_and_num_new_match_scan_pallas(mode):
    """``layer=l`` reads (and in decode writes) layer l of a stacked pool, every other layer
    bit-identical; tokens past ``num_new[b]`` leave row b's window as it is (a row with no
    new token writes back the window it read), as ``conv_scan``'s ``valid``; bf16 x with
    ``out_dtype=float32`` gives the scan's float32 outputs, not rounded to bf16."""
    rng = np.random.default_rng(7)
    layers, layer, batch, tokens, channels, kernel, slots = 3, 1, 4, 3, 16, 4, 6
    pool, slot, x, weight, bias = conv_case(
        rng, batch, tokens, channels, kernel, slots, jnp.bfloat16, jnp.bfloat16, True
    )
    stacked = jnp.asarray(rng.standard_normal((layers,) + pool.shape), jnp.bfloat16)
    slot = jnp.asarray([4, 0, 2, 5], jnp.int32)
    num_new = jnp.asarray([3, 2, 0, 1], jnp.int32)
    valid = jnp.arange(tokens)[None, :] < num_new[:, None]
    scan = lambda w0, xs, ok: cu.conv_scan(w0, xs, weight, bias, ok)  # noqa: E731
    outs, final, windows = jax.vmap(scan)(stacked[layer][slot], x, valid)
    assert not np.array_equal(np.asarray(final[3]), np.asarray(stacked[layer, 5]))
    np.testing.assert_array_equal(np.asarray(final[2]), np.asarray(stacked[layer, 2]))
    forms = {
        "pallas": functools.partial(cu.conv_update_pallas, block_channels=8, interpret=INTERPRET),
        "xla": jax.jit(cu.conv_update_xla, static_argnames="options"),
    }
    options = cu.ConvOptions(mode, layer=layer, out_dtype=jnp.float32)
    for name, form in forms.items():
        got = form(stacked, slot, x, weight, bias, num_new, options=options)
        assert got.outputs.dtype == jnp.float32
        assert_close(got.outputs, outs, FP32_TOL, f"{name} outputs")
        if mode == "verify":
            assert got.pool is None
            np.testing.assert_array_equal(
                np.asarray(got.step_windows.astype(jnp.float32)),
                np.asarray(windows.astype(jnp.float32)),
            )
            continue
        want = np.array(stacked.astype(jnp.float32))
        for row, s in enumerate(np.asarray(slot)):
            if s:
                want[layer, s] = np.asarray(final[row].astype(jnp.float32))
        np.testing.assert_array_equal(np.asarray(got.pool.astype(jnp.float32)), want)


def test_conv_stacked_pool_bad_layer_pallas():
    rng = np.random.default_rng(8)
    pool, slot, x, weight, bias = conv_case(rng, 2, 1, 8, 4, 3, jnp.float32, jnp.float32, False)
    with pytest.raises(ValueError, match="layer=2"):
        cu.conv_update_xla(
            pool[None].repeat(2, 0), slot, x, weight, options=cu.ConvOptions(mode="decode", layer=2)
        )
    with pytest.raises(ValueError, match=r"\[L, S\+1, C, K-1\]"):
        cu.conv_update_pallas(pool, slot, x, weight, options=cu.ConvOptions(mode="decode", layer=0))
    with pytest.raises(ValueError, match="num_new shape"):
        cu.conv_update_pallas(
            pool,
            slot,
            x,
            weight,
            options=cu.ConvOptions(mode="decode"),
            num_new=jnp.ones(3, jnp.int32),
        )


def _conv_order(x: np.ndarray, groups: int, parts: tuple[int, ...]) -> np.ndarray:
    """The conv channels of a grouped input, gathered column by column: part p of every
    group in turn (``ChannelGroups``' contract, written out with numpy)."""
    stride = x.shape[-1] // groups
    columns = []
    for p, size in enumerate(parts):
        start = sum(parts[:p])
        for g in range(groups):
            columns.extend(g * stride + start + c for c in range(size))
    return x[..., columns]


@pytest.mark.parametrize("mode", ["decode", "verify"])
def test_conv_reads_grouped_channels_in_place_pallas(mode):
    """With ``ChannelGroups`` both forms read the conv channels where a grouped input holds
    them (Qwen3-Next's ``in_proj_qkvz``: per key head q, k, v, then z, not a channel) and
    give what they give for the channels gathered in conv order."""
    rng = np.random.default_rng(7)
    groups, parts, extra = 3, (4, 4, 8), 8
    channels = groups * sum(parts)
    pool, slot, _, weight, bias = conv_case(
        rng, 4, 2, channels, 4, 6, jnp.float32, jnp.float32, True
    )
    x = rng.standard_normal((4, 2, groups * (sum(parts) + extra))).astype(np.float32)
    expected = reference(pool, slot, jnp.asarray(_conv_order(x, groups, parts)), weight, bias)
    args = (pool, slot, jnp.asarray(x), weight, bias)
    layout = cu.ChannelGroups(groups, parts)
    for block in (2, 4, None):
        got = state_dispatch.conv_update(
            *args, mode=mode, channel_groups=layout, kernel_backend="pallas",
            block_channels=block, interpret=INTERPRET,
        )  # fmt: skip
        check_result(got, pool, slot, mode, *expected, FP32_TOL)
    got = cu.conv_update_xla(*args, options=cu.ConvOptions(mode=mode, channel_groups=layout))
    check_result(got, pool, slot, mode, *expected, FP32_TOL)
    with pytest.raises(ValueError, match="block_channels=8 must divide the parts"):
        cu.conv_update_pallas(
            *args,
            options=cu.ConvOptions(mode=mode, channel_groups=layout),
            block_channels=8,
            interpret=INTERPRET,
        )
    with pytest.raises(ValueError, match="does not hold 5 groups"):
        cu.conv_update_xla(
            *args, options=cu.ConvOptions(mode=mode, channel_groups=cu.ChannelGroups(5, parts))
        )


def test_grouped_conv_lowers_to_triton_at_qwen3_next_shapes_pallas():
    """Qwen3-Next's fused projection (16 key heads: q, k of 128, v of 256, z of 256) read in
    place lowers through Pallas-Triton in 128-channel tiles (Triton IR built, not compiled)."""
    spec = jax.ShapeDtypeStruct
    layout = cu.ChannelGroups(16, (128, 128, 256))
    args = (
        spec((6, 9, 8192, 3), jnp.bfloat16),
        spec((2,), jnp.int32),
        spec((2, 1, 16 * 768), jnp.bfloat16),
        spec((8192, 4), jnp.bfloat16),
    )
    params = common.pallas_compiler_params("gpu")
    for mode in ("decode", "verify"):
        run = lambda pool, slot, x, w, mode=mode: cu.conv_update_pallas(  # noqa: E731
            pool,
            slot,
            x,
            w,
            options=cu.ConvOptions(mode=mode, layer=1, channel_groups=layout),
            block_channels=128,
            compiler_params=params,
        )
        text = jax.jit(run).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" in text.lower()
