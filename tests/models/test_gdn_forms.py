"""The three GDN forms agree: token-by-token reference, chunked prefill, T-step update.

Random layer params (scale large enough that the gates and the delta rule matter), random
inputs and random initial states; ragged rows and states at chunk boundaries and after
every step, from arbitrary offsets. Outputs and states agree to 1e-5 relative to
max(1, max |reference|). One head decays fast (|cumulative log decay| in the hundreds over a
chunk), the regime where a chunked form that subtracts cumulative sums loses precision.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lazyspec.kernels.gdn.chunked import conv_chunked, gdn_chunked
from lazyspec.kernels.gdn.reference import gdn_scan, l2_normalize
from lazyspec.kernels.state.conv import conv_scan
from lazyspec.models.layers.gdn import GDNSpec, gdn_mixer, gdn_plan
from lazyspec.models.plan import init_plan

SPEC = GDNSpec(
    hidden_size=24,
    num_k_heads=2,
    num_v_heads=4,
    head_k_dim=8,
    head_v_dim=16,
    conv_kernel=4,
    norm_eps=1e-6,
)
NUM_TOKENS = 160  # two full 64-token chunks and a partial one
NUM_STEPS = 5  # verify width D
TOL = 1e-5


def _err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(
        np.max(np.abs(got - want), initial=0.0) / max(1.0, np.max(np.abs(want), initial=0.0))
    )


@functools.cache
def _params(seed: int = 0):
    params = init_plan(gdn_plan("gdn", SPEC), jax.random.key(seed), jnp.float32, scale=0.3)
    # spread decays from slow to fast so both short and long memory are exercised
    params["A_log"] = jnp.log(jnp.array([0.05, 0.3, 1.0, 3.0], jnp.float32))
    return params


def _inputs(seed: int, batch: int, num_tokens: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, num_tokens, SPEC.hidden_size)).astype(np.float32)
    conv0 = rng.standard_normal((batch, SPEC.conv_dim, SPEC.conv_kernel - 1)).astype(np.float32)
    ssm0 = rng.standard_normal((batch, SPEC.num_v_heads, SPEC.head_k_dim, SPEC.head_v_dim))
    return jnp.asarray(x), jnp.asarray(conv0), jnp.asarray(ssm0.astype(np.float32))


@functools.partial(jax.jit, static_argnames=("form",))
def _run_jit(params, x, conv0, ssm0, num_new, form):
    return gdn_mixer(params, SPEC, x, conv0, ssm0, num_new, form=form, chunk_size=64)


def _numpy(tree):
    """Device results -> numpy once, so slicing them below compiles nothing."""
    return jax.tree.map(np.asarray, tree)


def _run(*args, form):
    return _numpy(_run_jit(*args, form=form))


@settings(max_examples=10, deadline=None)
# inputs whose fast-decay head drives the cumulative log decay of a chunk into the hundreds
@example(seed=70268272, len_a=1, len_b=126)
@example(seed=56, len_a=64, len_b=0)
@given(
    seed=st.integers(0, 2**31 - 1),
    len_a=st.integers(0, NUM_TOKENS),
    len_b=st.integers(0, NUM_TOKENS),
)
def test_chunked_matches_reference(seed, len_a, len_b):
    params = _params()
    x, conv0, ssm0 = _inputs(seed, 2, NUM_TOKENS)
    num_new = jnp.array([len_a, len_b], jnp.int32)
    ref_out, ref = _run(params, x, conv0, ssm0, num_new, form="reference")
    out, got = _run(params, x, conv0, ssm0, num_new, form="chunked")
    x, conv0, ssm0 = _numpy((x, conv0, ssm0))
    assert got.conv_trace.shape == (2, NUM_TOKENS // 64, SPEC.conv_dim, 3)
    assert got.ssm_trace.shape == (2, NUM_TOKENS // 64, 4, 8, 16)
    for row, n in enumerate((len_a, len_b)):
        assert _err(out[row, :n], ref_out[row, :n]) <= TOL
        assert _err(got.ssm[row], ref.ssm[row]) <= TOL
        assert _err(got.conv[row], ref.conv[row]) <= TOL
        for j in range(NUM_TOKENS // 64):
            # state after min((j+1)*64, n) tokens; the initial state when n == 0
            t = min((j + 1) * 64, n) - 1
            want_ssm = ssm0[row] if t < 0 else ref.ssm_trace[row, t]
            want_conv = conv0[row] if t < 0 else ref.conv_trace[row, t]
            assert _err(got.ssm_trace[row, j], want_ssm) <= TOL
            assert _err(got.conv_trace[row, j], want_conv) <= TOL
    # a state that was never written stays bit-identical
    for row, n in enumerate((len_a, len_b)):
        if n == 0:
            assert np.array_equal(got.ssm[row], ssm0[row])
            assert np.array_equal(got.conv[row], conv0[row])


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    offset=st.integers(0, NUM_TOKENS - NUM_STEPS),
    num_steps=st.integers(1, NUM_STEPS),
)
def test_step_form_resumes_at_any_offset(seed, offset, num_steps):
    """Verify/decode form started from the reference state after ``offset`` tokens gives
    the reference's outputs and per-step states (and leaves padded steps untouched)."""
    params = _params()
    x, conv0, ssm0 = _numpy(_inputs(seed, 1, NUM_TOKENS))
    full = jnp.array([NUM_TOKENS], jnp.int32)
    ref_out, ref = _run(params, x, conv0, ssm0, full, form="reference")
    start_conv = conv0 if offset == 0 else ref.conv_trace[:, offset - 1]
    start_ssm = ssm0 if offset == 0 else ref.ssm_trace[:, offset - 1]
    window = x[:, offset : offset + NUM_STEPS]
    out, got = _run(
        params, window, start_conv, start_ssm, jnp.array([num_steps], jnp.int32), form="steps"
    )
    end = offset + num_steps
    assert _err(out[0, :num_steps], ref_out[0, offset:end]) <= TOL
    assert _err(got.ssm_trace[0, :num_steps], ref.ssm_trace[0, offset:end]) <= TOL
    assert _err(got.conv_trace[0, :num_steps], ref.conv_trace[0, offset:end]) <= TOL
    assert _err(got.ssm[0], ref.ssm_trace[0, end - 1]) <= TOL
    for t in range(num_steps, NUM_STEPS):  # padded steps repeat the last real state
        assert np.array_equal(got.ssm_trace[0, t], got.ssm[0])


def _kernel_inputs(seed: int, num_tokens: int, heads: int, d_k: int, d_v: int, decay_scale):
    rng = np.random.default_rng(seed)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    q = l2_normalize(f32(rng.standard_normal((num_tokens, heads, d_k)))) * d_k**-0.5
    k = l2_normalize(f32(rng.standard_normal((num_tokens, heads, d_k))))
    v = f32(rng.standard_normal((num_tokens, heads, d_v)))
    g = -f32(rng.uniform(0, 1, (num_tokens, heads)) * np.asarray(decay_scale))
    beta = f32(rng.uniform(0, 1, (num_tokens, heads)))
    h0 = f32(rng.standard_normal((heads, d_k, d_v)))
    return h0, q, k, v, g, beta


_chunked_jit = jax.jit(gdn_chunked)
_conv_jit = jax.jit(functools.partial(conv_chunked, bias=None))
_gdn_scan_jit = jax.jit(gdn_scan)
_conv_scan_jit = jax.jit(functools.partial(conv_scan, bias=None))


def _chunked_kernel(*args):
    return _numpy(_chunked_jit(*args))


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), num_valid=st.integers(0, NUM_TOKENS))
def test_chunked_kernels_match_scans(seed, num_valid):
    """Kernel level: outputs, final and per-chunk states of a ragged row, nonzero h0."""
    h0, q, k, v, g, beta = _kernel_inputs(seed, NUM_TOKENS, 4, 8, 16, [0.01, 0.3, 3.0, 20.0])
    valid = jnp.arange(NUM_TOKENS) < num_valid
    ref_out, ref_final, ref_states = _numpy(_gdn_scan_jit(h0, q, k, v, g, beta, valid))
    out, final, chunks = _chunked_kernel(h0, q, k, v, g, beta, num_valid)
    assert _err(out[:num_valid], ref_out[:num_valid]) <= TOL
    assert _err(final, ref_final) <= TOL
    ends = [min((j + 1) * 64, num_valid) - 1 for j in range(NUM_TOKENS // 64)]
    for j, t in enumerate(ends):
        assert _err(chunks[j], h0 if t < 0 else ref_states[t]) <= TOL

    rng = np.random.default_rng(seed + 1)
    window0 = jnp.asarray(rng.standard_normal((12, 3)), jnp.float32)
    xs = jnp.asarray(rng.standard_normal((NUM_TOKENS, 12)), jnp.float32)
    weight = jnp.asarray(rng.standard_normal((12, 4)), jnp.float32)
    ref_y, ref_window, ref_windows = _numpy(_conv_scan_jit(window0, xs, weight, valid=valid))
    y, window, windows = _numpy(_conv_jit(window0, xs, weight, num_valid=num_valid))
    assert _err(y[:num_valid], ref_y[:num_valid]) <= TOL
    assert np.array_equal(window, ref_window)
    for j, t in enumerate(ends):
        assert np.array_equal(windows[j], window0 if t < 0 else ref_windows[t])


def test_chunked_kernel_on_exact_chunks_and_fast_decay():
    """The kernel alone, T an exact multiple of the chunk, decays from ~1 to ~exp(-30)."""
    h0, q, k, v, g, beta = _kernel_inputs(7, 128, 3, 16, 8, [1e-3, 0.5, 30.0])
    ref_out, ref_final, ref_states = _numpy(_gdn_scan_jit(h0, q, k, v, g, beta))
    out, final, chunks = _chunked_kernel(h0, q, k, v, g, beta, 128)
    assert _err(out, ref_out) <= TOL
    assert _err(final, ref_final) <= TOL
    assert _err(chunks, ref_states[[63, 127]]) <= TOL
    assert _err(final, h0) > 0.1  # the inputs really moved the state
