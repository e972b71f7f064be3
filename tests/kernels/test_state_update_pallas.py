"""State-update kernels (GDN, Mamba2; Pallas in interpret mode and XLA) against the scans."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from lazyspec.kernels import backend, common
from lazyspec.kernels.gdn import reference as gdn_reference
from lazyspec.kernels.gdn import update as gdn_update
from lazyspec.kernels.mamba2 import reference as mamba2_reference
from lazyspec.kernels.mamba2 import update as mamba2_update
from lazyspec.kernels.state import dispatch as state_dispatch
from lazyspec.kernels.state import update_common as su
from lazyspec.kernels.tuning import Tuning
from tests.kernels.kernel_checks import (
    INTERPRET,
    TPU_INTERPRET,
    assert_close,
    draw_slots,
    launch_compiled,
    launch_names,
    normal,
    pallas_or_dispatch,
    tolerance,
)

pytestmark = pytest.mark.pallas

FP32_TOL = tolerance(jnp.float32, reduction_length=128)  # key / state dims x steps
# bf16 inputs are upcast exactly, so the float32 state matches to FP32_TOL; bf16 outputs are
# the float32 result rounded once: half a bf16 ulp, at most 2**-8 of the value, apart.
BF16_OUT_TOL = tolerance(jnp.bfloat16, reduction_length=128)


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x).astype(np.float32)


def as_jax(dtype, *arrays):
    return [jnp.asarray(a).astype(dtype) for a in arrays]


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + gdn_reference.L2_EPS)


def engine_pool(states: np.ndarray) -> jax.Array:
    """A pool as the engine keeps one: slot 0, the padding rows' slot, all zeros (which the
    dispatch's updates need not read in decode: ``StateTuning.skip_padding_state``)."""
    states[0] = 0.0
    return jnp.asarray(states)


def gdn_case(rng, batch, tokens, heads, key_dim, value_dim, num_slots, dtype):
    shape = (batch, tokens, heads)
    q = unit(normal(rng, *shape, key_dim)) / np.float32(np.sqrt(key_dim))
    g = -np.exp(0.5 * normal(rng, heads)) * softplus(normal(rng, *shape))
    beta = 1.0 / (1.0 + np.exp(-normal(rng, *shape)))
    inputs = su.GdnTokens(
        *as_jax(
            dtype, q, unit(normal(rng, *shape, key_dim)), normal(rng, *shape, value_dim), g, beta
        )
    )
    pool = engine_pool(0.5 * normal(rng, num_slots + 1, heads, key_dim, value_dim))
    return pool, jnp.asarray(draw_slots(rng, batch, num_slots)), inputs


def mamba2_case(rng, batch, tokens, heads, groups, head_dim, state_dim, num_slots, dtype):
    shape = (batch, tokens)
    dt = np.clip(softplus(normal(rng, *shape, heads)), 1e-3, 2.0)
    x, b, c, dt = as_jax(
        dtype,
        normal(rng, *shape, heads, head_dim),
        normal(rng, *shape, groups, state_dim),
        normal(rng, *shape, groups, state_dim),
        dt,
    )
    a, d = as_jax(jnp.float32, -np.exp(0.5 * normal(rng, heads)), normal(rng, heads))
    pool = engine_pool(0.5 * normal(rng, num_slots + 1, heads, head_dim, state_dim))
    return pool, jnp.asarray(draw_slots(rng, batch, num_slots)), su.Mamba2Tokens(x, b, c, dt, a, d)


def reference(pool, slot, scan, fields, shared=()):
    """Per-row scans from pool[slot]; the expected pool written with numpy."""
    f32 = [jnp.asarray(f, jnp.float32) for f in fields]
    in_axes = (0,) * (1 + len(f32)) + (None,) * len(shared)
    outs, final, states = jax.vmap(scan, in_axes=in_axes)(pool[slot], *f32, *shared)
    expected_pool = np.array(pool)
    for row, s in enumerate(np.asarray(slot)):
        if s:
            expected_pool[s] = np.asarray(final[row])
    return outs, expected_pool, states


def check_result(result, pool, slot, mode, outs, expected_pool, states, out_tol):
    assert_close(result.outputs, outs, out_tol, "outputs")
    if mode == "verify":
        assert result.pool is None
        assert_close(result.step_states, states, FP32_TOL, "step states")
        return
    assert result.step_states is None
    written = np.asarray(slot)[np.asarray(slot) != 0]
    untouched = np.setdiff1d(np.arange(pool.shape[0]), written)
    assert 0 in untouched and len(untouched) > 1
    new_pool = np.asarray(result.pool)
    np.testing.assert_array_equal(new_pool[untouched], np.asarray(pool)[untouched])
    assert_close(new_pool[written], expected_pool[written], FP32_TOL, "written slots")


def gdn_reference_run(pool, slot, inputs: su.GdnTokens):
    """``reference`` of the GDN token scan: (outputs, pool, step states)."""
    tokens = (inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta)
    return reference(pool, slot, gdn_reference.gdn_scan, tokens)


def mamba2_reference_run(pool, slot, inputs: su.Mamba2Tokens):
    """``reference`` of the Mamba2 token scan: (outputs, pool, step states)."""
    tokens = (inputs.x, inputs.b, inputs.c, inputs.dt)
    return reference(pool, slot, mamba2_reference.mamba2_scan, tokens, (inputs.a, inputs.d))


def dispatched_update(pool, slot, inputs, *, mode: str, tiles, interpret) -> su.StateUpdateResult:
    """``state_dispatch.state_update`` on the Pallas backend, called as the Pallas forms are
    (``tiles``' sizes as its tile arguments)."""
    return state_dispatch.state_update(
        pool, slot, inputs, mode=mode, kernel_backend="pallas", interpret=interpret,
        block_heads=tiles.block_heads, block_value=tiles.block_value,
    )  # fmt: skip


# mixer -> (its Pallas form, its XLA form, the Pallas form's ``*_triton_error``, the
# reference run of a case)
FORMS = {
    "gdn": (
        gdn_update.gdn_state_update_pallas,
        gdn_update.gdn_state_update_xla,
        gdn_update.gdn_triton_error,
        gdn_reference_run,
    ),
    "mamba2": (
        mamba2_update.mamba2_state_update_pallas,
        mamba2_update.mamba2_state_update_xla,
        mamba2_update.mamba2_triton_error,
        mamba2_reference_run,
    ),
}


def check_both_forms(mixer: str, case: tuple, mode: str, tiles, dtype) -> None:
    """The Pallas update of ``mixer`` (``FORMS``) in ``tiles`` and its jitted XLA form on
    ``case`` (pool, slot, inputs) both give the reference run's outputs, pool and step
    states, the outputs within ``dtype``'s tolerance. Compiled, shapes Triton cannot lower
    are refused and the dispatch runs the XLA form."""
    pallas, xla, triton_error, reference_run = FORMS[mixer]
    pool, slot, inputs = case
    expected = reference_run(pool, slot, inputs)
    out_tol = FP32_TOL if dtype == jnp.float32 else BF16_OUT_TOL
    pallas = pallas_or_dispatch(triton_error(pool.shape[1:], tiles), pallas, dispatched_update)
    got = pallas(pool, slot, inputs, mode=mode, tiles=tiles, interpret=INTERPRET)
    check_result(got, pool, slot, mode, *expected, out_tol)
    got = jax.jit(xla, static_argnames="mode")(pool, slot, inputs, mode=mode)
    check_result(got, pool, slot, mode, *expected, out_tol)


GDN_CASES = [  # seed, batch, tokens, heads, key_dim, value_dim, slots, bh, bv, mode, dtype
    (1, 3, 1, 3, 8, 16, 6, 1, 8, "decode", jnp.float32),
    (2, 5, 4, 6, 16, 8, 9, 2, None, "verify", jnp.float32),
    (3, 7, 2, 5, 8, 8, 10, 5, 4, "decode", jnp.float32),
    (4, 3, 3, 6, 8, 16, 5, 3, 8, "verify", jnp.bfloat16),
    (5, 2, 1, 2, 16, 16, 4, 2, None, "decode", jnp.bfloat16),
]


@pytest.mark.parametrize("case", GDN_CASES, ids=lambda c: f"gdn{c[0]}-{c[9]}")
def test_gdn_pallas_and_xla_match_scan(case):
    seed, batch, tokens, heads, dk, dv, slots, bh, bv, mode, dtype = case
    rng = np.random.default_rng(seed)
    case = gdn_case(rng, batch, tokens, heads, dk, dv, slots, dtype)
    check_both_forms("gdn", case, mode, su.UpdateTiles(block_heads=bh, block_value=bv), dtype)


MAMBA2_CASES = [  # seed, batch, tokens, heads, groups, P, N, slots, bh, bp, mode, dtype
    (11, 3, 1, 6, 2, 8, 16, 5, 1, 4, "decode", jnp.float32),
    (12, 5, 4, 6, 2, 8, 16, 8, 3, None, "verify", jnp.float32),
    (13, 6, 3, 6, 3, 4, 8, 9, 6, 2, "decode", jnp.float32),
    (14, 3, 2, 4, 4, 8, 16, 4, 2, 8, "verify", jnp.bfloat16),
]


@pytest.mark.parametrize("case", MAMBA2_CASES, ids=lambda c: f"mamba{c[0]}-{c[10]}")
def test_mamba2_pallas_and_xla_match_scan(case):
    seed, batch, tokens, heads, groups, p, n, slots, bh, bp, mode, dtype = case
    rng = np.random.default_rng(seed)
    case = mamba2_case(rng, batch, tokens, heads, groups, p, n, slots, dtype)
    check_both_forms("mamba2", case, mode, su.UpdateTiles(block_heads=bh, block_value=bp), dtype)


def test_update_triton_errors_name_the_dims_that_are_not_powers_of_two_pallas(monkeypatch):
    """``gdn_triton_error`` / ``mamba2_triton_error`` pass power-of-two tiles and whole dims
    and name every one that is not (a None tile is the whole axis); the kernels refuse such
    shapes compiled, before tracing; the dispatch, compiled, launches the kernel at
    power-of-two tiles and takes the XLA form (no launch) at the others."""
    gdn_error, mamba2_error = gdn_update.gdn_triton_error, mamba2_update.mamba2_triton_error
    assert gdn_error((6, 8, 16), su.UpdateTiles(2, 8)) is None
    assert "block_heads=3, d_k=12 are not" in gdn_error((6, 12, 16), su.UpdateTiles(3, 8))
    assert "block_value=24 is not" in gdn_error((6, 8, 24), su.UpdateTiles(2, None))
    assert mamba2_error((6, 8, 16), su.UpdateTiles(1, None)) is None
    assert "block_value=6, N=12 are not" in mamba2_error((4, 12, 12), su.UpdateTiles(2, 6))
    with pytest.raises(ValueError, match="block_heads=4"):
        gdn_error((6, 8, 16), su.UpdateTiles(4, 8))
    rng = np.random.default_rng(26)
    cases = (
        (gdn_case(rng, 3, 2, 6, 8, 8, 5, jnp.float32), gdn_update.gdn_state_update_pallas),
        (
            mamba2_case(rng, 3, 2, 6, 6, 8, 16, 5, jnp.float32),
            mamba2_update.mamba2_state_update_pallas,
        ),
    )
    for (pool, slot, inputs), kernel in cases:
        with pytest.raises(ValueError, match=f"{kernel.__name__}.*block_heads=3 is not"):
            kernel(pool, slot, inputs, mode="decode", tiles=su.UpdateTiles(3), interpret=False)
    launch_compiled(monkeypatch, state_dispatch)
    for (pool, slot, inputs), _ in cases:
        for block_heads, launches in ((2, 1), (3, 0), (6, 0)):
            run = functools.partial(
                state_dispatch.state_update, mode="verify", kernel_backend="pallas",
                block_heads=block_heads,
            )  # fmt: skip
            jaxpr = jax.make_jaxpr(run)(pool, slot, inputs)
            assert len(launch_names(jaxpr.eqns)) == launches, block_heads


def test_tile_steps_match_recurrence_steps_pallas():
    rng = np.random.default_rng(21)
    heads, dk, dv = 3, 8, 5
    h, q, k, v, g, beta = as_jax(
        jnp.float32,
        normal(rng, heads, dk, dv),
        normal(rng, heads, dk),
        normal(rng, heads, dk),
        normal(rng, heads, dv),
        -softplus(normal(rng, heads)),
        softplus(normal(rng, heads)) / 4,
    )
    for got, want in zip(
        gdn_update.gdn_tile_step(h, q, k, v, g, beta), gdn_reference.gdn_step(h, q, k, v, g, beta)
    ):
        assert_close(got, want, 1e-6, "gdn tile step")
    heads, groups, p, n = 4, 2, 3, 6
    h, x, b, c, dt, a, d = as_jax(
        jnp.float32,
        normal(rng, heads, p, n),
        normal(rng, heads, p),
        normal(rng, groups, n),
        normal(rng, groups, n),
        softplus(normal(rng, heads)),
        -np.exp(normal(rng, heads)),
        normal(rng, heads),
    )
    per_head = lambda m: jnp.repeat(m, heads // groups, axis=0)  # noqa: E731
    for got, want in zip(
        mamba2_update.mamba2_tile_step(h, x, per_head(b), per_head(c), dt, a, d),
        mamba2_reference.mamba2_step(h, x, b, c, dt, a, d),
    ):
        assert_close(got, want, 1e-6, "mamba2 tile step")


def test_interpret_mode_leaves_unwritten_outputs_nan_pallas():
    """The premise of the NaN checks above: interpret mode poisons fresh outputs."""

    def kernel(x_ref, out_ref):
        out_ref[0] = x_ref[0]

    x = jnp.asarray(np.random.default_rng(22).standard_normal((2, 4)), jnp.float32)
    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(
        x
    )
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(x[0]))
    assert np.isnan(np.asarray(out[1])).all()


def test_bad_arguments_raise_value_error_pallas():
    rng = np.random.default_rng(23)
    pool, slot, inputs = gdn_case(rng, 2, 1, 6, 8, 8, 3, jnp.float32)
    with pytest.raises(ValueError, match="prefill"):
        gdn_update.gdn_state_update_pallas(pool, slot, inputs, mode="prefill", interpret=INTERPRET)
    with pytest.raises(ValueError, match="block_heads=4"):
        gdn_update.gdn_state_update_pallas(
            pool, slot, inputs, mode="decode", tiles=su.UpdateTiles(block_heads=4)
        )
    with pytest.raises(ValueError, match="pool shape"):
        gdn_update.gdn_state_update_xla(pool[:, :, :4], slot, inputs, mode="decode")
    pool, slot, inputs = mamba2_case(rng, 2, 1, 6, 2, 4, 8, 3, jnp.float32)
    with pytest.raises(ValueError, match="heads per group"):
        mamba2_update.mamba2_state_update_pallas(
            pool, slot, inputs, mode="decode", tiles=su.UpdateTiles(block_heads=2)
        )


def test_backend_resolution_and_dispatch_pallas():
    assert common.resolve_backend(None, "cpu") == "xla"
    assert common.resolve_backend(None, "gpu") == "pallas"
    assert common.resolve_backend(None, "tpu") == "xla"  # untested on TPU: opt in
    assert common.resolve_backend("xla", "gpu") == "xla"
    with pytest.raises(ValueError, match="triton"):
        common.resolve_backend("triton")
    assert common.pallas_compiler_params("cpu") is None
    assert common.pallas_compiler_params("gpu", num_warps=8).num_warps == 8
    rng = np.random.default_rng(24)
    pool, slot, inputs = mamba2_case(rng, 3, 2, 4, 2, 4, 8, 4, jnp.float32)
    via_pallas = state_dispatch.state_update(
        pool,
        slot,
        inputs,
        mode="verify",
        kernel_backend="pallas",
        block_heads=2,
        interpret=INTERPRET,
    )
    via_xla = state_dispatch.state_update(pool, slot, inputs, mode="verify", kernel_backend="xla")
    assert_close(via_pallas.outputs, via_xla.outputs, FP32_TOL, "dispatch outputs")
    assert_close(via_pallas.step_states, via_xla.step_states, FP32_TOL, "dispatch states")
    with pytest.raises(ValueError, match="GdnTokens"):
        state_dispatch.state_update(pool, slot, (inputs.x,), mode="verify", kernel_backend="xla")


def test_kernels_record_resolves_each_backend_once_pallas():
    """``kernels_for`` binds each backend's functions once: XLA has no state-update kernel
    (the mixers' own scans), Pallas the Triton-layout kernels (interpret mode on CPU) with
    the dispatch's default tiles, Pallas on a TPU the scalar-prefetch ones and the XLA
    scatter. Records compare by backend, platform and tuning, not by their bound functions."""
    assert backend.kernels_for("xla", "cpu") == backend.XLA_KERNELS
    assert backend.kernels_for(None, "cpu") == backend.kernels_for("xla", "cpu")
    xla = backend.XLA_KERNELS
    assert xla.gdn_state_update is None and xla.mamba2_state_update is None
    pallas = backend.kernels_for("pallas", "cpu")
    assert pallas == backend.Kernels("pallas", "cpu", None, None, None) != xla
    other = Tuning().with_overrides({"gdn.block_value": 32})
    assert backend.kernels_for("pallas", "cpu", tuning=other) != pallas  # another program
    assert backend.kernels_for("pallas", "cpu", tuning=other).tuning == other
    assert backend.kernels_for("pallas", "tpu").state_scatter is backend.state_scatter_xla
    with pytest.raises(ValueError, match="triton"):
        backend.kernels_for("triton")
    rng = np.random.default_rng(25)
    cases = (
        gdn_case(rng, 3, 2, 2, 8, 24, 5, jnp.float32),
        mamba2_case(rng, 3, 2, 4, 2, 4, 8, 4, jnp.float32),
    )
    updates = (pallas.gdn_state_update, pallas.mamba2_state_update)
    for (pool, slot, inputs), update in zip(cases, updates):
        for mode in su.MODES:
            got = update(pool, slot, inputs, mode=mode)
            want = state_dispatch.state_update(pool, slot, inputs, mode=mode, kernel_backend="xla")
            assert_close(got.outputs, want.outputs, FP32_TOL, f"{mode} outputs")
            got_state = got.pool if mode == "decode" else got.step_states
            want_state = want.pool if mode == "decode" else want.step_states
            assert_close(got_state, want_state, FP32_TOL, f"{mode} states")


@pytest.mark.parametrize("value_dim", [128, 24])
def test_dispatch_default_tiles_pallas(value_dim):
    """Without tile arguments the dispatch takes the tuning's: GDN value tiles of 64 (two
    tiles over d_v = 128) or, when 64 does not divide d_v (24), the largest power of two
    that does (8)."""
    assert common.fitted_tile(128, Tuning().gdn.block_value) == 64
    assert common.fitted_tile(24, 64) == 8 and common.fitted_tile(10240, 2048) == 2048
    assert common.fitted_tile(7, 64) == 1
    rng = np.random.default_rng(value_dim)
    pool, slot, inputs = gdn_case(rng, 3, 2, 2, 8, value_dim, 5, jnp.float32)
    for mode in su.MODES:
        got = state_dispatch.state_update(
            pool, slot, inputs, mode=mode, kernel_backend="pallas", interpret=INTERPRET
        )
        want = state_dispatch.state_update(pool, slot, inputs, mode=mode, kernel_backend="xla")
        assert_close(got.outputs, want.outputs, FP32_TOL, f"{mode} outputs")
        states = (got.pool, want.pool) if mode == "decode" else (got.step_states, want.step_states)
        assert_close(*states, FP32_TOL, f"{mode} states")


def test_gdn_update_value_tile_switch_pallas():
    """``GdnTuning.small_block_value`` set, the GDN update of up to
    ``Tuning.small_step_max_tokens`` tokens takes that value tile (its grid's last axis d_v /
    tile) with the same results; 0, or more tokens, keep ``block_value``."""
    rng = np.random.default_rng(21)
    bound = Tuning().small_step_max_tokens
    for rows, block, tiles in ((bound, 0, 1), (bound, 8, 4), (bound + 1, 8, 1)):
        pool, slot, inputs = gdn_case(rng, rows, 1, 2, 8, 32, 5, jnp.float32)
        want = state_dispatch.state_update(pool, slot, inputs, mode="decode", kernel_backend="xla")
        tuning = Tuning().with_overrides({"gdn.small_block_value": block})

        def run(pool, slot=slot, inputs=inputs, tuning=tuning):
            return state_dispatch.state_update(
                pool, slot, inputs, mode="decode", kernel_backend="pallas", interpret=INTERPRET,
                tuning=tuning,
            )  # fmt: skip

        eqns = jax.make_jaxpr(run)(pool).jaxpr.eqns
        (call,) = [e for e in eqns if e.primitive.name == "pallas_call"]
        assert call.params["grid_mapping"].grid[-1] == tiles, (rows, block)
        got = run(pool)
        assert_close(got.outputs, want.outputs, FP32_TOL, "outputs")
        assert_close(got.pool, want.pool, FP32_TOL, "pool")


def test_evict_last_hint_keeps_results_pallas():
    """The decode load's cache hint (``evict_last``, Mamba2's default) changes no value: both
    mixers, both modes (verify ignores it), against the XLA form; the default tiles carry
    the hint for Mamba2 only."""
    assert Tuning().mamba2.evict_last and not Tuning().gdn.evict_last
    rng = np.random.default_rng(7)
    cases = [
        gdn_case(rng, 3, 2, 2, 8, 16, 5, jnp.float32),
        mamba2_case(rng, 3, 2, 4, 2, 8, 16, 5, jnp.bfloat16),
    ]
    for pool, slot, inputs in cases:
        for mode in su.MODES:
            got = state_dispatch.state_update(
                pool,
                slot,
                inputs,
                mode=mode,
                kernel_backend="pallas",
                block_value=4,
                evict_last=True,
                interpret=INTERPRET,
            )
            want = state_dispatch.state_update(pool, slot, inputs, mode=mode, kernel_backend="xla")
            tol = BF16_OUT_TOL if inputs.__class__ is su.Mamba2Tokens else FP32_TOL
            assert_close(got.outputs, want.outputs, tol, f"{mode} outputs")
            states = (
                (got.pool, want.pool) if mode == "decode" else (got.step_states, want.step_states)
            )
            assert_close(*states, FP32_TOL, f"{mode} states")


def test_padding_rows_skip_their_state_in_decode_pallas():
    """With ``skip_padding`` (``StateTuning.skip_padding_state``) a decode step's padding
    rows (slot 0) read a zero state, not slot 0's: with NaN in slot 0 their outputs are the
    XLA form's from a zero slot 0, the real rows' outputs and slots are as without it, and
    slot 0 stays as it was. Both mixers; verify reads slot 0 as before (its own data)."""
    rng = np.random.default_rng(17)
    cases = [
        gdn_case(rng, 4, 2, 2, 8, 16, 5, jnp.float32),
        mamba2_case(rng, 4, 2, 4, 2, 8, 16, 5, jnp.float32),
    ]
    assert Tuning().state.skip_padding_state
    off = Tuning().with_overrides({"state.skip_padding_state": False})
    for pool, slot, inputs in cases:
        slot = slot.at[1].set(0).at[3].set(0)  # rows 1 and 3 are padding
        zeroed = pool.at[0].set(0.0)
        poisoned = pool.at[0].set(jnp.nan)
        run = functools.partial(
            state_dispatch.state_update, kernel_backend="pallas", block_value=4, interpret=INTERPRET
        )
        got = run(poisoned, slot, inputs, mode="decode")
        want = state_dispatch.state_update(
            zeroed, slot, inputs, mode="decode", kernel_backend="xla"
        )
        assert_close(got.outputs, want.outputs, FP32_TOL, "outputs")
        assert np.isnan(np.asarray(got.pool[0])).all()  # slot 0 neither read nor written
        assert_close(got.pool[1:], want.pool[1:], FP32_TOL, "slots")
        verify = run(zeroed, slot, inputs, mode="verify")  # reads slot 0 as it is
        assert_close(verify.outputs, want.outputs, FP32_TOL, "verify outputs")
        with pytest.raises(AssertionError):  # verify reads the poisoned slot 0: NaN rows
            assert_close(run(poisoned, slot, inputs, mode="verify").outputs, want.outputs, 1, "")
        read = run(poisoned, slot, inputs, mode="decode", tuning=off)  # off: slot 0 read
        assert np.isnan(np.asarray(read.outputs)[[1, 3]]).all()


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_layer_of_a_stacked_pool_pallas(platform):
    """``layer=l`` on the stacked pool of all layers equals the update on layer l's own pool
    (outputs, step states; decode writes layer l only, every other layer bit-identical),
    through the dispatch: the Triton-layout kernels ("gpu") and the TPU ones (the layer
    picked in the index maps), each compiled where it runs, else in interpret mode, and XLA."""
    rng = np.random.default_rng(17)
    cases = [
        gdn_case(rng, 3, 2, 2, 8, 16, 5, jnp.float32),  # one group: a TPU-legal tile
        mamba2_case(rng, 3, 2, 4, 1, 8, 16, 5, jnp.float32),
    ]
    for pool, slot, inputs in cases:
        stacked = jnp.stack([pool * 0.5, pool, pool * 2.0])
        for mode in su.MODES:
            want = state_dispatch.state_update(pool, slot, inputs, mode=mode, kernel_backend="xla")
            for name in ("pallas", "xla"):
                got = state_dispatch.state_update(
                    stacked,
                    slot,
                    inputs,
                    mode=mode,
                    layer=1,
                    kernel_backend=name,
                    interpret=TPU_INTERPRET if platform == "tpu" else INTERPRET,
                    platform=platform,
                )
                assert_close(got.outputs, want.outputs, FP32_TOL, f"{name} {mode} outputs")
                if mode == "verify":
                    assert_close(got.step_states, want.step_states, FP32_TOL, f"{name} steps")
                    continue
                assert_close(got.pool[1], want.pool, FP32_TOL, f"{name} layer 1")
                for other in (0, 2):
                    np.testing.assert_array_equal(
                        np.asarray(got.pool[other]), np.asarray(stacked[other])
                    )
        with pytest.raises(ValueError, match="layer=3"):
            state_dispatch.state_update(
                stacked, slot, inputs, mode="verify", layer=3, kernel_backend="xla"
            )
        with pytest.raises(ValueError, match="leading layer axis"):
            state_dispatch.state_update(
                pool, slot, inputs, mode="verify", layer=0, kernel_backend="xla"
            )
