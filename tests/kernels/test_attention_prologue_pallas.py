"""The attention prologue (Pallas, interpret mode) against the model's own ops
(``layers.attention.norm_rope`` then ``write_kv``), its Triton lowering, and the backend's
dispatch by token count and block sizes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.kernels import backend
from lazyspec.kernels.attention import dispatch as attention_dispatch
from lazyspec.kernels.attention.prologue import (
    HeadPrep,
    QKVHeads,
    attention_prologue_pallas,
    pieces,
)
from lazyspec.kernels.tuning import Tuning
from lazyspec.models.layers.attention import AttentionSpec, norm_rope, write_kv
from tests.kernels.kernel_checks import INTERPRET

pytestmark = pytest.mark.pallas

POOL_ROWS = 24

# (query heads, kv heads, head dim, rotary dim, q/k norm, zero-centred, gate): Qwen3-Next's
# kind (partial rotation, zero-centred norms, the gate beside each query), a full rotation
# without norms, norms without rotation, and Nemotron-H's kind (neither; one query head a
# kv head)
KINDS = {
    "qwen3_next": (8, 2, 32, 8, True, True, True),
    "full_rope": (4, 2, 16, 16, False, False, False),
    "norm_only": (4, 1, 32, 0, True, False, False),
    "plain": (2, 2, 16, 0, False, False, False),
}


def _spec(kind: str) -> AttentionSpec:
    hq, hkv, d, rotary, norm, zc, gate = KINDS[kind]
    return AttentionSpec(
        hq, hkv, d, rotary_dim=rotary, qk_norm=norm, zero_centered_qk_norm=zc, output_gate=gate
    )


def _case(rng, spec: AttentionSpec, batch: int, tokens: int, pool_rows: int = POOL_ROWS):
    width = spec.head_dim * (2 if spec.output_gate else 1)

    def normal(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)

    case = {
        "q": normal(batch, tokens, spec.num_heads, width),
        "k": normal(batch, tokens, spec.num_kv_heads, spec.head_dim),
        "v": normal(batch, tokens, spec.num_kv_heads, spec.head_dim),
        "positions": jnp.asarray(rng.integers(0, 40000, (batch, tokens)), jnp.int32),
        # distinct rows, never row 0
        "write_idx": jnp.asarray(
            1 + rng.permutation(pool_rows - 1)[: batch * tokens].reshape(batch, tokens)
        ),
        "num_new": jnp.asarray([tokens] + [tokens - 1] * (batch - 1), jnp.int32),
        "k_pool": normal(pool_rows, spec.num_kv_heads, spec.head_dim),
        "v_pool": normal(pool_rows, spec.num_kv_heads, spec.head_dim),
    }
    if batch * tokens > 1:  # the last token of row 0 points past the pools
        case["write_idx"] = case["write_idx"].at[0, -1].set(pool_rows + 3)
    params = {}
    if spec.qk_norm:
        params = {name: normal(spec.head_dim, scale=0.2) for name in ("q_norm", "k_norm")}
    return case, params


def _model_ops(spec: AttentionSpec, case: dict, params: dict):
    """The XLA ops the launch stands for: (q [N, Hq, D], k_pool, v_pool)."""
    q = case["q"][..., : spec.head_dim]
    q, k = norm_rope(params, spec, q, case["k"], case["positions"])
    pools = write_kv(
        case["k_pool"], case["v_pool"], k, case["v"], case["write_idx"], case["num_new"]
    )
    return (q.reshape(-1, *q.shape[2:]), *pools)


def _launch(
    spec: AttentionSpec,
    case: dict,
    params: dict,
    *,
    num_heads=None,
    k_head_at=0,
    v_head_at=0,
    **options,
):
    """The launch on a case, its heads where ``num_heads`` / ``k_head_at`` / ``v_head_at``
    say, prepared as ``spec`` and ``params`` say; ``options`` the launch's."""
    flat = lambda a: a.reshape(-1, *a.shape[2:])  # noqa: E731
    qkv = QKVHeads(*(flat(case[n]) for n in ("q", "k", "v")), num_heads, k_head_at, v_head_at)
    prep = HeadPrep(
        params.get("q_norm"),
        params.get("k_norm"),
        eps=spec.norm_eps,
        zero_centered=spec.zero_centered_qk_norm,
        rotary_dim=spec.rotary_dim,
        rope_theta=spec.rope_theta,
    )
    names = ("positions", "write_idx", "num_new", "k_pool", "v_pool")
    return attention_prologue_pallas(qkv, *(case[n] for n in names), prep=prep, **options)


def _dispatch(spec: AttentionSpec, case: dict, params: dict, xla_form, tuning=None):
    """The record's prologue entry (Pallas, interpret mode on CPU) on a case."""
    prologue = backend.kernels_for("pallas", "cpu", tuning=tuning).attention_prologue
    flat = lambda a: a.reshape(-1, *a.shape[2:])  # noqa: E731
    return prologue(
        *(flat(case[name]) for name in ("q", "k", "v")),
        *(case[name] for name in ("positions", "write_idx", "num_new", "k_pool", "v_pool")),
        params["q_norm"],
        params["k_norm"],
        eps=spec.norm_eps,
        zero_centered=True,
        rotary_dim=spec.rotary_dim,
        rope_theta=spec.rope_theta,
        xla_form=xla_form,
    )


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("batch,tokens", [(1, 1), (3, 2)])
@pytest.mark.parametrize("block_q_heads", [None, 1])
def test_prologue_equals_the_model_ops_pallas(kind, batch, tokens, block_q_heads):
    """The query heads and both pools equal the model's ops bit for bit: the new rows of
    the tokens below ``num_new`` written, the rows of the others, the row past the pools
    and every other row as they were; a kv head's query heads in one program or one a
    program (``block_q_heads``)."""
    spec = _spec(kind)
    case, params = _case(np.random.default_rng(batch * 10 + tokens), spec, batch, tokens)
    got = _launch(spec, case, params, interpret=INTERPRET, block_q_heads=block_q_heads)
    want = _model_ops(spec, case, params)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    written = np.asarray(case["write_idx"])[
        np.arange(tokens)[None, :] < np.asarray(case["num_new"])[:, None]
    ]
    written = written[written < POOL_ROWS]
    changed = np.any(np.asarray(got[1]) != np.asarray(case["k_pool"]), axis=(1, 2))
    assert set(np.flatnonzero(changed)) == set(written.tolist()) and written.size


def test_prologue_keeps_float32_pools_and_rounds_k_first_pallas():
    """Pools of another dtype take k rounded to k's dtype first, as ``write_kv`` casts it."""
    spec = _spec("qwen3_next")
    case, params = _case(np.random.default_rng(3), spec, 2, 2)
    case["k_pool"] = case["k_pool"].astype(jnp.float32)
    case["v_pool"] = case["v_pool"].astype(jnp.float32)
    got = _launch(spec, case, params, interpret=INTERPRET)
    want = _model_ops(spec, case, params)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_pieces_cover_a_head_in_powers_of_two():
    assert pieces(256, 64) == ((0, 32), (32, 32), (64, 128), (192, 64))
    assert pieces(32, 0) == ((0, 32),)
    assert pieces(96, 32) == ((0, 16), (16, 16), (32, 64))
    assert pieces(48, 16) == ((0, 8), (8, 8), (16, 32))
    with pytest.raises(ValueError, match="rotary_dim=3"):
        pieces(32, 3)


def test_prologue_rejects_mismatched_inputs():
    spec = _spec("qwen3_next")
    case, params = _case(np.random.default_rng(0), spec, 2, 2)
    good = dict(case)

    def launch(**changes):
        _launch(spec, {**good, **changes}, params, interpret=INTERPRET)

    with pytest.raises(ValueError, match="must be \\[N, H, D\\]"):
        launch(v=case["v"][..., :8])
    with pytest.raises(ValueError, match="a multiple of 2\\)"):
        launch(q=case["q"][:, :, :3])
    with pytest.raises(ValueError, match="pools"):
        launch(v_pool=case["v_pool"][:, :1])
    with pytest.raises(ValueError, match="one \\[B, T\\]"):
        launch(write_idx=case["write_idx"][:, :1])
    with pytest.raises(ValueError, match="num_new"):
        launch(num_new=case["num_new"][:1])
    with pytest.raises(ValueError, match="q_norm"):
        _launch(spec, case, {**params, "q_norm": params["q_norm"][:8]}, interpret=INTERPRET)


def _one_product(case: dict):
    """q, k and v side by side in one ``[N, Hq * Dq + 2 * Hkv * D]`` array, as
    ``layers.attention``'s one product gives them, and the launch's views and heads."""
    q, k, v = (case[name].reshape(-1, *case[name].shape[2:]) for name in ("q", "k", "v"))
    rows = jnp.concatenate([a.reshape(a.shape[0], -1) for a in (q, k, v)], axis=1)
    head_dim = k.shape[-1]
    k_at = q.shape[1] * q.shape[2] // head_dim
    views = {
        "q": rows.reshape(rows.shape[0], -1, q.shape[2]),
        "k": rows.reshape(rows.shape[0], -1, head_dim),
    }
    views["v"] = views["k"]
    heads = {"num_heads": q.shape[1], "k_head_at": k_at, "v_head_at": k_at + k.shape[1]}
    return views, heads


@pytest.mark.parametrize("kind", list(KINDS))
def test_prologue_reads_one_products_output_in_place_pallas(kind):
    """Handed one product's output (q's heads, then k's and v's, the same array as k and v,
    viewed by heads of D), the launch gives what it gives on the three arrays bit for bit:
    it reads each part at its heads and no more of q than its query heads."""
    spec = _spec(kind)
    case, params = _case(np.random.default_rng(5), spec, 3, 2)
    views, heads = _one_product(case)
    assert views["q"].shape[1] > spec.num_heads  # k and v's heads follow q's
    want = _launch(spec, case, params, interpret=INTERPRET)
    unflat = {name: views[name].reshape(3, 2, *views[name].shape[1:]) for name in views}
    got = _launch(spec, {**case, **unflat}, params, interpret=INTERPRET, **heads)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_prologue_query_head_tiles_pallas():
    """``block_q_heads`` splits a kv head's query heads over programs (the grid's last
    axis), the same outputs as one program a kv head (Qwen3-Next's kind: 4 query heads a kv
    head, in tiles of 2 and of 1, read out of one product in place); a tile that does not divide
    them is refused. The dispatch takes the tuning's ``prologue_q_heads`` up to
    ``small_step_max_tokens`` tokens."""
    spec = _spec("qwen3_next")
    case, params = _case(np.random.default_rng(7), spec, 3, 2)
    views, heads = _one_product(case)
    unflat = {name: views[name].reshape(3, 2, *views[name].shape[1:]) for name in views}
    want = _launch(spec, case, params, interpret=INTERPRET)
    for tile in (2, 1):
        got = _launch(
            spec, {**case, **unflat}, params, interpret=INTERPRET, block_q_heads=tile, **heads
        )
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with pytest.raises(ValueError, match="block_q_heads=3"):
        _launch(spec, case, params, interpret=INTERPRET, block_q_heads=3)
    grids = {}
    for switch, rows in ((0, 1), (2, 1), (1, 1), (2, 2)):
        small, _ = _case(np.random.default_rng(8), spec, rows, 2)  # 2 or 4 tokens
        tuning = Tuning().with_overrides({"attention.prologue_q_heads": switch})

        def run(q, small=small, tuning=tuning):
            return _dispatch(spec, {**small, "q": q}, params, lambda: None, tuning)

        jaxpr = jax.make_jaxpr(run)(small["q"]).jaxpr
        (call,) = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
        grids[switch, 2 * rows] = call.params["grid_mapping"].grid
    assert Tuning().small_step_max_tokens == 2
    want_grids = {(0, 2): (2, 2, 1), (2, 2): (2, 2, 2), (1, 2): (2, 2, 4), (2, 4): (4, 2, 1)}
    assert grids == want_grids, grids


def test_prologue_refuses_heads_outside_the_product():
    """k or v heads past the array's end, or more query heads than q holds, are refused."""
    spec = _spec("qwen3_next")
    case, params = _case(np.random.default_rng(6), spec, 2, 1)
    views, heads = _one_product(case)
    unflat = {name: views[name].reshape(2, 1, *views[name].shape[1:]) for name in views}
    total = views["k"].shape[1]
    for bad in ({"v_head_at": total - 1}, {"k_head_at": -1}):
        with pytest.raises(ValueError, match="heads from"):
            _launch(spec, {**case, **unflat}, params, interpret=INTERPRET, **{**heads, **bad})
    with pytest.raises(ValueError, match=">= 40 heads"):
        _launch(spec, {**case, **unflat}, params, interpret=INTERPRET, **{**heads, "num_heads": 40})


def test_prologue_lowers_to_one_triton_call_at_qwen3_next_widths():
    """The CUDA lowering (built on CPU, not compiled) of the launch at Qwen3-Next's widths
    (16 query heads with their gates, 2 kv heads, head dim 256, 64 rotated channels) is one
    Triton call: every block and piece fits Triton's powers of two; likewise reading them
    out of q, k and v's one product."""
    from lazyspec.kernels.common import pallas_compiler_params

    spec = jax.ShapeDtypeStruct
    bf16, i32 = jnp.bfloat16, jnp.int32

    def launch(q, k, v, *operands, block_q_heads=None, **heads):  # then the norms' weights
        return attention_prologue_pallas(
            QKVHeads(q, k, v, **heads),
            *operands[:5],
            prep=HeadPrep(*operands[5:], 1e-6, True, 64, 10_000_000.0),
            block_q_heads=block_q_heads,
            compiler_params=pallas_compiler_params("gpu"),
        )

    args = (
        spec((4, 16, 512), bf16),
        spec((4, 2, 256), bf16),
        spec((4, 2, 256), bf16),
        *(spec((2, 2), i32),) * 2,
        spec((2,), i32),
        *(spec((1000, 2, 256), bf16),) * 2,
        *(spec((256,), bf16),) * 2,
    )
    text = jax.jit(launch).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    split = jax.jit(functools.partial(launch, block_q_heads=2)).trace(*args)  # 4 tiles a kv head
    assert split.lower(lowering_platforms=("cuda",)).as_text().count("__gpu$xla.gpu.triton") == 1
    # read in place out of q, k and v's one product: [4, 16 * 512 + 2 * 2 * 256]
    views = (spec((4, 18, 512), bf16), spec((4, 36, 256), bf16), spec((4, 36, 256), bf16))
    heads = {"num_heads": 16, "k_head_at": 32, "v_head_at": 34}
    one = jax.jit(functools.partial(launch, **heads)).trace(*views, *args[3:])
    assert one.lower(lowering_platforms=("cuda",)).as_text().count("__gpu$xla.gpu.triton") == 1


LIMIT = Tuning().attention.prologue_max_tokens


@pytest.mark.parametrize("tokens", [LIMIT, LIMIT + 1])
def test_dispatch_runs_the_kernel_up_to_the_limit(tokens):
    """Up to ``AttentionTuning.prologue_max_tokens`` tokens the backend's launch; beyond, the
    caller's form (called once, its result returned)."""
    spec = _spec("qwen3_next")
    case, params = _case(np.random.default_rng(2), spec, 1, tokens, pool_rows=2 * LIMIT)
    calls = []

    def xla_form():
        calls.append(tokens)
        return _model_ops(spec, case, params)

    got = _dispatch(spec, case, params, xla_form)
    assert calls == ([tokens] if tokens > LIMIT else [])
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(xla_form()[0]))


def test_xla_and_tpu_kernels_have_no_prologue():
    assert backend.kernels_for("xla", "cpu").attention_prologue is None
    assert backend.kernels_for("pallas", "tpu").attention_prologue is None


@pytest.mark.parametrize("kind,compiled", [("qwen3_next", True), ("five_a_kv_head", False)])
def test_compiled_dispatch_needs_power_of_two_blocks(monkeypatch, kind, compiled):
    """Compiled (as on a GPU), the dispatch launches where every block and piece is a
    power of two (the tiny Qwen3-Next heads), else it runs the caller's form (10 query
    heads on 2 kv heads: 5 a kv head, not a Triton block)."""
    spec = _spec("qwen3_next")
    if kind == "five_a_kv_head":
        spec = AttentionSpec(10, 2, 32, rotary_dim=8, qk_norm=True, output_gate=True)
    case, params = _case(np.random.default_rng(9), spec, 1, 1)
    launched = []
    monkeypatch.setattr(
        attention_dispatch,
        "pallas_options",
        lambda *a: {"interpret": False, "compiler_params": None},
    )
    monkeypatch.setattr(
        attention_dispatch,
        "attention_prologue_pallas",
        lambda *a, **k: launched.append(1) or "kernel",
    )
    flat = lambda a: a.reshape(-1, *a.shape[2:])  # noqa: E731
    got = backend.kernels_for("pallas", "cpu").attention_prologue(
        *(flat(case[name]) for name in ("q", "k", "v")),
        *(case[name] for name in ("positions", "write_idx", "num_new", "k_pool", "v_pool")),
        params["q_norm"],
        params["k_norm"],
        eps=spec.norm_eps,
        rotary_dim=spec.rotary_dim,
        xla_form=lambda: "xla",
    )
    assert got == ("kernel" if compiled else "xla") and len(launched) == int(compiled)
