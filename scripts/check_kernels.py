"""Check the decode step's fused kernels on this machine's backend against their references.

Eight checks, one table row per shape, at Qwen3-Next widths (``--smoke``: tiny widths, for a
CPU, where the kernels run in interpret mode):

* ``route_tokens``, the routed-experts kernel's routing program (``TokenRouting``): each
  token's experts and weights as the kernels read them (``testing.routing.expert_picks``)
  equal ``layers.moe.route``'s with the padding rule and the shared expert (weights within
  ``1e-5`` relative);
* ``sparse_moe`` through the backend's ``moe_experts`` (routing in the kernel, the shared
  expert in its launches) against its XLA form, bf16 weights: max |diff| over max
  |reference| of the real tokens' outputs, within ``2**-5`` (the XLA form rounds more
  intermediates to bf16);
* the GDN state update with ``GdnConvTokens`` (q, k and the gates finished in the kernel;
  the gates as two arrays and grouped as Qwen3-Next's ``in_proj_ba`` gives them) against
  the same kernel with the ``GdnTokens`` the GDN layer builds in jnp, in both modes: max
  |diff| of outputs and states, within ``1e-4``;
* the conv update reading its channels out of Qwen3-Next's ``in_proj_qkvz`` output
  (``ChannelGroups``) against the same kernel on the channels gathered in conv order:
  outputs and windows equal (the same arithmetic on the same values);
* the residual add, norm and router logits in one launch (``Kernels.residual_norm``)
  against the model's ops (``norms.residual_rms_norm``): the residual equal, the normed
  rows within ``2**-7`` of the largest (the kernel norms the residual rounded to bf16, as
  the model's ops are written; XLA may keep it in float32), the logits within ``1e-5`` of
  the largest of the kernel's own normed rows times the router (float32 sums in another
  order); and a GDN layer's input norm without a delta, with ``in_proj_ba`` as the router
  and its products rounded to bf16 (within ``2**-8``). Sizes over the launch's limits
  (``NormTuning.residual_max_tokens`` and ``residual_max_token_experts``: 64 tokens
  of 256 experts) run XLA's fusions in the engine; their rows say "not launched";
* the attention prologue in one launch (``Kernels.attention_prologue``: the q / k norms,
  the rotation, the K / V write) against the model's ops (``attention.norm_rope`` then
  ``write_kv``), Qwen3-Next's heads (the gates beside the queries): queries and written K
  rows within ``2**-7`` of the largest (XLA may keep float32 between the rotation's ops),
  the V rows and every row not written equal; again reading q, k and v out of their one
  product's output ("one product", ``ATTENTION_QKV_IN_PLACE``);
* the GDN output's gated norm in one launch (``Kernels.gated_norm``, the gates read out of
  Qwen3-Next's ``in_proj_qkvz`` output in place) against ``norms.gated_rms_norm`` over the
  gathered gates: within ``2**-7`` of the largest (the launch's sigmoid and XLA's may round
  differently);
* the paged attention with its output gate (``Kernels.paged_attention(..., gate=)``: the
  splits merged and gated in a second launch) against the jnp form with the same gate:
  within ``2**-6`` of the largest (each rounds probabilities to bf16 at another point);
  the gate also read in place out of a wider array ("gate in place": each head's query
  then its gate, as q, k and v's one product gives it).

Exit status 1 if any check fails.

    python scripts/check_kernels.py --out check.md     # on a GPU
    python scripts/check_kernels.py --smoke            # CPU, interpret mode
    # the dispatch under a switch (repeatable; bench_engine's flag), recorded in the header
    python scripts/check_kernels.py --kernel-tuning attention.active_splits=false
    python scripts/check_kernels.py --checks attention_prologue,gated_attention   # some
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from lazyspec.bench.origin import code_line
from lazyspec.bench.tuning_flag import add_tuning_argument, tuned, tuning_lines
from lazyspec.kernels import backend, common
from lazyspec.kernels.attention import paged as pa
from lazyspec.kernels.attention.inputs import PagedInputs
from lazyspec.kernels.backend import default_tuning
from lazyspec.kernels.moe import routing as me
from lazyspec.kernels.norm import dispatch as norm_dispatch
from lazyspec.kernels.norm.gated import GateLayout
from lazyspec.kernels.state import update_common as su
from lazyspec.kernels.tuning import Tuning
from lazyspec.models.layers import attention, gdn, moe, norms
from lazyspec.models.layers.state_kernels import gdn_tokens
from lazyspec.models.plan import init_plan
from lazyspec.testing.routing import expert_picks, picks_differ, router_picks

MOE_TOL = 2.0**-5
GDN_TOL = 1e-4
NORM_TOL = 2.0**-7
LOGIT_TOL = 1e-5
GATES_TOL = 2.0**-8  # products rounded to bf16
ATTENTION_TOL = 2.0**-6
# a shape the launch leaves to XLA's fusions (its ``xla_form``, the check's reference)
NOT_LAUNCHED = "not launched (XLA's fusions at these sizes)"
# (hidden, experts per MoE check, top-k, expert width, GDN key heads, value heads, head width)
WIDTHS = {
    "qwen3-next": (2048, (64, 256, 512), 10, 512, 16, 32, 128),
    "smoke": (32, (8, 12), 3, 16, 2, 4, 8),
}
# (query heads, kv heads, head dim, rotated channels) of an attention layer
ATTENTION_WIDTHS = {"qwen3-next": (16, 2, 256, 64), "smoke": (4, 2, 16, 8)}


def launch_options() -> dict:
    """Interpret mode on a CPU, else the default backend's compiled launch."""
    if jax.default_backend() == "cpu":
        return {"interpret": True, "compiler_params": None}
    return {"interpret": False, "compiler_params": common.pallas_compiler_params()}


def result(ok: bool, errors) -> str:
    """A table row's result: "ok" or "over the tolerance", then the errors found."""
    found = ", ".join(f"{e:.2e}" for e in errors)
    return f"{'ok' if ok else 'over the tolerance'}: {found}"


def relative_error(got, want) -> float:
    """max |got - want| over max |want| (float32 arrays; 1e-30 where want is all zeros)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def check_routing(
    rng, token_counts, expert_counts, top_k, tuning: Tuning
) -> list[tuple[str, str, str]]:
    route = jax.jit(lambda r, w: me.route_tokens(r, w, 16, **launch_options()))
    rows = []
    for num_experts in expert_counts:
        for num_tokens in token_counts:
            logits = jnp.asarray(rng.standard_normal((num_tokens, num_experts)), jnp.float32)
            real = jnp.asarray(np.arange(num_tokens) % 3 != 2)  # every third token padding
            shared_weight = jnp.asarray(rng.random(num_tokens), jnp.float32)
            tiles = route(me.TokenRouting(logits, top_k, True, real), shared_weight)
            spec = moe.MoESpec(1, num_experts, top_k, 1, 1, norm_topk_prob=True)
            weights, ids = moe.route({}, spec, None, logits)
            want = router_picks(
                weights, moe.padding_follows_token_zero(ids, real), (num_experts, shared_weight)
            )
            differ = picks_differ(expert_picks(tiles, 16), want, 1e-5)
            shape = f"{num_tokens} tokens, {num_experts} experts, top-{top_k}"
            rows.append(("route_tokens", shape, differ or "ok"))
    return rows


# The routed experts' launch forms for a few tokens (``moe_dispatch.moe_launch``), each checked
# whatever the tuning says: (name, route_in_up_max_tokens, down_in_up_max_tokens).
MOE_FORMS = (
    ("routing launch", 0, 0),
    ("routing in up", 8, 0),
    ("down in up", 8, 8),
)


def check_moe(rng, token_counts, widths, tuning: Tuning) -> list[tuple[str, str, str]]:
    """The MoE layer with the kernel against its XLA form: at the tuning's folds, and up to 8
    tokens in each of ``MOE_FORMS``."""
    hidden, expert_counts, top_k, inner = widths[:4]
    defaults = tuning.moe.route_in_up_max_tokens, tuning.moe.down_in_up_max_tokens
    rows = []
    for num_experts in expert_counts:
        spec = moe.MoESpec(hidden, num_experts, top_k, inner, inner, norm_topk_prob=True)
        params = init_plan(moe.moe_plan("mlp", spec), jax.random.key(0), jnp.bfloat16, 0.02)
        for num_tokens in token_counts:
            x = jnp.asarray(rng.standard_normal((num_tokens, 1, hidden)), jnp.bfloat16)
            real = jnp.asarray(np.arange(num_tokens) != 1)
            forms = [("sparse_moe", *defaults)]
            if num_tokens <= 8:
                forms += [(f"sparse_moe, {name}", *folds) for name, *folds in MOE_FORMS]
            keep = np.asarray(real)
            with jax.default_matmul_precision("highest"):
                want = jax.jit(moe.sparse_moe, static_argnums=(1, 3))(params, spec, x, None, real)
            want = np.asarray(want, np.float32)[keep]
            for name, route_in_up, down_in_up in forms:
                form = tuning.with_overrides(
                    {
                        "moe.route_in_up_max_tokens": route_in_up,
                        "moe.down_in_up_max_tokens": down_in_up,
                    }
                )
                kernel = backend.kernels_for("pallas", tuning=form).moe_experts
                layer = jax.jit(lambda p, x, r, s=spec, f=kernel: moe.sparse_moe(p, s, x, f, r))
                with jax.default_matmul_precision("highest"):
                    got = np.asarray(layer(params, x, real), np.float32)[keep]
                err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
                shape = f"{num_tokens} tokens, {num_experts} experts"
                rows.append((name, shape, result(err <= MOE_TOL, [err])))
    return rows


def _largest_diff(got, want, names) -> float:
    """max |got - want| over the named fields of two update results that ``want`` has."""
    return max(
        float(jnp.max(jnp.abs(getattr(got, n) - getattr(want, n))))
        for n in names
        if getattr(want, n) is not None
    )


def check_gdn(rng, widths, cases, tuning: Tuning) -> list[tuple[str, str, str]]:
    num_k, num_v, width = widths[4:]
    spec = gdn.GDNSpec(widths[0], num_k, num_v, width, width, 4, 1e-6)
    update = backend.kernels_for("pallas", tuning=tuning).gdn_state_update
    tokens_of = jax.jit(
        lambda c, a, b, p, n: gdn_tokens(*gdn._heads(spec, c), *gdn._gates(p, a, b), n)
    )
    rows = []
    for batch, tokens in cases:
        conv_out = jnp.asarray(
            rng.standard_normal((batch, tokens, (2 * num_k + num_v) * width)), jnp.float32
        )
        a, b = (
            jnp.asarray(rng.standard_normal((batch, tokens, num_v)), jnp.bfloat16) for _ in "ab"
        )
        params = {
            n: jnp.asarray(rng.standard_normal(num_v), jnp.bfloat16) for n in ("A_log", "dt_bias")
        }
        num_new = jnp.asarray(np.arange(batch) % (tokens + 1), jnp.int32)  # 0 new tokens too
        pool = jnp.asarray(
            rng.standard_normal((3, batch + 1, num_v, width, width)) * 0.1, jnp.float32
        )
        slot = jnp.asarray(np.arange(batch) + 1, jnp.int32)
        finish = (params["A_log"], params["dt_bias"], num_new, num_k)
        ba = su.GdnConvTokens.group_gates(b, a, num_k)
        forms = {  # the gates as two arrays, and as Qwen3-Next's in_proj_ba gives them
            "gdn GdnConvTokens": su.GdnConvTokens(conv_out, a, b, *finish),
            "gdn GdnConvTokens.grouped": su.GdnConvTokens.grouped(conv_out, ba, *finish),
        }
        built = tokens_of(conv_out, a, b, params, num_new)
        # the output's gated norm in the update too (``OutputNorm``), z as in_proj_qkvz has it
        per_key = num_v // num_k
        layout = GateLayout((2 + 2 * per_key) * width, (2 + per_key) * width, per_key)
        source = rng.standard_normal((batch, tokens, num_k * layout.group_width))
        weight = jnp.asarray(1.0 + 0.1 * rng.standard_normal(width), jnp.bfloat16)
        norm = su.OutputNorm(jnp.asarray(source, jnp.bfloat16), weight, layout, 1e-6, jnp.bfloat16)
        normed = dataclasses.replace(forms["gdn GdnConvTokens.grouped"], norm=norm)
        gate = layout.gather(norm.z_source, num_v, width)
        for mode in su.MODES:
            run = jax.jit(lambda p, s, t, mode=mode: update(p, s, t, mode=mode, layer=1))
            want = run(pool, slot, built)
            shape = f"{batch} rows, {tokens} tokens, {mode}"
            for name, conv in forms.items():
                err = _largest_diff(run(pool, slot, conv), want, ("outputs", "pool", "step_states"))
                rows.append((name, shape, result(err <= GDN_TOL, [err])))
            got = run(pool, slot, normed)
            state_err = _largest_diff(got, want, ("pool", "step_states"))
            want_out = norms.gated_rms_norm(want.outputs.astype(jnp.bfloat16), gate, weight, 1e-6)
            found = relative_error(np.asarray(got.outputs, np.float32), np.asarray(want_out))
            verdict = result(found <= NORM_TOL and state_err <= GDN_TOL, [found, state_err])
            rows.append(("gdn GdnConvTokens.grouped, norm", shape, verdict))
    return rows


def check_grouped_conv(rng, widths, cases, tuning: Tuning) -> list[tuple[str, str, str]]:
    """The conv kernel reading its channels out of ``in_proj_qkvz``'s output
    (``ChannelGroups``) against the same kernel on the channels gathered in conv order."""
    num_k, num_v, width = widths[4:]
    spec = gdn.GDNSpec(widths[0], num_k, num_v, width, width, 4, 1e-6)
    layout = gdn._conv_channels(spec)
    conv = backend.kernels_for("pallas", tuning=tuning).conv_update
    rows = []
    for batch, tokens in cases:
        fused = jnp.asarray(
            rng.standard_normal((batch, tokens, spec.conv_dim + spec.value_dim)), jnp.bfloat16
        )
        weight = jnp.asarray(rng.standard_normal((spec.conv_dim, 4)) * 0.5, jnp.bfloat16)
        pool = jnp.asarray(rng.standard_normal((3, batch + 1, spec.conv_dim, 3)), jnp.bfloat16)
        slot = jnp.asarray(np.arange(batch) + 1, jnp.int32)
        for mode in ("decode", "verify"):
            run = jax.jit(
                lambda p, s, x, w, groups=None, mode=mode: conv(
                    p, s, x, w, mode=mode, layer=1, channel_groups=groups, out_dtype=jnp.float32
                ),
                static_argnames="groups",
            )
            got = run(pool, slot, fused, weight, layout)
            want = run(pool, slot, layout.gather(fused), weight)
            errs = [
                float(jnp.max(jnp.abs(getattr(got, n).astype(jnp.float32) - getattr(want, n))))
                for n in ("outputs", "pool", "step_windows")
                if getattr(want, n) is not None
            ]
            verdict = "ok" if max(errs) == 0.0 else "differs"
            shape = f"{batch} rows, {tokens} tokens, {mode}"
            rows.append(("conv ChannelGroups", shape, f"{verdict}: {max(errs):.2e}"))
    return rows


def passes(verdicts: list[str]) -> bool:
    """Whether a run with these results passes: every check ok or not launched."""
    return all(v.startswith("ok") or v == NOT_LAUNCHED for v in verdicts)


def check_residual_norm(rng, token_counts, widths, tuning: Tuning) -> list[tuple[str, str, str]]:
    """``Kernels.residual_norm`` (with and without a router) against the model's ops."""
    hidden, expert_counts = widths[:2]
    options = {"eps": 1e-6, "zero_centered": True}
    want_of = jax.jit(lambda *a: norms.residual_rms_norm(*a, **options))
    got_of = jax.jit(
        lambda *a: backend.kernels_for("pallas", tuning=tuning).residual_norm(
            *a, **options, xla_form=None
        )
    )

    rows = []
    for num_experts in (None, *expert_counts):
        for num_tokens in token_counts:
            x, delta = (
                jnp.asarray(rng.standard_normal((num_tokens, hidden)), jnp.bfloat16)
                for _ in range(2)
            )
            weight = jnp.asarray(rng.standard_normal(hidden) * 0.1, jnp.bfloat16)
            experts = "no router" if num_experts is None else f"{num_experts} experts"
            shape = f"{num_tokens} tokens, {experts}"
            if not norm_dispatch.residual_norm_fits(num_tokens, num_experts, tuning):
                rows.append(("residual_norm", shape, NOT_LAUNCHED))
                continue
            router = None
            if num_experts is not None:
                router = rng.standard_normal((num_experts, hidden)) * hidden**-0.5
                router = jnp.asarray(router, jnp.bfloat16)
            want, got = (f(x, delta, weight, router) for f in (want_of, got_of))
            errs = [
                relative_error(got.residual, want.residual),
                relative_error(got.normed, want.normed),
            ]
            ok = errs[0] == 0.0 and errs[1] <= NORM_TOL
            if router is not None:
                h, w = (np.asarray(a, np.float64) for a in (got.normed, router))
                errs.append(relative_error(got.logits, h @ w.T))
                ok = ok and errs[2] <= LOGIT_TOL
            rows.append(("residual_norm", shape, result(ok, errs)))
    # the output projection's float32 partial sums as the delta (Kernels.output_parts)
    num_experts, parts = expert_counts[0], 4
    router = rng.standard_normal((num_experts, hidden)) * hidden**-0.5
    router = jnp.asarray(router, jnp.bfloat16)
    for num_tokens in token_counts:
        shape = f"{num_tokens} tokens, {num_experts} experts, {parts} float32 parts"
        if not norm_dispatch.residual_norm_fits(num_tokens, num_experts, tuning):
            rows.append(("residual_norm", shape, NOT_LAUNCHED))
            continue
        x = jnp.asarray(rng.standard_normal((num_tokens, hidden)), jnp.bfloat16)
        delta = jnp.asarray(rng.standard_normal((parts, num_tokens, hidden)), jnp.float32)
        weight = jnp.asarray(rng.standard_normal(hidden) * 0.1, jnp.bfloat16)
        got = got_of(x, delta, weight, router)
        want = want_of(x, jnp.sum(delta, 0).astype(x.dtype), weight, router)
        h, w = (np.asarray(a, np.float64) for a in (got.normed, router))
        errs = [
            relative_error(got.residual, want.residual),  # the parts' sum rounded: 1 ulp apart
            relative_error(got.normed, want.normed),
            relative_error(got.logits, h @ w.T),
        ]
        ok = errs[0] <= NORM_TOL and errs[1] <= NORM_TOL and errs[2] <= LOGIT_TOL
        rows.append(("residual_norm", shape, result(ok, errs)))
    # a GDN layer's input norm with in_proj_ba ([2 * Hv, hidden]) as the router, no delta
    gates = jnp.asarray(rng.standard_normal((2 * widths[5], hidden)) * hidden**-0.5, jnp.bfloat16)
    options = dict(options, logits_dtype=jnp.bfloat16)
    want_of = jax.jit(lambda *a: norms.residual_rms_norm(*a, **options))
    got_of = jax.jit(
        lambda *a: backend.kernels_for("pallas", tuning=tuning).residual_norm(
            *a, **options, xla_form=None
        )
    )
    for num_tokens in token_counts:
        x = jnp.asarray(rng.standard_normal((num_tokens, hidden)), jnp.bfloat16)
        weight = jnp.asarray(rng.standard_normal(hidden) * 0.1, jnp.bfloat16)
        shape = f"{num_tokens} tokens, no delta, {gates.shape[0]} bf16 gates"
        if not norm_dispatch.residual_norm_fits(num_tokens, gates.shape[0], tuning):
            rows.append(("residual_norm", shape, NOT_LAUNCHED))
            continue
        want, got = (f(x, None, weight, gates) for f in (want_of, got_of))
        h, w = (np.asarray(a, np.float64) for a in (got.normed, gates))
        errs = [relative_error(got.normed, want.normed), relative_error(got.logits, h @ w.T)]
        ok = errs[0] <= NORM_TOL and errs[1] <= GATES_TOL
        rows.append(("residual_norm", shape, result(ok, errs)))
    return rows


def check_attention_prologue(rng, shapes, widths, tuning: Tuning) -> list[tuple[str, str, str]]:
    """``Kernels.attention_prologue`` against the model's ops, batches of ``(B, T)``: on q,
    k and v as three arrays, then (as "one product") read in place out of their one
    product's output, as ``layers.attention`` hands it with ``ATTENTION_QKV_IN_PLACE``."""
    num_heads, num_kv_heads, head_dim, rotary = widths
    spec = attention.AttentionSpec(
        num_heads,
        num_kv_heads,
        head_dim,
        rotary_dim=rotary,
        rope_theta=10_000_000.0,
        qk_norm=True,
        zero_centered_qk_norm=True,
        output_gate=True,
    )

    def want_of(q, k, v, positions, write_idx, num_new, k_pool, v_pool, q_norm, k_norm):
        params = {"q_norm": q_norm, "k_norm": k_norm}
        q, k, v = (a.reshape(*positions.shape, *a.shape[1:]) for a in (q, k, v))
        q, k = attention.norm_rope(params, spec, q[..., :head_dim], k, positions)
        pools = attention.write_kv(k_pool, v_pool, k, v, write_idx, num_new)
        return (q.reshape(-1, *q.shape[2:]), *pools)

    options = {"eps": spec.norm_eps, "zero_centered": True, "rotary_dim": rotary}
    options["rope_theta"] = spec.rope_theta
    prologue = backend.kernels_for("pallas", tuning=tuning).attention_prologue
    got_of = jax.jit(lambda *a: prologue(*a, **options, xla_form=None))
    k_at = num_heads * 2  # q's heads of 2 * head_dim, counted in heads of head_dim
    heads = {"num_heads": num_heads, "k_head_at": k_at, "v_head_at": k_at + num_kv_heads}

    @jax.jit
    def one_product_of(q, k, v, *rest):
        product = jnp.concatenate([a.reshape(a.shape[0], -1) for a in (q, k, v)], axis=1)
        by_head = product.reshape(product.shape[0], -1, head_dim)
        q_view = product.reshape(product.shape[0], -1, 2 * head_dim)
        return prologue(q_view, by_head, by_head, *rest, **options, **heads, xla_form=None)

    rows = []
    for batch, tokens in shapes:
        num, pool_rows = batch * tokens, 4 * batch * tokens + 8
        bf16 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)  # noqa: E731
        write_idx = 1 + rng.permutation(pool_rows - 1)[:num].reshape(batch, tokens)
        args = (
            bf16(num, num_heads, 2 * head_dim),
            bf16(num, num_kv_heads, head_dim),
            bf16(num, num_kv_heads, head_dim),
            jnp.asarray(rng.integers(0, 250_000, (batch, tokens)), jnp.int32),
            jnp.asarray(write_idx, jnp.int32),
            jnp.asarray(rng.integers(1, tokens + 1, batch), jnp.int32),
            bf16(pool_rows, num_kv_heads, head_dim),
            bf16(pool_rows, num_kv_heads, head_dim),
            *(bf16(head_dim) * 0.1 for _ in range(2)),
        )
        want = jax.jit(want_of)(*args)
        new = np.zeros(pool_rows, bool)
        new[write_idx[np.arange(tokens)[None] < np.asarray(args[5])[:, None]]] = True
        for name, run in (("", got_of), (", one product", one_product_of)):
            got = run(*args)
            errs = [relative_error(got[0], want[0]), relative_error(got[1][new], want[1][new])]
            exact = [
                np.array_equal(np.asarray(got[2], np.float32), np.asarray(want[2], np.float32)),
                np.array_equal(np.asarray(got[1])[~new], np.asarray(args[6])[~new]),
            ]
            ok = max(errs) <= NORM_TOL and all(exact)
            verdict = "ok" if ok else "over the tolerance"
            found = f"q {errs[0]:.2e}, k rows {errs[1]:.2e}, v and other rows equal: {all(exact)}"
            shape = f"{batch} x {tokens} tokens"
            rows.append((f"attention_prologue{name}", shape, f"{verdict}: {found}"))
    return rows


def check_gated_norm(rng, token_counts, widths, tuning: Tuning) -> list[tuple[str, str, str]]:
    """``Kernels.gated_norm`` against ``norms.gated_rms_norm`` on the gathered gates."""
    num_k, num_v, head_dim = widths[4:7]
    per_key = num_v // num_k
    layout = GateLayout((2 + 2 * per_key) * head_dim, (2 + per_key) * head_dim, per_key)
    options = {"eps": 1e-6, "dtype": jnp.bfloat16}

    def want_of(x, source, weight):
        z = layout.gather(source, num_v, head_dim)
        return norms.gated_rms_norm(x.astype(jnp.bfloat16), z, weight, options["eps"])

    gated = backend.kernels_for("pallas", tuning=tuning).gated_norm
    got_of = jax.jit(lambda *a: gated(a[0], a[1], layout, a[2], **options, xla_form=None))
    rows = []
    for num_tokens in token_counts:
        x = jnp.asarray(rng.standard_normal((num_tokens, num_v, head_dim)), jnp.float32)
        source = rng.standard_normal((num_tokens, num_k * layout.group_width))
        weight = jnp.asarray(1.0 + 0.1 * rng.standard_normal(head_dim), jnp.bfloat16)
        args = (x, jnp.asarray(source, jnp.bfloat16), weight)
        want, got = (np.asarray(f(*args), np.float32) for f in (jax.jit(want_of), got_of))
        found = relative_error(got, want)
        rows.append(("gated_norm", f"{num_tokens} tokens", result(found <= NORM_TOL, [found])))
    return rows


def check_gated_attention(rng, shapes, widths, tuning: Tuning) -> list[tuple[str, str, str]]:
    """``Kernels.paged_attention`` with a gate against the gated jnp form, ``(B, T, context)``
    batches whose queries sit at the last T positions of their contexts: every row at the
    table's width, then (as "active splits", with ``AttentionTuning.active_splits`` on
    whatever the tuning says) rows of a third of it to all of it, so the combine merges fewer
    splits than the launch has; then (as "gate in place") those rows with the gate read out
    of a wider array, as ``layers.attention`` hands q, k and v's one product."""
    num_heads, num_kv_heads, head_dim = widths[:3]
    scale = head_dim**-0.5
    gated_of = lambda f: jax.jit(lambda inputs, gate: f(inputs, scale, gate=gate))  # noqa: E731
    want_of = gated_of(pa.paged_attention_reference)
    default = tuning.attention.active_splits
    rows = []
    for batch, tokens, context in shapes:
        bf16 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)  # noqa: E731
        num_rows = batch * context + 1
        table = 1 + rng.permutation(num_rows - 1).reshape(batch, context)
        shorter = np.linspace(max(tokens, context // 3), context, batch).astype(np.int32)
        for name, active, lengths in (
            ("paged_attention gate", default, np.full(batch, context, np.int32)),
            ("paged_attention gate, active splits", True, shorter),
            ("paged_attention gate in place", default, shorter),
        ):
            positions = lengths[:, None] - tokens + np.arange(tokens)[None, :]
            inputs = PagedInputs(
                bf16(batch, tokens, num_heads, head_dim),
                bf16(num_rows, num_kv_heads, head_dim),
                bf16(num_rows, num_kv_heads, head_dim),
                jnp.asarray(table, jnp.int32),
                jnp.asarray(lengths),
                jnp.asarray(positions, jnp.int32),
            )
            gate = got_gate = bf16(batch, tokens, num_heads, head_dim)
            if name.endswith("in place"):  # each head's query then its gate, k and v after
                wide = bf16(batch, tokens, num_heads + num_kv_heads, 2 * head_dim)
                got_gate = wide.at[:, :, :num_heads, head_dim:].set(gate)
            form = tuning.with_overrides({"attention.active_splits": active})
            got_of = gated_of(backend.kernels_for("pallas", tuning=form).paged_attention)
            got = np.asarray(got_of(inputs, got_gate), np.float32)
            want = np.asarray(want_of(inputs, gate), np.float32)
            found = relative_error(got, want)
            shape = f"{batch} x {tokens} tokens, context {context}"
            if lengths.min() < context:
                shape += f", lengths {lengths.min()}-{lengths.max()}"
            rows.append((name, shape, result(found <= ATTENTION_TOL, [found])))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny widths (CPU, interpret mode)")
    p.add_argument("--out", default=None, help="also write the table here")
    p.add_argument(
        "--checks",
        type=lambda text: [name for name in text.split(",") if name],
        default=None,
        help="run only these checks, comma-separated (routing, moe, gdn, grouped_conv, "
        "residual_norm, attention_prologue, gated_norm, gated_attention); default all",
    )
    add_tuning_argument(p)
    args = p.parse_args(argv)
    tuning = tuned(default_tuning(), args.kernel_tuning)  # every check's dispatch
    widths = WIDTHS["smoke" if args.smoke else "qwen3-next"]
    rng = np.random.default_rng(0)
    tokens = (1, 2, 3) if args.smoke else (1, 2, 3, 4, 8)
    rows = []
    runs = {
        "routing": lambda: check_routing(rng, tokens, widths[1], widths[2], tuning=tuning),
        "moe": lambda: check_moe(
            rng, tokens[:2] if args.smoke else (1, 2, 4, 8), widths, tuning=tuning
        ),
        "gdn": lambda: check_gdn(
            rng,
            widths,
            ((2, 1), (2, 3)) if args.smoke else ((2, 1), (16, 1), (2, 4)),
            tuning=tuning,
        ),
        "grouped_conv": lambda: check_grouped_conv(
            rng,
            widths,
            ((2, 1), (2, 3)) if args.smoke else ((2, 1), (16, 4)),
            tuning=tuning,
        ),
        "residual_norm": lambda: check_residual_norm(
            rng,
            (1, 2, 3) if args.smoke else (1, 2, 16, 64),
            widths,
            tuning=tuning,
        ),
        "attention_prologue": lambda: check_attention_prologue(
            rng,
            ((2, 3),) if args.smoke else ((1, 1), (16, 1), (64, 1), (4, 4)),
            ATTENTION_WIDTHS["smoke" if args.smoke else "qwen3-next"],
            tuning=tuning,
        ),
        "gated_norm": lambda: check_gated_norm(
            rng, (3,) if args.smoke else (1, 2, 16, 64), widths, tuning=tuning
        ),
        "gated_attention": lambda: check_gated_attention(
            rng,
            ((2, 2, 40),) if args.smoke else ((1, 1, 1024), (16, 1, 1024), (4, 4, 4096)),
            ATTENTION_WIDTHS["smoke" if args.smoke else "qwen3-next"],
            tuning=tuning,
        ),
    }
    unknown = sorted(set(args.checks or ()) - set(runs))
    if unknown:
        p.error(f"unknown checks {', '.join(unknown)}; choose from {', '.join(runs)}")
    lines = [
        f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}",
        "",
        code_line(),
        *tuning_lines(args.kernel_tuning),
        *([f"checks: {', '.join(args.checks)}"] if args.checks else []),
        "",
        "| check | shape | result |",
        "|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for name, run in runs.items():
        if args.checks and name not in args.checks:
            continue
        found = [f"| {check} | {shape} | {result} |" for check, shape, result in run()]
        print("\n".join(found), flush=True)  # each check's rows as it ends
        rows += found
    text = "\n".join(lines + rows)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if passes([row.split("|")[3].strip() for row in rows]) else 1


if __name__ == "__main__":
    sys.exit(main())
