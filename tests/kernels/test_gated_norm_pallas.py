"""The GDN output's gated norm (Pallas, interpret mode) against the model's ops
(``norms.gated_rms_norm`` over the gates ``GateLayout`` names), its Triton lowering, and the
backend's dispatch."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.kernels import backend
from lazyspec.kernels.norm import dispatch as norm_dispatch
from lazyspec.kernels.norm.gated import GateLayout, gated_norm_pallas
from lazyspec.kernels.tuning import Tuning
from lazyspec.models.layers.norms import gated_rms_norm
from tests.kernels.kernel_checks import INTERPRET

pytestmark = pytest.mark.pallas

# (key-head groups, value heads a group, head dim, layout): Qwen3-Next's grouped
# ``in_proj_qkvz`` (q, k, the v of the group's heads, then their z), one head a group, and
# a projection of the gates alone
LAYOUTS = {
    "qwen3_next": (2, 2, 16, GateLayout(6 * 16, 4 * 16, 2)),
    "one_a_group": (3, 1, 32, GateLayout(4 * 32, 3 * 32, 1)),
    "gates_alone": (1, 4, 16, GateLayout(4 * 16, 0, 4)),
}


def _case(rng, kind: str, tokens: int):
    groups, per_group, head_dim, layout = LAYOUTS[kind]
    source = jnp.asarray(rng.standard_normal((tokens, groups * layout.group_width)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((tokens, groups * per_group, head_dim)), jnp.float32)
    weight = jnp.asarray(rng.standard_normal(head_dim), jnp.bfloat16)
    return x, source, layout, weight


def _columns(layout: GateLayout, head: int, head_dim: int) -> slice:
    """Head ``head``'s gate columns, by the layout's definition."""
    group, slot = divmod(head, layout.heads_per_group)
    start = group * layout.group_width + layout.offset + slot * head_dim
    return slice(start, start + head_dim)


@pytest.mark.parametrize("kind", list(LAYOUTS))
@pytest.mark.parametrize("tokens", [1, 3])
def test_gated_norm_equals_the_model_ops_pallas(kind, tokens):
    x, source, layout, weight = _case(np.random.default_rng(tokens), kind, tokens)
    num_heads, head_dim = x.shape[1:]
    z = np.stack(
        [np.asarray(source)[:, _columns(layout, i, head_dim)] for i in range(num_heads)], 1
    )
    np.testing.assert_array_equal(np.asarray(layout.gather(source, num_heads, head_dim)), z)
    want = gated_rms_norm(x.astype(jnp.bfloat16), jnp.asarray(z), weight, 1e-6)
    got = gated_norm_pallas(
        x, source, layout, weight, eps=1e-6, dtype=jnp.bfloat16, interpret=INTERPRET
    )
    assert got.dtype == want.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_gated_norm_rejects_mismatched_inputs():
    x, source, layout, weight = _case(np.random.default_rng(0), "qwen3_next", 2)
    launch = functools.partial(gated_norm_pallas, eps=1e-6, dtype=jnp.bfloat16, interpret=INTERPRET)
    with pytest.raises(ValueError, match="must be \\[N, H, d\\]"):
        launch(x[0], source, layout, weight)
    with pytest.raises(ValueError, match="weight"):
        launch(x, source, layout, weight[:8])
    with pytest.raises(ValueError, match="does not place"):
        launch(x, source[:, :-16], layout, weight)
    with pytest.raises(ValueError, match="does not place"):
        launch(x, source, layout._replace(offset=5 * 16), weight)
    odd = layout._replace(group_width=6 * 16 + 8, offset=4 * 16 + 8)
    with pytest.raises(ValueError, match="multiples of d=16"):
        launch(x, jnp.zeros((2, 2 * odd.group_width), jnp.bfloat16), odd, weight)


def test_gated_norm_lowers_to_one_triton_call_at_qwen3_next_widths():
    """The CUDA lowering (built on CPU, not compiled) at Qwen3-Next's widths (32 value heads
    of 128 in 16 key-head groups of ``in_proj_qkvz``) is one Triton call."""
    from lazyspec.kernels.common import pallas_compiler_params

    layout = GateLayout(768, 512, 2)
    launch = functools.partial(
        gated_norm_pallas,
        layout=layout,
        eps=1e-6,
        dtype=jnp.bfloat16,
        compiler_params=pallas_compiler_params("gpu", num_warps=1),
    )
    spec = jax.ShapeDtypeStruct
    args = (
        spec((4, 32, 128), jnp.float32),
        spec((4, 16 * 768), jnp.bfloat16),
    )
    weight = spec((128,), jnp.bfloat16)
    fn = jax.jit(lambda x, source, w: launch(x, source, weight=w))
    text = fn.trace(*args, weight).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1


LIMIT = Tuning().norm.gated_max_tokens


@pytest.mark.parametrize("tokens,shift", [(LIMIT, 0), (LIMIT + 1, 0), (2, 8)])
def test_dispatch_runs_the_kernel_where_it_fits(tokens, shift):
    """Up to ``NormTuning.gated_max_tokens`` tokens with the gates in whole blocks of d, the
    backend's launch; else (or with the gates ``shift`` columns off the blocks) the
    caller's form (called once, its result returned)."""
    x, source, layout, weight = _case(np.random.default_rng(4), "qwen3_next", tokens)
    layout = GateLayout(layout.group_width + shift, layout.offset + shift, 2)
    source = np.random.default_rng(5).standard_normal((tokens, 2 * layout.group_width))
    source = jnp.asarray(source, jnp.bfloat16)
    fits = tokens <= LIMIT and shift == 0
    calls = []

    def xla_form():
        calls.append(tokens)
        z = layout.gather(source, *x.shape[1:])
        return gated_rms_norm(x.astype(jnp.bfloat16), z, weight, 1e-6)

    gated = backend.kernels_for("pallas", "cpu").gated_norm
    got = gated(x, source, layout, weight, eps=1e-6, dtype=jnp.bfloat16, xla_form=xla_form)
    assert calls == ([] if fits else [tokens])
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(xla_form(), np.float32))
    assert backend.kernels_for("xla", "cpu").gated_norm is None
    assert backend.kernels_for("pallas", "tpu").gated_norm is None


@pytest.mark.parametrize("head_dim,compiled", [(16, True), (24, False)])
def test_compiled_dispatch_needs_a_power_of_two_head(monkeypatch, head_dim, compiled):
    """Compiled (as on a GPU), the dispatch launches for heads a power of two wide, else it
    runs the caller's form."""
    layout = GateLayout(4 * head_dim, 2 * head_dim, 2)
    x = jnp.zeros((2, 4, head_dim), jnp.float32)
    source = jnp.zeros((2, 2 * layout.group_width), jnp.bfloat16)
    launched = []
    monkeypatch.setattr(
        norm_dispatch, "pallas_options", lambda *a: {"interpret": False, "compiler_params": None}
    )
    monkeypatch.setattr(
        norm_dispatch, "gated_norm_pallas", lambda *a, **k: launched.append(1) or "kernel"
    )
    gated = backend.kernels_for("pallas", "cpu").gated_norm
    got = gated(
        x, source, layout, jnp.ones(head_dim), eps=1e-6, dtype=jnp.bfloat16, xla_form=lambda: "xla"
    )
    assert got == ("kernel" if compiled else "xla") and len(launched) == int(compiled)
