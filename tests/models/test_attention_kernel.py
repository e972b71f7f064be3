"""The attention layers of every family run the paged attention of the ``Kernels`` they are
handed (``Kernels.paged_attention``), and the Pallas kernel (interpret mode) gives the
forward of the jnp form."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.kernels.attention.paged import paged_attention_reference
from lazyspec.kernels.backend import XLA_KERNELS, kernels_for
from lazyspec.kernels.tuning import Tuning
from lazyspec.models.interface import PoolView
from lazyspec.models.model import empty_caches
from lazyspec.testing.tiny_models import tiny_model
from tests.kernels.kernel_checks import launch_names
from tests.models.test_pool_rows import (
    CONTEXT,
    SLOTS,
    WIDTH,
    _verify_inputs,
    first_tokens,
    step_eqns,
)


def _random_caches(rng, cfg, rows: int):
    kv, pools = empty_caches(cfg, 1 + rows * CONTEXT, SLOTS + 1, jnp.float32)
    kv = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.1, x.dtype), kv)
    rec = PoolView(
        conv_pool=pools.conv, ssm_pool=pools.ssm, slot=jnp.asarray([3, 0, 1][:rows], jnp.int32)
    )
    return kv, rec


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h", "granitemoehybrid"])
def test_forward_calls_the_paged_attention_it_is_given(family):
    """One call per attention layer, with the layer's pools and the step's table."""
    model = tiny_model(family)
    cfg = model.config
    rng = np.random.default_rng(13)
    kv, rec = _random_caches(rng, cfg, 2)
    inputs = _verify_inputs(rng, cfg.vocab_size, [WIDTH, 2])
    calls = []

    def attention(paged, scale, *, gate=None):
        calls.append(
            (paged.k_pool.shape, paged.token_table is inputs.kv_read_idx, gate is not None)
        )
        return paged_attention_reference(paged, scale, gate=gate)

    kernels = dataclasses.replace(XLA_KERNELS, paged_attention=attention)
    model.family.forward(model.params, cfg, inputs, kv, rec, mode="verify", kernels=kernels)
    gated = cfg.arch.attention.output_gate  # the kernel applies the gate
    assert calls == [(pool.shape, True, gated) for pool in kv.k] and calls


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h", "granitemoehybrid"])
def test_forward_uses_the_attention_prologue_it_is_given(family):
    """With a paged attention, every attention layer hands its raw projections to
    ``Kernels.attention_prologue`` (with its norms' weights where it has them) and runs on
    what it returns: the XLA form behind a recorder gives the forward without a prologue
    exactly; altered queries or an altered V pool change the output."""
    model = tiny_model(family)
    cfg = model.config
    spec = cfg.arch.attention
    rng = np.random.default_rng(15)
    kv, rec = _random_caches(rng, cfg, 2)
    inputs = _verify_inputs(rng, cfg.vocab_size, [WIDTH, 2])
    base = dataclasses.replace(XLA_KERNELS, paged_attention=paged_attention_reference)

    def run(kernels):
        out = model.family.forward(
            model.params, cfg, inputs, kv, rec, mode="verify", kernels=kernels
        )
        return np.asarray(out[0])

    def recorder(alter=lambda out: out):
        calls = []

        def prologue(q, k, v, positions, write_idx, num_new, k_pool, v_pool, *norms, **kw):
            assert q.shape[:2] == (2 * WIDTH, spec.num_heads) and k.shape == v.shape
            assert positions is inputs.positions and write_idx is inputs.kv_write_idx
            assert kw["rotary_dim"] == spec.rotary_dim
            calls.append((k_pool.shape, sum(n is not None for n in norms)))
            return alter(kw["xla_form"]())

        return dataclasses.replace(base, attention_prologue=prologue), calls

    kernels, calls = recorder()
    np.testing.assert_array_equal(run(kernels), run(base))
    norms = 2 if spec.qk_norm else 0
    assert calls == [(pool.shape, norms) for pool in kv.k] and calls
    want = run(base)
    for alter in (
        lambda out: (out[0] + 10.0, *out[1:]),
        lambda out: (out[0], out[1], out[2] + 1.0),
    ):
        assert np.abs(run(recorder(alter)[0]) - want).max() > 1e-3 * np.abs(want).max()


def _forward_runner(family: str, seed: int, mode: str, **options):
    """(the tiny ``family``'s jitted forward of three verify rows (row 1 padding) over random
    caches, as a function of the ``Kernels``; the inputs; the KV pools)."""
    model = tiny_model(family)
    cfg = model.config
    rng = np.random.default_rng(seed)
    kv, rec = _random_caches(rng, cfg, 3)
    inputs = _verify_inputs(rng, cfg.vocab_size, [WIDTH, 0, 3])

    def run(kernels):
        return jax.jit(
            lambda: model.family.forward(
                model.params, cfg, inputs, kv, rec, mode=mode, kernels=kernels, **options
            )
        )()

    return run, inputs, kv


def _check_against_xla(run, inputs, got) -> None:
    """``got`` (a forward's outputs) equals the XLA forward on every real token, finite
    everywhere, and wrote the same KV pools (up to the float error that the hidden stream
    carries into later layers' K/V)."""
    hidden, kv_out, _ = got
    want_hidden, want_kv, _ = run(XLA_KERNELS)
    real = np.arange(WIDTH)[None, :] < np.asarray(inputs.num_new)[:, None]
    assert real.sum() == WIDTH + 3
    got, want = np.asarray(hidden)[real], np.asarray(want_hidden)[real]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert np.isfinite(np.asarray(hidden)).all()
    for a, b in zip(jax.tree.leaves(kv_out), jax.tree.leaves(want_kv)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["verify", "extend"])
def test_pallas_attention_forward_matches_jnp_form_pallas(mode):
    """Qwen3-Next's forward with the Pallas kernels equals the XLA forward on every real
    token (row 1 is padding: no new tokens), and writes the same KV pools."""
    run, inputs, _ = _forward_runner("qwen3_next", 14, mode, chunk_size=4)
    _check_against_xla(run, inputs, run(kernels_for("pallas")))


@pytest.mark.parametrize(
    "family,mode",
    [
        ("qwen3_next", "verify"),
        ("qwen3_next", "decode"),
        ("nemotron_h", "verify"),
        ("granitemoehybrid", "verify"),
        ("qwen3_next", "xla prologue"),
    ],
)
def test_qkv_read_in_place_gives_the_same_forward_pallas(family, mode):
    """With ``AttentionTuning.qkv_in_place`` every attention layer computes q, k and v in one
    product, the prologue reads them out of it and the paged attention its gate where it
    has one (handed the product's output as it is): the hidden states and KV pools of the
    three products (up to float32 rounding: a wider product may sum in another order), two
    products fewer a layer. "xla prologue": a verify step over the prologue's token limit,
    whose XLA form slices the three outputs out of the one product."""
    model = tiny_model(family)
    cfg, spec = model.config, model.config.arch.attention
    rng = np.random.default_rng(21)
    kv, rec = _random_caches(rng, cfg, 3)
    inputs = _verify_inputs(rng, cfg.vocab_size, [WIDTH, 0, 3])
    if mode == "decode":
        inputs = first_tokens(inputs)
    limit = {}
    if mode == "xla prologue":
        limit, mode = {"attention.prologue_max_tokens": 1}, "verify"
    results, dots, gates = {}, {}, {}
    for in_place in (False, True):
        tuning = Tuning().with_overrides({**limit, "attention.qkv_in_place": in_place})
        base = kernels_for("pallas", tuning=tuning)
        shapes = []

        def attention(*args, gate=None, shapes=shapes, base=base, **kw):
            shapes.append(None if gate is None else gate.shape)
            return base.paged_attention(*args, gate=gate, **kw)

        kernels = dataclasses.replace(base, paged_attention=attention)

        def step(kernels=kernels):
            return model.family.forward(
                model.params, cfg, inputs, kv, rec, mode=mode, kernels=kernels
            )

        results[in_place] = jax.jit(step)()
        eqns = step_eqns(jax.make_jaxpr(step)().jaxpr)
        dots[in_place] = sum(eqn.primitive.name == "dot_general" for eqn in eqns)
        gates[in_place] = set(shapes)
    (hidden, kv_out, _), (want_hidden, want_kv, _) = results[True], results[False]
    for a, b in zip(jax.tree.leaves((hidden, kv_out)), jax.tree.leaves((want_hidden, want_kv))):
        b = np.asarray(b, np.float32)
        atol = 1e-5 * np.abs(b).max()  # rounding carried through later layers
        np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=1e-5, atol=atol)
    assert dots[False] - dots[True] == 2 * len(kv.k)
    lead = inputs.tokens.shape
    if not spec.output_gate:
        assert gates == {False: {None}, True: {None}}
        return
    assert gates[False] == {(*lead, spec.num_heads, spec.head_dim)}
    product_heads = spec.num_heads + spec.num_kv_heads  # k and v's heads after q's, as wide
    assert gates[True] == {(*lead, product_heads, 2 * spec.head_dim)}


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_tpu_kernels_forward_matches_jnp_form_pallas(family):
    """The forward with the Pallas record of a TPU (the ragged paged attention, the Mosaic
    state updates and routed experts), run in TPU interpret mode, equals the XLA forward on
    every real token (row 1 is padding), and writes the same KV pools."""
    from jax.experimental.pallas import tpu as pltpu

    run, inputs, kv = _forward_runner(family, 16, "verify")
    tpu = kernels_for("pallas", "tpu", "pallas")
    calls = launch_names(step_eqns(jax.make_jaxpr(lambda: run(tpu))().jaxpr))
    assert calls.count("ragged_paged_attention") == len(kv.k) > 0  # one an attention layer
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        got = run(tpu)
    _check_against_xla(run, inputs, got)
