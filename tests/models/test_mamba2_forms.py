"""The three Mamba2 forms (scan reference, chunked SSD, T-step update) agree, states included.

A row of SEQ_LEN tokens is run once through the token-by-token reference; its per-token state
trace is the oracle. The chunked and T-step forms then restart at an arbitrary offset inside
that row from the oracle's state there and must reproduce the outputs, the final state and
every chunk / step state after it, with ragged tails (num_new < T).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lazyspec.kernels.mamba2.chunked import conv_windowed, mamba2_chunked
from lazyspec.kernels.mamba2.reference import mamba2_scan
from lazyspec.kernels.state.conv import conv_scan
from lazyspec.models.layers.mamba2 import Mamba2Dims, mamba2_mixer, mamba2_plan
from lazyspec.models.plan import init_plan

SEQ_LEN = 200
CHUNK = 64
TOL = 1e-5


def rel_err(got, want) -> float:
    """max |got - want| / max |want|."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def make_dims(n_groups: int) -> Mamba2Dims:
    return Mamba2Dims(
        hidden_size=24,
        num_heads=4,
        head_dim=8,
        state_size=16,
        n_groups=n_groups,
        conv_kernel=4,
        norm_eps=1e-5,
    )


def random_params(dims: Mamba2Dims, seed: int) -> dict:
    """Mixer params with every constant-initialised tensor re-drawn."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    params = init_plan(mamba2_plan("mixer", dims, use_bias=True), keys[0], jnp.float32)
    proj = params["in_proj"]
    proj["weight"] = 0.3 * jax.random.normal(keys[1], proj["weight"].shape)
    proj["bias"] = 0.1 * jax.random.normal(keys[2], proj["bias"].shape)
    params["conv_bias"] = 0.1 * jax.random.normal(keys[3], params["conv_bias"].shape)
    params["D"] = jax.random.normal(keys[4], params["D"].shape)
    params["norm"] = 1 + 0.3 * jax.random.normal(keys[5], params["norm"].shape)
    return params


@partial(jax.jit, static_argnames=("dims", "form"))
def run_mixer(params, dims, hidden, conv0, ssm0, num_new, form):
    return mamba2_mixer(params, dims, hidden, conv0, ssm0, num_new, form=form, chunk_size=CHUNK)


def oracle(params, dims, hidden):
    """Reference run of the whole row from zero state: (outputs, trace_conv, trace_ssm)."""
    conv0 = jnp.zeros((1, dims.conv_dim, dims.conv_kernel - 1))
    ssm0 = jnp.zeros((1, dims.num_heads, dims.head_dim, dims.state_size))
    out, states = run_mixer(params, dims, hidden, conv0, ssm0, jnp.array([SEQ_LEN]), "reference")
    return out[0], states.trace_conv[0], states.trace_ssm[0]


def state_before(trace_conv, trace_ssm, offset: int):
    """The oracle's state before token ``offset`` (zero before token 0), batched as B=1."""
    if offset == 0:
        return jnp.zeros_like(trace_conv[:1]), jnp.zeros_like(trace_ssm[:1])
    return trace_conv[offset - 1][None], trace_ssm[offset - 1][None]


@pytest.fixture(scope="module")
def row():
    """Two groups of two heads each (the head -> group map matters); the oracle's trace."""
    dims = make_dims(2)
    params = random_params(dims, seed=2)
    hidden = jax.random.normal(jax.random.PRNGKey(100), (1, SEQ_LEN, 24))
    return dims, params, hidden, oracle(params, dims, hidden)


def check_window(row, data, sizes: list[int], form: str):
    """A window of T tokens (T drawn from ``sizes``) at a drawn offset, the first num_new of
    them real, run in ``form`` from the oracle's state before it: its outputs and final ssm
    state checked against the oracle's; (its states, offset, T, num_new)."""
    dims, params, hidden, (ref_out, ref_conv, ref_ssm) = row
    num_tokens = data.draw(st.sampled_from(sizes), label="T")
    offset = data.draw(st.integers(0, SEQ_LEN - num_tokens), label="offset")
    num_new = data.draw(st.integers(1, num_tokens), label="num_new")
    conv0, ssm0 = state_before(ref_conv, ref_ssm, offset)
    window = hidden[:, offset : offset + num_tokens]
    out, states = run_mixer(params, dims, window, conv0, ssm0, jnp.array([num_new]), form)
    last = offset + num_new - 1
    assert rel_err(out[0, :num_new], ref_out[offset : last + 1]) <= TOL
    assert rel_err(states.ssm[0], ref_ssm[last]) <= TOL
    return states, offset, num_tokens, num_new


@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_chunked_matches_reference_at_any_offset(row, data):
    ref_conv, ref_ssm = row[3][1:]
    states, offset, num_tokens, num_new = check_window(row, data, [1, 64, 130], "chunked")
    assert rel_err(states.conv[0], ref_conv[offset + num_new - 1]) <= TOL
    assert states.trace_ssm.shape[1] == num_tokens // CHUNK
    for j in range(num_tokens // CHUNK):
        end = offset + min((j + 1) * CHUNK, num_new) - 1
        assert rel_err(states.trace_ssm[0, j], ref_ssm[end]) <= TOL
        assert rel_err(states.trace_conv[0, j], ref_conv[end]) <= TOL


@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_steps_match_reference_at_any_offset(row, data):
    ref_conv, ref_ssm = row[3][1:]
    states, offset, num_tokens, num_new = check_window(row, data, [1, 4], "steps")
    for t in range(num_tokens):
        at = offset + min(t, num_new - 1)  # padding steps repeat the last real state
        assert rel_err(states.trace_ssm[0, t], ref_ssm[at]) <= TOL
        assert rel_err(states.trace_conv[0, t], ref_conv[at]) <= TOL


def test_forms_agree_on_a_ragged_batch():
    """B=3 rows (one pure padding) with nonzero initial states: all forms, all rows."""
    dims = make_dims(1)
    params = random_params(dims, seed=7)
    keys = jax.random.split(jax.random.PRNGKey(8), 3)
    hidden = jax.random.normal(keys[0], (3, 70, 24))
    conv0 = jax.random.normal(keys[1], (3, dims.conv_dim, dims.conv_kernel - 1))
    ssm0 = jax.random.normal(keys[2], (3, dims.num_heads, dims.head_dim, dims.state_size))
    num_new = jnp.array([70, 0, 33])
    results = {
        f: run_mixer(params, dims, hidden, conv0, ssm0, num_new, f)
        for f in ("reference", "chunked", "steps")
    }
    ref_out, ref_states = results["reference"]
    np.testing.assert_array_equal(ref_states.ssm[1], ssm0[1])  # padding row untouched
    np.testing.assert_array_equal(ref_states.conv[1], conv0[1])
    for form in ("chunked", "steps"):
        out, states = results[form]
        for b, n in enumerate(np.asarray(num_new)):
            if n:
                assert rel_err(out[b, :n], ref_out[b, :n]) <= TOL, (form, b)
            assert rel_err(states.ssm[b], ref_states.ssm[b]) <= TOL, (form, b)
            np.testing.assert_array_equal(states.conv[b], ref_states.conv[b])


@jax.jit
def kernels_and_scans(h0, x, b, c, dt, a, d, window, inputs, weight, bias, num_valid):
    valid = jnp.arange(x.shape[0]) < num_valid
    return (
        mamba2_scan(h0, x, b, c, dt, a, d, valid),
        mamba2_chunked(h0, x, b, c, dt, a, d, num_valid, CHUNK),
        conv_scan(window, inputs, weight, bias, valid),
        conv_windowed(window, inputs, weight, bias, num_valid, CHUNK),
    )


def test_kernel_forms_match_scans_directly():
    """The chunked kernels against the recurrence scans, no mixer around them."""
    rng = np.random.default_rng(3)
    num_tokens, heads, head_dim, state, groups, channels = 150, 4, 8, 16, 2, 12
    x = jnp.asarray(rng.normal(size=(num_tokens, heads, head_dim)), jnp.float32)
    b, c = (
        jnp.asarray(rng.normal(size=(num_tokens, groups, state)), jnp.float32) for _ in range(2)
    )
    dt = jnp.asarray(rng.uniform(1e-3, 0.5, size=(num_tokens, heads)), jnp.float32)
    a = -jnp.asarray(rng.uniform(0.5, 4.0, size=heads), jnp.float32)
    d = jnp.asarray(rng.normal(size=heads), jnp.float32)
    h0 = jnp.asarray(rng.normal(size=(heads, head_dim, state)), jnp.float32)
    window = jnp.asarray(rng.normal(size=(channels, 3)), jnp.float32)
    inputs = jnp.asarray(rng.normal(size=(num_tokens, channels)), jnp.float32)
    weight = jnp.asarray(rng.normal(size=(channels, 4)), jnp.float32)
    bias = jnp.asarray(rng.normal(size=channels), jnp.float32)
    num_valid = 97
    (ys, h_final, trace), (y2, h2, chunks), (yc, wc, _), (yc2, wc2, cw) = kernels_and_scans(
        h0, x, b, c, dt, a, d, window, inputs, weight, bias, num_valid
    )
    assert rel_err(y2[:num_valid], ys[:num_valid]) <= TOL
    assert rel_err(h2, h_final) <= TOL
    assert rel_err(chunks[0], trace[CHUNK - 1]) <= TOL
    assert rel_err(chunks[1], h_final) <= TOL  # second chunk ends in padding
    assert rel_err(yc2[:num_valid], yc[:num_valid]) <= TOL
    np.testing.assert_array_equal(wc2, wc)
    np.testing.assert_array_equal(cw[0], inputs[CHUNK - 3 : CHUNK].T)


def test_unknown_form_is_rejected():
    dims = make_dims(1)
    params = random_params(dims, seed=0)
    with pytest.raises(ValueError, match="fast"):
        mamba2_mixer(
            params,
            dims,
            jnp.ones((1, 2, 24)),
            jnp.ones((1, dims.conv_dim, 3)),
            jnp.ones((1, 4, 8, 16)),
            jnp.array([2]),
            form="fast",
        )
