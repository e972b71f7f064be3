"""One tensor-parallel size's checks, run in a fresh process that sees fake CPU devices.

``python -m tests.engine.tp_worker TP`` (with ``XLA_FLAGS=--xla_force_host_platform_device_count``
set before jax is imported) serves a multi-turn workload on tiny Qwen3-Next and Qwen3.5
(speculative), Nemotron-H and Granite 4.0-H engines, then walks every weight and pool, and
prints one JSON line: the outputs and cached tokens, the shardings that differ from the rule
table's, and the bytes per device; and the outputs of a shorter workload with the Pallas
kernels (interpret mode) per shard.
"""

from __future__ import annotations

import functools
import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from lazyspec.engine.engine import Engine
from lazyspec.engine.sharding import (
    CONV_POOL_AXES,
    KV_POOL_AXES,
    RULES,
    SSM_POOL_AXES,
    TP_AXIS,
    sharding_plan,
)
from lazyspec.models.plan import leaf_axes
from lazyspec.testing.collector import quiet_collector
from lazyspec.testing.tiny_models import (
    GRANITE_HF,
    NEMOTRON_HF,
    QWEN35_HF,
    QWEN_HF,
    build_tiny_model,
)

# tp = 4 (the test's one size above 1) holds two or more query, GDN and Mamba2 heads per
# device: eight attention heads, eight GDN key heads (sixteen value heads), eight Mamba2 heads.
# Each way of placing the KV heads and the Mamba2 groups is some family's: the KV heads
# split (Qwen3-Next, Granite 4.0-H: four) or replicated (Nemotron-H, Qwen3.5: two), the
# Mamba2 groups split (Nemotron-H: four) or repeated (Granite 4.0-H: one).
HEADS = dict(num_attention_heads=8)
GDN_HEADS = dict(HEADS, linear_num_key_heads=8, linear_num_value_heads=16)
QWEN_TP_HF = dict(QWEN_HF, **GDN_HEADS, num_key_value_heads=4)
QWEN35_TP_HF = dict(QWEN35_HF, **GDN_HEADS)
NEMOTRON_TP_HF = dict(NEMOTRON_HF, **HEADS, mamba_num_heads=8, n_groups=4)
GRANITE_TP_HF = dict(GRANITE_HF, **HEADS, num_key_value_heads=4, mamba_n_heads=8, mamba_d_head=8)
FAMILIES = {
    "qwen3_next": (QWEN_TP_HF, True),
    "nemotron_h": (NEMOTRON_TP_HF, False),
    "qwen3_5": (QWEN35_TP_HF, True),
    "granitemoehybrid": (GRANITE_TP_HF, False),
}


# the tiny engines of the tensor-parallel runs (multihost_worker's too)
SETTINGS = dict(
    mamba_scheduler_strategy="extra_buffer_lazy",
    mamba_track_interval=16,
    mamba_chunk_size=16,
    chunked_prefill_size=16,
    max_running_requests=2,
    max_total_tokens=1024,
)


def tiny(family: str) -> SimpleNamespace:
    return build_tiny_model(FAMILIES[family][0])


def workload(
    engine: Engine, lengths: tuple[int, ...] = (13, 21), logprobs: bool = False
) -> list[list]:
    """Two turns of one conversation per prompt length, the conversations side by side (the
    turns of all of them in one batch; turn 2 extends turn 1's prompt and output): [output
    ids, cached tokens] per request, and its output logprobs if asked."""
    rng = np.random.default_rng(0)
    params = {"max_new_tokens": 6, "ignore_eos": True}

    def result(out: dict) -> list:
        meta = out["meta_info"]
        if not logprobs:
            return [out["output_ids"], meta["cached_tokens"]]
        return [
            out["output_ids"],
            meta["cached_tokens"],
            [lp for lp, _ in meta["output_token_logprobs"]],
        ]

    def turn(prompts: list[list[int]]) -> list[dict]:
        outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=logprobs)
        engine.check_integrity()
        return outs if isinstance(outs, list) else [outs]

    prompts = [[int(t) for t in rng.integers(3, 128, size=length)] for length in lengths]
    first = turn(prompts)
    second = turn([p + out["output_ids"] + [5, 6, 7] for p, out in zip(prompts, first)])
    return [result(r) for pair in zip(first, second) for r in pair]


def expected_shard_shape(shape, axes, tp: int, kv_heads: int) -> tuple[int, ...]:
    """The shard shape the rule table gives, derived here independently of the engine."""
    table = dict(RULES)
    out = []
    for size, name in zip(shape, axes or (None,) * len(shape)):
        split = table.get(name) == TP_AXIS and size % tp == 0
        if name == "kv_heads" and tp > kv_heads:
            split = False
        out.append(size // tp if split else size)
    return tuple(out)


def walk(engine: Engine, tp: int) -> tuple[list[str], int, int, int]:
    """(mismatches, sharded arrays, their bytes on device 0, their total bytes)."""
    runner = engine.runner
    cfg = runner.cfg
    plan = runner.family.weight_plan(cfg, runner.params)
    axes = jax.tree.leaves(leaf_axes(plan))
    arrays = jax.tree.leaves_with_path(runner.params)
    pools = runner.pools
    named = [(jax.tree_util.keystr(p), a, tuple(x)) for (p, a), x in zip(arrays, axes)]
    for kv in (pools.kv, pools.mtp_kv):
        if kv is not None:
            named += [("kv", pool, KV_POOL_AXES) for pool in kv.k + kv.v]
    named += [("conv", pools.conv, CONV_POOL_AXES), ("ssm", pools.ssm, SSM_POOL_AXES)]
    named += [
        (name, getattr(pools, name), ())
        for name in ("seq_len", "last_token", "drafts", "req_to_token")
    ]
    mesh_devices = set(runner.sharding.mesh.devices.flat)
    errors, num_sharded, device_bytes, total_bytes = [], 0, 0, 0
    for name, array, leaf_axes_ in named:
        want = expected_shard_shape(array.shape, leaf_axes_, tp, cfg.num_kv_heads)
        shards = array.addressable_shards
        got = {tuple(s.data.shape) for s in shards}
        if got != {want} or {s.device for s in shards} != mesh_devices:
            errors.append(f"{name}: shards {sorted(got)} on {len(shards)} devices, want {want}")
        if want != tuple(array.shape):
            num_sharded += 1
            first = min(shards, key=lambda s: s.device.id)
            device_bytes += first.data.nbytes
            total_bytes += array.nbytes
    return errors, num_sharded, device_bytes, total_bytes


def loading(tp: int, folder: Path) -> dict[str, list[str]]:
    """Checkpoints loaded straight into shards equal the whole-tensor load (per-expert and
    fused expert layouts); dummy weights land sharded as the rule table says."""
    from lazyspec.models import load_model
    from tests.models.tiny_qwen import config_dict, write_checkpoint

    config = config_dict(
        "moe", num_nextn_predict_layers=1, linear_num_key_heads=4, linear_num_value_heads=8
    )
    report: dict[str, list[str]] = {}
    for layout, fused in (("per_expert", False), ("fused", True)):
        where = folder / layout
        where.mkdir()
        write_checkpoint(where, config, seed=1, fused_experts=fused)
        whole = load_model(where)
        plan = sharding_plan(whole.config, tp)
        sharded = load_model(where, place=plan.sharding)
        errors = []
        for (path, want), got in zip(
            jax.tree.leaves_with_path(whole.params), jax.tree.leaves(sharded.params)
        ):
            if not np.array_equal(np.asarray(want), np.asarray(got)):
                errors.append(f"{jax.tree_util.keystr(path)}: values differ")
        engine = Engine(model=sharded, tp_size=tp, skip_warmup=True, max_total_tokens=256)
        errors += walk(engine, tp)[0]
        report[layout] = errors
    engine = Engine(
        model_path=str(folder / "fused"),
        load_format="dummy",
        tp_size=tp,
        skip_warmup=True,
        max_total_tokens=256,
    )
    report["dummy"] = walk(engine, tp)[0]
    return report


def engine_for(family: str, tp: int, **kw) -> Engine:
    if FAMILIES[family][1]:
        kw["speculative_algorithm"] = "NEXTN"
    return Engine(
        model=tiny(family), tp_size=tp, **SETTINGS, context_length=128, skip_warmup=True, **kw
    )


# interpret-mode Pallas is slow on CPU: one family of each recurrent layer kind
PALLAS_FAMILIES = ("qwen3_next", "nemotron_h")


def pallas_run(family: str, tp: int) -> dict:
    """The Pallas kernels (interpret mode) on one conversation: outputs, cached tokens,
    logprobs and the mesh size the kernels run per shard over (0: whole arrays)."""
    engine = engine_for(family, tp, kernel_backend="pallas")
    kernels = engine.runner.static.kernels
    mesh_size = 0 if kernels.mesh is None else kernels.mesh.size
    return {"outputs": workload(engine, (13,), logprobs=True), "kernels_mesh_size": mesh_size}


def decode_update_diffs(tp: int) -> dict[str, float]:
    """Largest difference between the per-shard and the whole-array Pallas state update in
    decode mode (the pool written in place, as a decode step without speculation does) on
    random inputs at the tiny models' shapes, per mixer: outputs and the updated pool; and
    likewise for the state copy (both pools)."""
    from lazyspec.engine.shard_kernels import per_shard
    from lazyspec.kernels.backend import kernels_for
    from lazyspec.kernels.state.update_common import GdnTokens, Mamba2Tokens
    from lazyspec.kernels.tuning import Tuning

    rng = np.random.default_rng(tp)
    whole = kernels_for("pallas", "cpu")
    sharded = per_shard(whole, sharding_plan(tiny("qwen3_next").config, tp))
    assert sharded.mesh is not None
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    rows, steps = 3, 2
    slot = jnp.asarray([2, 1, 0], jnp.int32)  # row 2 pads: slot 0 is never written
    cases = {
        "gdn": (
            normal(2, 4, 8, 8, 8),
            GdnTokens(
                q=normal(rows, steps, 8, 8),
                k=normal(rows, steps, 8, 8) * 0.3,
                v=normal(rows, steps, 8, 8),
                g=-jnp.abs(normal(rows, steps, 8)),
                beta=jax.nn.sigmoid(normal(rows, steps, 8)),
            ),
        ),
        "mamba2": (
            normal(2, 4, 4, 8, 16),
            Mamba2Tokens(
                x=normal(rows, steps, 4, 8),
                b=normal(rows, steps, 2, 16),
                c=normal(rows, steps, 2, 16),
                dt=jnp.abs(normal(rows, steps, 4)),
                a=-jnp.abs(normal(4)),
                d=normal(4),
            ),
        ),
    }
    diffs = {}
    for mixer, (pool, tokens) in cases.items():
        name = f"{mixer}_state_update"

        def update(kernels, pool, tokens, name=name):
            return getattr(kernels, name)(pool, slot, tokens, mode="decode", layer=1)

        want = jax.jit(functools.partial(update, whole))(pool, tokens)
        got = jax.jit(functools.partial(update, sharded))(pool, tokens)
        assert float(jnp.max(jnp.abs(want.pool - pool))) > 0  # the slots were written
        diffs[mixer] = max(
            float(jnp.max(jnp.abs(got.outputs - want.outputs))),
            float(jnp.max(jnp.abs(got.pool - want.pool))),
        )
    pools = (normal(2, 6, 8, 8, 8), normal(2, 6, 16, 3))
    src = jnp.asarray([1, 2, 0], jnp.int32)
    dst = jnp.asarray([4, 0, 0], jnp.int32)  # row 1 copies nothing, row 2 pads
    want = jax.jit(whole.state_copy)(*pools, src, dst)
    got = jax.jit(sharded.state_copy)(*pools, src, dst)
    for new, old in zip(want, pools):
        assert float(jnp.max(jnp.abs(new - old))) > 0  # slot 4 was written
    diffs["state_copy"] = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(got, want))
    # the routed experts past the kernel's token limit: in pieces, per shard as whole
    small = Tuning().with_overrides({"moe.kernel_max_tokens": 12})
    whole = kernels_for("pallas", "cpu", tuning=small)
    moe = per_shard(whole, sharding_plan(tiny("qwen3_next").config, tp)).moe_experts
    stacks = (normal(8, 32, 16) * 0.3, normal(8, 16, 32) * 0.3, normal(8, 32, 16) * 0.3)
    ids = jnp.asarray(np.argsort(rng.random((29, 8)), axis=1)[:, :2], jnp.int32)
    routed = (normal(29, 32), jnp.abs(normal(29, 2)), ids, *stacks)
    no_xla = lambda: None  # noqa: E731 (never called: both run the kernel)
    want = jax.jit(lambda *a: whole.moe_experts(*a, xla_form=no_xla))(*routed)
    per_device = jax.make_jaxpr(lambda *a: moe(*a, xla_form=no_xla))(*routed)
    assert "shard_map" in str(per_device)  # the experts split over the devices
    got = jax.jit(lambda *a: moe(*a, xla_form=no_xla))(*routed)
    diffs["moe_pieces"] = float(jnp.max(jnp.abs(got - want)))
    return diffs


def triton_calls(tp: int) -> dict[str, int]:
    """Triton calls in the CUDA lowering (built, not compiled) of the per-shard Mamba2 state
    update (one group of B / C: repeated per device), state scatter, state copy and paged
    attention with its output gate over ``tp`` KV heads (split) and over 2 (fewer than tp:
    replicated, one branch per KV head; the attention launch and the combine's in each) at
    model-sized shapes, each kernel in its Triton (not interpret) launch."""
    from lazyspec.engine import shard_kernels as sk
    from lazyspec.kernels.attention import paged as pa
    from lazyspec.kernels.attention.inputs import PagedInputs
    from lazyspec.kernels.common import pallas_compiler_params
    from lazyspec.kernels.mamba2 import update as mamba2_update
    from lazyspec.kernels.state import scatter as ss
    from lazyspec.kernels.state import update_common as su

    plan = sharding_plan(tiny("qwen3_next").config, tp)
    params = pallas_compiler_params("gpu")
    spec = jax.ShapeDtypeStruct
    f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32
    rows, steps, heads, channels = 4, 4, 8, 10240
    update = sk._state_update(
        functools.partial(
            mamba2_update.mamba2_state_update_pallas,
            tiles=su.UpdateTiles(block_value=32),
            compiler_params=params,
        ),
        plan,
    )
    tokens = su.Mamba2Tokens(
        spec((rows, steps, heads, 64), bf16),
        *(spec((rows, steps, 1, 128), bf16),) * 2,
        spec((rows, steps, heads), f32),
        *(spec((heads,), f32),) * 2,
    )
    blocks = ss.PoolBlocks(block_rows=32, block_channels=512)
    scatter = sk._state_scatter(
        functools.partial(ss.state_scatter_pallas, blocks=blocks, compiler_params=params),
        plan,
    )
    copy = sk._state_copy(
        functools.partial(ss.state_copy_pallas, blocks=blocks, compiler_params=params),
        plan,
    )

    def kernel_attention(inputs, scale, *, kv_head=None, gate=None):  # the default plan
        layout = pa.PagedPlan(kv_head=kv_head)
        return pa.paged_attention(inputs, scale, gate=gate, plan=layout, compiler_params=params)

    attention = sk._paged_attention(kernel_attention, plan)
    cases = {
        "mamba2_state_update": (
            lambda p, s, t: update(p, s, t, mode="verify", layer=1),
            (spec((3, 9, heads, 64, 128), f32), spec((rows,), i32), tokens),
        ),
        "state_scatter": (
            scatter,
            (
                spec((4, 9, heads, 64, 128), f32),
                spec((4, 9, channels, 3), bf16),
                spec((4, rows, steps, heads, 64, 128), f32),
                spec((4, rows, steps, channels, 3), bf16),
                spec((rows,), i32),
                spec((rows,), i32),
            ),
        ),
        "state_copy": (
            copy,
            (
                spec((4, 9, heads, 64, 128), f32),
                spec((4, 9, channels, 3), bf16),
                spec((rows,), i32),
                spec((rows,), i32),
            ),
        ),
    }
    for name, kv_heads in (("paged_attention", tp), ("paged_attention_replicated", 2)):
        cases[name] = (
            lambda *a: attention(PagedInputs(*a[:6]), 0.0625, gate=a[6]),
            (
                spec((rows, 1, 16, 256), bf16),
                *(spec((1000, kv_heads, 256), bf16),) * 2,
                spec((rows, 300), i32),
                spec((rows,), i32),
                spec((rows, 1), i32),
                spec((rows, 1, 16, 256), bf16),
            ),
        )
    counts = {}
    for name, (fn, args) in cases.items():
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        counts[name] = text.count("__gpu$xla.gpu.triton")
    return counts


def run(tp: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        report = {"loading": loading(tp, Path(folder))}
    report["pallas"] = {family: pallas_run(family, tp) for family in PALLAS_FAMILIES}
    report["decode_update_diffs"] = decode_update_diffs(tp) if tp > 1 else {}
    report["triton_calls"] = triton_calls(tp) if tp > 1 else {}
    for family in FAMILIES:
        engine = engine_for(family, tp)
        outputs = workload(engine)
        errors, num_sharded, device_bytes, total_bytes = walk(engine, tp)
        report[family] = {
            "outputs": outputs,
            "sharding_errors": errors,
            "num_sharded": num_sharded,
            "device_bytes": device_bytes,
            "total_bytes": total_bytes,
            "memory_plan": engine.memory_plan,
        }
    return report


if __name__ == "__main__":
    quiet_collector()  # as the suite's own processes (tests/conftest.py)
    print(json.dumps(run(int(sys.argv[1]))))
