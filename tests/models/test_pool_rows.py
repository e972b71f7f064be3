"""Verify from a ``PoolView`` (the engine's decode step: the slot pools themselves, row b at
slot[b], read in place by the Pallas update) equals verify from the gathered ``StateRows``,
for both families and both kernel backends (Pallas in interpret mode)."""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.kernels.backend import XLA_KERNELS, kernels_for
from lazyspec.kernels.state.dispatch import state_update
from lazyspec.kernels.tuning import Tuning
from lazyspec.models.config import RECURRENT
from lazyspec.models.interface import ForwardInputs, PoolRows, PoolView, StateRows, StepStates
from lazyspec.models.layers.norms import residual_rms_norm
from lazyspec.models.model import empty_caches
from lazyspec.testing.tiny_models import tiny_model
from tests.kernels.kernel_checks import as_one_program, launch_names

WIDTH, CONTEXT, SLOTS = 4, 8, 6


def _verify_inputs(rng, vocab: int, num_new: list[int]) -> ForwardInputs:
    rows = len(num_new)
    start = CONTEXT - WIDTH
    positions = np.tile(start + np.arange(WIDTH, dtype=np.int32), (rows, 1))
    kv_rows = 1 + np.arange(rows)[:, None] * CONTEXT + np.arange(CONTEXT)[None, :]
    valid = np.arange(WIDTH)[None, :] < np.asarray(num_new)[:, None]
    write = np.where(valid, kv_rows[:, start:], 2**30)
    return ForwardInputs(
        tokens=jnp.asarray(rng.integers(0, vocab, (rows, WIDTH)), jnp.int32),
        positions=jnp.asarray(positions),
        num_new=jnp.asarray(num_new, jnp.int32),
        kv_write_idx=jnp.asarray(write, jnp.int32),
        kv_read_idx=jnp.asarray(kv_rows, jnp.int32),
        ctx_len=jnp.asarray(start + np.asarray(num_new), jnp.int32),
    )


@pytest.mark.parametrize("backend", ["xla", "pallas"])
@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_verify_from_pools_equals_gathered_rows_pallas(family, backend):
    model = tiny_model(family)
    cfg, fam, kernels = model.config, model.family, kernels_for(backend)
    rng = np.random.default_rng(11)
    num_new = [WIDTH, 0, WIDTH]  # row 1 is padding, on the null slot
    slot = jnp.asarray([5, 0, 2], jnp.int32)
    kv, rows_rec = empty_caches(cfg, 1 + len(num_new) * CONTEXT, SLOTS + 1, jnp.float32)
    kv = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.1, x.dtype), kv)
    pools = jax.tree.map(
        lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.1, x.dtype), rows_rec
    )  # [L, SLOTS + 1, ...]
    inputs = _verify_inputs(rng, cfg.vocab_size, num_new)
    in_place = PoolView(conv_pool=pools.conv, ssm_pool=pools.ssm, slot=slot)
    gathered = StateRows(conv=pools.conv[:, slot], ssm=pools.ssm[:, slot])
    conv0, ssm0 = in_place.layer(0)
    assert isinstance(ssm0, PoolRows)
    np.testing.assert_array_equal(np.asarray(conv0), np.asarray(gathered.conv[0]))
    np.testing.assert_array_equal(np.asarray(ssm0.rows()), np.asarray(gathered.ssm[0]))

    def run(rec):
        return jax.jit(
            lambda r: fam.forward(model.params, cfg, inputs, kv, r, mode="verify", kernels=kernels)
        )(rec)

    hidden, kv_out, out = run(in_place)
    want_hidden, want_kv, want = run(gathered)
    assert isinstance(out.final, StateRows) and out.chunks is None  # final rows are gathered
    assert isinstance(out.steps, StepStates) and len(out.steps.ssm) == len(cfg.recurrent_layer_ids)
    np.testing.assert_allclose(np.asarray(hidden), np.asarray(want_hidden), atol=1e-6)
    for got_steps, want_steps in zip(
        out.steps.ssm + out.steps.conv, want.steps.ssm + want.steps.conv
    ):
        np.testing.assert_allclose(np.asarray(got_steps), np.asarray(want_steps), atol=1e-6)
    for name in ("conv", "ssm"):  # the padding row's final state is its (null-slot) start
        np.testing.assert_allclose(
            np.asarray(getattr(out.final, name)), np.asarray(getattr(want.final, name)), atol=1e-6
        )
    for a, b in zip(jax.tree.leaves(kv_out), jax.tree.leaves(want_kv)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_forward_calls_the_state_update_it_is_given(family):
    """The recurrent layers run the state update of the ``Kernels`` they are handed (here the
    XLA form behind a recorder), once per layer, on the pool rows in place."""
    model = tiny_model(family)
    cfg = model.config
    rng = np.random.default_rng(12)
    kv, pools = empty_caches(cfg, 1 + 2 * CONTEXT, SLOTS + 1, jnp.float32)
    calls = []

    def update(pool, slot, tokens, *, mode, layer=None):
        calls.append((mode, layer, pool.shape[1]))
        return state_update(pool, slot, tokens, mode=mode, layer=layer, kernel_backend="xla")

    kernels = dataclasses.replace(XLA_KERNELS, gdn_state_update=update, mamba2_state_update=update)
    rec = PoolView(conv_pool=pools.conv, ssm_pool=pools.ssm, slot=jnp.asarray([3, 1], jnp.int32))
    inputs = _verify_inputs(rng, cfg.vocab_size, [WIDTH, 2])
    # one program, as a step runs it: op by op, each of its small ops compiles on its own
    forward = as_one_program(model.family.forward)
    forward(model.params, cfg, inputs, kv, rec, mode="verify", kernels=kernels)
    num_rec = len(cfg.recurrent_layer_ids)
    assert calls == [("verify", layer, SLOTS + 1) for layer in range(num_rec)]


def _verify_forward(seed: int):
    """Tiny Qwen3-Next's config and a function running its verify forward (two rows of
    ``WIDTH`` and 2 tokens over empty pools) with the ``Kernels`` it is given."""
    model = tiny_model("qwen3_next")
    cfg = model.config
    rng = np.random.default_rng(seed)
    kv, pools = empty_caches(cfg, 1 + 2 * CONTEXT, SLOTS + 1, jnp.float32)
    rec = PoolView(conv_pool=pools.conv, ssm_pool=pools.ssm, slot=jnp.asarray([3, 1], jnp.int32))
    inputs = _verify_inputs(rng, cfg.vocab_size, [WIDTH, 2])

    def run(kernels):
        out = model.family.forward(
            model.params, cfg, inputs, kv, rec, mode="verify", kernels=kernels
        )
        return np.asarray(out[0])

    return cfg, run


def test_forward_uses_the_residual_norm_it_is_given():
    """Every Qwen3-Next layer hands its mixer's output to ``Kernels.residual_norm`` (with the
    router where the MLP is a MoE), and every GDN layer its input (with the fused gate
    projection ``in_proj_ba`` as the router, rounded to its dtype); with
    ``NormTuning.mlp_output_in_next_norm`` each layer after the first hands its input norm the
    previous layer's MLP output as the delta (an attention layer's input norm becomes the
    launch's). Each runs on what the launch returns: the XLA form behind a recorder gives
    the XLA forward's output exactly; an altered residual, altered router logits or altered
    gates change it."""
    cfg, run = _verify_forward(13)
    gdn, moe = cfg.arch.gdn, cfg.arch.moe
    adds = Tuning().norm.mlp_output_in_next_norm
    want = []  # (part, no delta, router shape) in call order
    for i, (role, kind) in enumerate(zip(cfg.layer_roles, cfg.arch.mlp_kinds)):
        delta_in = adds and i > 0
        if role == RECURRENT:
            want.append(("gates", not delta_in, (2 * gdn.num_v_heads, cfg.hidden_size)))
        elif delta_in:
            want.append(("input", False, None))
        moe_layer = kind == "moe"
        router = (moe.num_experts, cfg.hidden_size) if moe_layer else None
        want.append(("moe" if moe_layer else "mlp", False, router))
    parts = [w[0] for w in want]
    assert "moe" in parts and "gates" in parts and ("input" in parts) == adds

    def recorder(alter=lambda r, part: r):
        calls = []

        def fused(
            x, delta, weight, router=None, *, eps, zero_centered, xla_form, logits_dtype=jnp.float32
        ):
            part = parts[len(calls)] if len(calls) < len(parts) else None
            calls.append((part, delta is None, None if router is None else router.shape))
            assert zero_centered and x.shape == (2 * WIDTH, cfg.hidden_size)
            assert delta is None or delta.shape == x.shape
            assert logits_dtype == (router.dtype if part == "gates" else jnp.float32)
            return alter(xla_form(), part)

        return dataclasses.replace(XLA_KERNELS, residual_norm=fused), calls

    kernels, calls = recorder()
    np.testing.assert_array_equal(run(kernels), run(XLA_KERNELS))
    assert calls == want
    alters = [
        lambda r, part: r._replace(residual=r.residual + 1.0) if part in ("moe", "mlp") else r,
        lambda r, part: r._replace(logits=-r.logits) if part == "moe" else r,
        lambda r, part: r._replace(logits=r.logits + 1.0) if part == "gates" else r,
    ]
    if adds:  # the attention layer's input norm: its residual goes on to the layer
        alters.append(
            lambda r, part: r._replace(residual=r.residual + 1.0) if part == "input" else r
        )
    for alter in alters:
        assert not np.allclose(run(recorder(alter)[0]), run(XLA_KERNELS))


def test_forward_uses_the_gated_norm_it_is_given():
    """Every Qwen3-Next GDN layer hands its outputs, the fused projection and the gates'
    layout to ``Kernels.gated_norm`` and runs on what it returns: the XLA form behind a
    recorder gives the XLA forward's output exactly; an altered norm changes it."""
    cfg, run = _verify_forward(16)
    gdn = cfg.arch.gdn

    def recorder(alter=lambda out: out):
        calls = []

        def gated(x, z_source, layout, weight, *, eps, dtype, xla_form):
            assert x.shape == (2 * WIDTH, gdn.num_v_heads, gdn.head_v_dim)
            assert z_source.shape[0] == 2 * WIDTH and layout.heads_per_group == gdn.heads_per_key
            calls.append(weight.shape)
            return alter(xla_form())

        return dataclasses.replace(XLA_KERNELS, gated_norm=gated), calls

    kernels, calls = recorder()
    np.testing.assert_array_equal(run(kernels), run(XLA_KERNELS))
    num_gdn = len(cfg.recurrent_layer_ids)
    assert calls == [(gdn.head_v_dim,)] * num_gdn and calls
    assert not np.allclose(run(recorder(lambda out: out * 2)[0]), run(XLA_KERNELS))


@pytest.mark.parametrize("backend", ["xla", "pallas"])
@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h", "granitemoehybrid"])
def test_decode_from_pools_writes_in_place_pallas(family, backend):
    """Decode from a ``PoolView`` writes each row's new state into the pools at its slot (ssm
    and conv, every recurrent layer) and returns them as ``RecurrentOut.pools``: the
    written rows equal decode's final state from the gathered ``StateRows``, the hidden
    states are the same, and every other slot is bit-identical: the null slot too (zero, as
    the engine keeps it), which row 1 reads with a token of its own (so its new state
    differs) and must not write. No final rows and no per-position states are returned."""
    model = tiny_model(family)
    cfg, fam, kernels = model.config, model.family, kernels_for(backend)
    rng = np.random.default_rng(13)
    num_new = [1, 1, 1]
    slot = jnp.asarray([5, 0, 2], jnp.int32)
    kv, rows_rec = empty_caches(cfg, 1 + len(num_new) * CONTEXT, SLOTS + 1, jnp.float32)
    kv = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.1, x.dtype), kv)
    pools = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.1, x.dtype), rows_rec)
    # the null slot zero, as the engine keeps it (a decode step's padding rows need not read it)
    pools = jax.tree.map(lambda x: x.at[:, 0].set(0.0), pools)
    inputs = _verify_inputs(rng, cfg.vocab_size, num_new)
    inputs = dataclasses.replace(
        inputs,
        tokens=inputs.tokens[:, :1],
        positions=inputs.positions[:, :1],
        kv_write_idx=inputs.kv_write_idx[:, :1],
        ctx_len=inputs.positions[:, 0] + jnp.asarray(num_new),
    )

    def run(rec):
        return jax.jit(
            lambda r: fam.forward(model.params, cfg, inputs, kv, r, mode="decode", kernels=kernels)
        )(rec)

    hidden, _, out = run(PoolView(conv_pool=pools.conv, ssm_pool=pools.ssm, slot=slot))
    want_hidden, _, want = run(StateRows(conv=pools.conv[:, slot], ssm=pools.ssm[:, slot]))
    assert out.final is None and out.steps is None and out.chunks is None
    assert isinstance(out.pools, PoolView) and isinstance(want.final, StateRows)
    # pallas: the pools' decode runs the conv kernel, the rows' the jnp conv scan (float32
    # rounding of the silu apart: up to 1.3e-6 on outputs of order 1, seen on a 2-core CPU)
    np.testing.assert_allclose(np.asarray(hidden), np.asarray(want_hidden), rtol=1e-5, atol=4e-6)
    written = np.asarray([0, 2])  # the rows on real slots
    others = np.setdiff1d(np.arange(SLOTS + 1), np.asarray(slot)[written])
    assert 0 in others
    for name in ("conv", "ssm"):
        new = np.asarray(getattr(out.pools, f"{name}_pool"))
        old = np.asarray(getattr(pools, name))
        final = np.asarray(getattr(want.final, name))
        assert new.shape == old.shape and not np.allclose(new[:, 5], old[:, 5])
        got = new[:, np.asarray(slot)[written]]
        np.testing.assert_allclose(got, final[:, written], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(new[:, others], old[:, others])


def test_gdn_layers_hand_conv_tokens_where_the_kernel_takes_them_pallas():
    """A GDN layer decoding from the pools asks its update's ``takes_conv_tokens`` (the
    kernel's own rule: ``gdn.update.conv_tokens_fit``) with its head widths, and hands
    ``GdnConvTokens`` only where the answer is yes, ``GdnTokens`` otherwise; both decode the
    same. A head width Triton cannot lower (not a power of two) is a no."""
    model = tiny_model("qwen3_next")
    cfg, spec = model.config, model.config.arch.gdn
    kv, pools = random_kv_and_pools(np.random.default_rng(14), cfg, 2)
    inputs = first_tokens(_verify_inputs(np.random.default_rng(15), cfg.vocab_size, [1, 1]))
    rec = PoolView(conv_pool=pools.conv, ssm_pool=pools.ssm, slot=jnp.asarray([3, 1], jnp.int32))
    pallas = kernels_for("pallas")
    outputs = {}
    for answer in (True, False):
        asked, handed = [], []

        def update(pool, slot, tokens, handed=handed, **options):
            handed.append(type(tokens).__name__)
            return pallas.gdn_state_update(pool, slot, tokens, **options)

        update.takes_conv_tokens = lambda k, v: asked.append((k, v)) or answer  # noqa: B023
        kernels = dataclasses.replace(pallas, gdn_state_update=update)
        out = model.family.forward(
            model.params, cfg, inputs, kv, rec, mode="decode", kernels=kernels
        )
        outputs[answer] = np.asarray(out[0])
        num_gdn = len(cfg.recurrent_layer_ids)
        assert asked == [(spec.head_k_dim, spec.head_v_dim)] * num_gdn
        assert handed == ["GdnConvTokens" if answer else "GdnTokens"] * num_gdn
    np.testing.assert_allclose(outputs[True], outputs[False], rtol=1e-5, atol=4e-6)
    fits = pallas.gdn_state_update.takes_conv_tokens
    assert fits(spec.head_k_dim, spec.head_k_dim) and not fits(96, 96)


def random_kv_and_pools(rng, cfg, rows: int):
    """KV pools for ``rows`` rows of CONTEXT positions and recurrent pools of SLOTS + 1 slots,
    random (scale 0.1)."""
    kv, pools = empty_caches(cfg, 1 + rows * CONTEXT, SLOTS + 1, jnp.float32)
    noise = lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.1, x.dtype)  # noqa: E731
    return jax.tree.map(noise, kv), jax.tree.map(noise, pools)


def first_tokens(inputs: ForwardInputs) -> ForwardInputs:
    """A decode step of ``inputs``: each row's first token (none where it had none)."""
    return dataclasses.replace(
        inputs,
        tokens=inputs.tokens[:, :1],
        positions=inputs.positions[:, :1],
        kv_write_idx=inputs.kv_write_idx[:, :1],
        num_new=jnp.minimum(inputs.num_new, 1),
    )


def step_eqns(jaxpr):
    """The equations of ``jaxpr`` and of the jaxprs nested in it, a Pallas launch's kernel
    excepted (the launch is one equation)."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name == "pallas_call":
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from step_eqns(sub)


def _launch_names(jaxpr) -> list[str]:
    """The Pallas launches' names in ``jaxpr`` and the jaxprs nested in it."""
    return launch_names(step_eqns(jaxpr))


def test_gdn_norm_in_the_state_update_gives_the_same_decode_pallas():
    """Up to ``GdnTuning.norm_in_update_max_tokens`` tokens the GDN layers hand their
    output's gated norm to the state update's launch (``OutputNorm``): the decode from the
    pools gives the same hidden states and pools bit for bit, and the step has no gated-norm
    launch left; a step of more tokens keeps the norm's own launch."""
    model = tiny_model("qwen3_next")
    cfg, fam = model.config, model.family
    rng = np.random.default_rng(17)
    slot = jnp.asarray([5, 0, 2], jnp.int32)
    kv, pools = random_kv_and_pools(rng, cfg, 3)
    inputs = _verify_inputs(rng, cfg.vocab_size, [1, 1, 1])
    inputs = dataclasses.replace(
        inputs,
        tokens=inputs.tokens[:, :1],
        positions=inputs.positions[:, :1],
        kv_write_idx=inputs.kv_write_idx[:, :1],
        ctx_len=inputs.positions[:, 0] + 1,
    )
    view = PoolView(conv_pool=pools.conv, ssm_pool=pools.ssm, slot=slot)
    results, launches = {}, {}
    for fused in (False, True):  # the step's 3 tokens over the limit of 2, then within 3
        tuning = Tuning().with_overrides({"gdn.norm_in_update_max_tokens": 3 if fused else 2})
        kernels = kernels_for("pallas", tuning=tuning)

        def step(r, k=kernels):
            return fam.forward(model.params, cfg, inputs, kv, r, mode="decode", kernels=k)

        results[fused] = jax.jit(step)(view)
        launches[fused] = collections.Counter(_launch_names(jax.make_jaxpr(step)(view).jaxpr))
    (hidden, _, out), (want_hidden, _, want) = results[True], results[False]
    np.testing.assert_array_equal(np.asarray(hidden), np.asarray(want_hidden))
    for name in ("conv_pool", "ssm_pool"):
        np.testing.assert_array_equal(getattr(out.pools, name), getattr(want.pools, name))
    num_gdn = len(cfg.recurrent_layer_ids)
    assert launches[False]["gated_norm"] == num_gdn and "gated_norm" not in launches[True]
    assert sum(launches[False].values()) == sum(launches[True].values()) + num_gdn


@pytest.mark.parametrize("mode", ["decode", "verify", "extend"])
def test_mlp_output_added_in_the_next_norm_gives_the_same_forward_pallas(mode):
    """With ``NormTuning.mlp_output_in_next_norm`` each Qwen3-Next layer leaves its MLP output
    for the next layer's input norm launch to add (the residual-norm launch's delta; an
    attention layer's input norm becomes that launch): the same hidden states, KV pools
    and states bit for bit, one residual-norm launch more per attention layer after the
    first layer, and the last layer's output added after the loop."""
    model = tiny_model("qwen3_next")
    cfg, fam = model.config, model.family
    rng = np.random.default_rng(19)
    slot = jnp.asarray([5, 0, 2], jnp.int32)
    kv, pools = random_kv_and_pools(rng, cfg, 3)
    inputs = _verify_inputs(rng, cfg.vocab_size, [WIDTH, 1, 3])
    rec = StateRows(conv=pools.conv[:, slot], ssm=pools.ssm[:, slot])
    if mode == "decode":
        inputs = first_tokens(inputs)
        rec = PoolView(conv_pool=pools.conv, ssm_pool=pools.ssm, slot=slot)
    results, launches = {}, {}
    for apart in (False, True):
        tuning = Tuning().with_overrides({"norm.mlp_output_in_next_norm": apart})
        kernels = kernels_for("pallas", tuning=tuning)

        def step(r, k=kernels):
            return fam.forward(model.params, cfg, inputs, kv, r, mode=mode, chunk_size=4, kernels=k)

        results[apart] = jax.jit(step)(rec)
        launches[apart] = collections.Counter(_launch_names(jax.make_jaxpr(step)(rec).jaxpr))
    got, want = (jax.tree.leaves(results[apart]) for apart in (True, False))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    later = [i for i, role in enumerate(cfg.layer_roles) if i and role != RECURRENT]
    assert later  # the tiny model has an attention layer after the first
    assert launches[True]["residual_norm"] == launches[False]["residual_norm"] + len(later)


def test_forward_hands_the_output_projection_in_parts():
    """With ``NormTuning.output_parts`` every Qwen3-Next mixer (GDN ``out_proj``, attention
    ``o_proj``) of up to ``output_parts_max_tokens`` tokens hands the residual-norm launch
    after it that many float32 partial sums of its output projection: the XLA form and the
    Pallas launch (interpret mode) sum them and give the forward without parts to float32
    rounding; a part left out changes it. The defaults: parts at two tokens (a batch-1
    decode step), none at three."""
    norm_kernels = kernels_for("pallas", "cpu")
    assert norm_kernels.output_parts(2, 64) == Tuning().norm.output_parts > 0
    assert norm_kernels.output_parts(3, 64) == 0
    assert XLA_KERNELS.output_parts(2, 64) == 0
    cfg, run = _verify_forward(17)
    base = run(XLA_KERNELS)
    norm = kernels_for("pallas", "cpu").residual_norm
    launch = dataclasses.replace(XLA_KERNELS, residual_norm=norm)
    unsplit = run(launch)
    np.testing.assert_allclose(unsplit, base, rtol=1e-5, atol=1e-5)
    parts = {"norm.output_parts": 4, "norm.output_parts_max_tokens": 2 * WIDTH}  # this forward's
    seen = []

    def recorder(drop: bool, overrides=parts):
        def fused(x, delta, weight, router=None, *, xla_form, **options):
            if delta is not None and delta.ndim == 3:
                seen.append((delta.shape, delta.dtype))
                delta = delta[1:] if drop else delta
                return residual_rms_norm(
                    x, jnp.sum(delta, 0).astype(x.dtype), weight, router, **options
                )
            return xla_form()

        tuning = Tuning().with_overrides(overrides)
        return dataclasses.replace(XLA_KERNELS, residual_norm=fused, tuning=tuning)

    np.testing.assert_allclose(run(recorder(False)), base, rtol=1e-5, atol=1e-5)
    want = [((4, 2 * WIDTH, cfg.hidden_size), jnp.float32)] * len(cfg.layer_roles)
    assert seen == want
    assert not np.allclose(run(recorder(True)), base, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(run(launch), unsplit, rtol=1e-5, atol=1e-5)
    past = {**parts, "norm.output_parts_max_tokens": 2 * WIDTH - 1}  # past the bound
    seen.clear()
    np.testing.assert_allclose(run(recorder(False, past)), base, rtol=1e-5, atol=1e-5)
    assert seen == []
    xla_sizes = {**parts, "norm.residual_max_tokens": 2 * WIDTH - 1}  # XLA's form
    seen.clear()
    np.testing.assert_allclose(run(recorder(False, xla_sizes)), base, rtol=1e-5, atol=1e-5)
    assert seen == []  # no launch at these sizes: one product, no parts
