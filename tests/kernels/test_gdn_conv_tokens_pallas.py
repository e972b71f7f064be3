"""The GDN update on ``GdnConvTokens`` (the decode step's conv output and raw gates,
finished per head in the Pallas kernel) and with the output's gated norm in the kernel,
against the layer's tokens and the gated-norm launch."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.kernels import backend, common
from lazyspec.kernels.gdn import update as gdn_update
from lazyspec.kernels.state import dispatch as state_dispatch
from lazyspec.kernels.state import update_common as su
from lazyspec.kernels.tuning import Tuning
from tests.kernels.kernel_checks import INTERPRET, assert_close, lower_for_cuda, normal, tolerance

pytestmark = pytest.mark.pallas


# seed, batch, tokens, key heads, value heads, head width, block_heads
CONV_TOKEN_CASES = [
    (61, 2, 1, 2, 4, 8, 1),
    (62, 3, 2, 2, 4, 16, 2),
    (63, 2, 3, 1, 1, 8, 1),
    (64, 2, 2, 2, 8, 8, 2),  # two tiles in each key head's group
]


@pytest.mark.parametrize("case", CONV_TOKEN_CASES, ids=lambda c: f"conv{c[0]}")
def test_gdn_conv_tokens_match_the_layers_tokens_pallas(case):
    """``GdnConvTokens`` (the conv output, raw gates) give the kernel's outputs and states
    of the ``GdnTokens`` the GDN layer builds in jnp from the same arrays (q, k normed and
    repeated over the value heads, the gates, identity steps past ``num_new``), in both
    modes; and the layer hands them to a kernel that takes them."""
    from lazyspec.models.layers import gdn
    from lazyspec.models.layers.state_kernels import gdn_tokens

    seed, batch, tokens, num_k, num_v, width, block_heads = case
    rng = np.random.default_rng(seed)
    spec = gdn.GDNSpec(4 * width, num_k, num_v, width, width, 4, 1e-6)
    conv_out = jnp.asarray(normal(rng, batch, tokens, (2 * num_k + num_v) * width))
    a, b = (jnp.asarray(normal(rng, batch, tokens, num_v), jnp.bfloat16) for _ in range(2))
    params = {name: jnp.asarray(normal(rng, num_v), jnp.bfloat16) for name in ("A_log", "dt_bias")}
    num_new = jnp.asarray(np.arange(batch) % (tokens + 1), jnp.int32)  # 0 new tokens too
    want_tokens = gdn_tokens(*gdn._heads(spec, conv_out), *gdn._gates(params, a, b), num_new)
    finish = (params["A_log"], params["dt_bias"], num_new, num_k)
    conv = su.GdnConvTokens(conv_out, a, b, *finish)
    # Qwen3-Next's in_proj_ba: per key head, the b of its value heads then their a
    ba = su.GdnConvTokens.group_gates(b, a, num_k)
    grouped = su.GdnConvTokens.grouped(conv_out, ba, *finish)
    pool = jnp.asarray(normal(rng, batch + 2, num_v, width, width))
    slot = jnp.asarray(np.arange(batch) + 1, jnp.int32)
    for mode in su.MODES:
        run = lambda t: gdn_update.gdn_state_update_pallas(  # noqa: E731
            pool,
            slot,
            t,
            mode=mode,
            tiles=su.UpdateTiles(block_heads=block_heads),
            interpret=INTERPRET,
        )
        want = run(want_tokens)
        for form, got in (("split gates", run(conv)), ("grouped gates", run(grouped))):
            for name in ("outputs", "pool", "step_states"):
                if getattr(want, name) is not None:
                    message = f"{form} {mode} {name}"
                    assert_close(getattr(got, name), getattr(want, name), 1e-6, message)
    fits = backend.kernels_for("pallas", "gpu").gdn_state_update.takes_conv_tokens
    assert fits(128, 128) and fits(8, 8)
    assert not fits(128, 64) and not fits(96, 96)  # two widths; not a Triton block dim
    assert not backend.kernels_for("pallas", "tpu").gdn_state_update.takes_conv_tokens(128, 128)


def test_gdn_conv_tokens_check_their_shapes_pallas():
    pool, slot = jnp.zeros((3, 4, 8, 8)), jnp.asarray([1, 2], jnp.int32)
    gates = (jnp.zeros((2, 1, 4)),) * 2 + (jnp.zeros(4),) * 2 + (jnp.ones(2, jnp.int32),)
    uneven = su.GdnConvTokens(jnp.zeros((2, 1, 8 * 8 + 4)), *gates, num_k_heads=2)
    with pytest.raises(ValueError, match="heads of one width"):
        gdn_update.gdn_state_update_pallas(pool, slot, uneven, mode="decode", interpret=INTERPRET)
    tokens = su.GdnConvTokens(jnp.zeros((2, 1, 8 * 8)), *gates, num_k_heads=2)
    with pytest.raises(ValueError, match="block_heads=4 must divide 2"):
        gdn_update.gdn_state_update_pallas(
            pool,
            slot,
            tokens,
            mode="decode",
            tiles=su.UpdateTiles(block_heads=4),
            interpret=INTERPRET,
        )
    with pytest.raises(ValueError, match="only in the Triton-layout"):
        state_dispatch.state_update(pool, slot, tokens, mode="decode", kernel_backend="xla")
    split_width = su.GdnConvTokens.grouped(tokens.conv_out, *gates[1:], num_k_heads=2)
    with pytest.raises(ValueError, match=r"a \(2, 1, 4\) must be \(2, 1, 8\)"):
        gdn_update.gdn_state_update_pallas(
            pool, slot, split_width, mode="decode", interpret=INTERPRET
        )


@pytest.mark.parametrize("case", CONV_TOKEN_CASES[:3], ids=lambda c: f"conv{c[0]}")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_output_norm_in_the_update_equals_the_gated_norm_launch_pallas(case, dtype):
    """With an ``OutputNorm`` the update's outputs are the gated norm of its outputs
    (``gated_norm_pallas`` over the same z source, Qwen3-Next's layout) in the norm's dtype,
    within its tolerance over the head width, with the same states bit for bit; one launch
    where the two made two."""
    from lazyspec.kernels.norm.gated import GateLayout, gated_norm_pallas

    seed, batch, tokens, num_k, num_v, width, _ = case
    rng = np.random.default_rng(seed)
    per_key = num_v // num_k
    conv_out = jnp.asarray(normal(rng, batch, tokens, (2 * num_k + num_v) * width))
    a, b = (jnp.asarray(normal(rng, batch, tokens, num_v), jnp.bfloat16) for _ in range(2))
    gates = [jnp.asarray(normal(rng, num_v), jnp.bfloat16) for _ in range(2)]
    num_new = jnp.asarray(np.arange(batch) % (tokens + 1), jnp.int32)
    conv = su.GdnConvTokens(conv_out, a, b, *gates, num_new, num_k)
    layout = GateLayout(2 * width + 2 * per_key * width, 2 * width + per_key * width, per_key)
    z_source = jnp.asarray(normal(rng, batch, tokens, num_k * layout.group_width), dtype)
    weight = jnp.asarray(1.0 + 0.1 * normal(rng, width), dtype)
    norm = su.OutputNorm(z_source, weight, layout, 1e-6, dtype)
    pool = jnp.asarray(normal(rng, batch + 2, num_v, width, width))
    slot = jnp.asarray(np.arange(batch) + 1, jnp.int32)
    for mode in su.MODES:

        def run(tokens, mode=mode):
            return gdn_update.gdn_state_update_pallas(
                pool,
                slot,
                tokens,
                mode=mode,
                tiles=su.UpdateTiles(block_value=width),
                interpret=INTERPRET,
            )

        plain, normed = run(conv), run(dataclasses.replace(conv, norm=norm))
        want = gated_norm_pallas(
            plain.outputs.reshape(-1, num_v, width),
            z_source.reshape(batch * tokens, -1),
            layout,
            weight,
            eps=1e-6,
            dtype=dtype,
            interpret=INTERPRET,
        ).reshape(plain.outputs.shape)
        assert normed.outputs.dtype == dtype
        # the same math; compiled, Triton may order the norm's sum of squares its own way
        assert_close(normed.outputs, want, tolerance(dtype, width), f"{mode} normed outputs")
        for name in ("pool", "step_states"):
            if getattr(plain, name) is not None:
                np.testing.assert_array_equal(getattr(normed, name), getattr(plain, name))
    jaxpr = jax.make_jaxpr(lambda t: run(t).outputs)(dataclasses.replace(conv, norm=norm)).jaxpr
    assert [e.primitive.name for e in jaxpr.eqns].count("pallas_call") == 1


def test_output_norm_needs_a_program_a_head_pallas():
    """The norm reads a head's whole row: a value tile narrower than the head, several heads
    a tile, or a layout that does not fit the z source are refused."""
    from lazyspec.kernels.norm.gated import GateLayout

    width, num_k, num_v = 8, 2, 4
    conv = su.GdnConvTokens(
        jnp.zeros((2, 1, (2 * num_k + num_v) * width)),
        *(jnp.zeros((2, 1, num_v)),) * 2,
        *(jnp.zeros(num_v),) * 2,
        jnp.ones(2, jnp.int32),
        num_k,
    )
    layout = GateLayout(8 * width, 6 * width, 2)
    norm = su.OutputNorm(jnp.zeros((2, 1, 16 * width)), jnp.ones(width), layout, 1e-6, jnp.float32)
    pool, slot = jnp.zeros((3, num_v, width, width)), jnp.asarray([1, 2], jnp.int32)
    tokens = dataclasses.replace(conv, norm=norm)
    for tiles in (su.UpdateTiles(block_value=4), su.UpdateTiles(block_heads=2, block_value=8)):
        with pytest.raises(ValueError, match="a program a head"):
            gdn_update.gdn_state_update_pallas(
                pool, slot, tokens, mode="decode", tiles=tiles, interpret=INTERPRET
            )
    short = dataclasses.replace(norm, z_source=jnp.zeros((2, 1, 15 * width)))
    with pytest.raises(ValueError, match="does not place 4 gates"):
        gdn_update.gdn_state_update_pallas(
            pool, slot, dataclasses.replace(conv, norm=short), mode="decode", interpret=INTERPRET
        )
    # the dispatch gives a normed launch a whole head a program
    got = backend.kernels_for("pallas", "cpu").gdn_state_update(
        pool, slot, tokens, mode="decode", interpret=INTERPRET
    )
    assert got.outputs.dtype == jnp.float32 and got.outputs.shape == (2, 1, num_v, width)


def test_output_norm_lowers_to_triton_at_model_shapes_pallas():
    """Qwen3-Next's decode step (16 key heads, 32 value heads of 128, the gates grouped,
    z in ``in_proj_qkvz``'s output) lowers with the norm in the update through
    Pallas-Triton at a whole head a program (the dispatch's tiles), in both modes; only
    GPU-layout kernels take the norm, and only up to the switch's token count."""
    from lazyspec.kernels.norm.gated import GateLayout

    spec = jax.ShapeDtypeStruct
    batch, tokens, slot = 2, 1, spec((2,), jnp.int32)
    conv = su.GdnConvTokens.grouped(
        spec((batch, tokens, 64 * 128), jnp.float32),
        spec((batch, tokens, 64), jnp.bfloat16),
        *(spec((32,), jnp.bfloat16),) * 2,
        slot,
        16,
    )
    layout = GateLayout(2 * 128 + 4 * 128, 2 * 128 + 2 * 128, 2)  # 2 value heads a key head
    norm = su.OutputNorm(
        spec((batch, tokens, 16 * layout.group_width), jnp.bfloat16),
        spec((128,), jnp.bfloat16),
        layout,
        1e-6,
        jnp.bfloat16,
    )
    params = common.pallas_compiler_params("gpu", Tuning().gdn.norm_in_update_warps)
    for mode in su.MODES:
        text = lower_for_cuda(
            lambda p, s, t, mode=mode: (
                gdn_update.gdn_state_update_pallas(
                    p,
                    s,
                    t,
                    mode=mode,
                    tiles=su.UpdateTiles(block_value=128),
                    compiler_params=params,
                ).outputs
            ),
            spec((9, 32, 128, 128), jnp.float32),
            slot,
            dataclasses.replace(conv, norm=norm),
        )
        assert text.lower().count("triton") >= 1 and "bf16" in text

    def update(platform: str, max_tokens: int):
        tuning = Tuning().with_overrides({"gdn.norm_in_update_max_tokens": max_tokens})
        return backend.kernels_for("pallas", platform, tuning=tuning).gdn_state_update

    gpu = update("gpu", 16)
    assert backend.norms_gdn_output(gpu, 16) and not backend.norms_gdn_output(gpu, 17)
    assert not backend.norms_gdn_output(update("tpu", 16), 1)
    assert not backend.norms_gdn_output(update("gpu", 0), 1)
