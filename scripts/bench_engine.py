"""Decode step time of the engine against the floor of the bytes a step moves.

For each batch size, that many requests (random prompts, ignore_eos) are admitted together
and decoded to the end; every engine-loop step is timed (host work included, as served),
then the widest decode step is re-run alone back to back (device time). The floor of a step
is the bytes it must move (``lazyspec.bench.floor``: weights touched, routed experts by
their expected share; recurrent state read and written; KV read) over the copy bandwidth
measured in the same run; "% of floor" is floor time over step time. Random weights: the
numbers are about speed, not text (and the random MTP head's accept length is ~1).

    python scripts/bench_engine.py --preset qwen3_next_moe --batches 1,16,64 --spec
    python scripts/bench_engine.py --preset granite_h --profile /tmp/prof   # + breakdown
    python scripts/bench_engine.py --preset tiny --backends xla --batches 1,4   # CPU smoke
    python scripts/bench_engine.py --memory --preset medium --backends xla --batch 16 --spec
    python scripts/bench_engine.py --preset qwen3_next_moe --prefill-lens 4096,32768 --peer
    python scripts/bench_engine.py --preset qwen3_next_moe --startup --batch 64 --context 1024

``--profile DIR`` adds, per row, the device step of the re-run steps as it runs (median
span from a step's first kernel's start to its last kernel's end, its kernels' busy time,
and the floor's share of the span), the device time split by the named scopes of the layers
and steps (attention, recurrent, moe, mlp, lm_head, sampling, state_commit, draft), the
kernels a step runs, and "host" = engine-loop step minus the kernels' time; each row's
folder gets ``ops.json`` (every executed op: scope, count and time per step) and the
compiled step's HLO (``decode_step.hlo.txt``, the ops' shapes). On a GPU the span is the
step as served with XLA's command buffers (CUDA graphs) on; the split by scope needs them
off (``XLA_FLAGS=--xla_gpu_enable_command_buffer=``: inside a graph the kernels' ops do not
map to the HLO's scopes and all fall under "other"), which launches every kernel alone and
so lengthens the span.
``--decode-steps 1,2`` adds rows whose engine runs K decode steps per program
(``num_continuous_decode_steps``, no speculation; "K steps" in the spec column): their
times (loop, alone, host calls, device span and breakdown) are per token step, a
program's time over K, against the floor of one step.
``--prefill-lens`` prints, instead of decode rows, prefill rows against the compute floor
(``lazyspec.bench.prefill``: FLOPs counted over the bf16 matmul rate measured in the same
run; transformers' forward as the peer with ``--peer``; with ``--profile``, one more
prefill a row under the profiler: its device ms by scope and its longest ops, command
buffers off as above); ``--startup`` times the engine's construction, to ready and to its
whole program table compiled.
``--memory`` reports, instead of timings, XLA's memory analysis of the compiled decode step
at the batch's widest shape. On CPU only the xla backend is meaningful (Pallas runs
interpreted there).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np

from lazyspec.testing.tiny_models import QWEN_HF

# Qwen3-Next-80B's attention and GDN widths (16 q / 2 kv heads of 256; 16 key / 32 value GDN
# heads of 128), three GDN layers per attention layer, on 8 layers
_QWEN_LAYERS = ["linear_attention"] * 3 + ["full_attention"]
_QWEN_WIDTHS = dict(
    hidden_size=2048,
    num_hidden_layers=8,
    layer_types=_QWEN_LAYERS * 2,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    partial_rotary_factor=0.25,
    rms_norm_eps=1e-6,
    eos_token_id=0,
    max_position_embeddings=262144,
)
# a routed-expert MLP of intermediate 512 beside a shared expert of 512
_MOE_512 = dict(moe_intermediate_size=512, shared_expert_intermediate_size=512)

PRESETS = {
    # the widths above, dense MLP
    "medium": dict(
        _QWEN_WIDTHS,
        model_type="qwen3_next",
        intermediate_size=5632,
        num_experts=0,
        vocab_size=32000,
        rope_theta=10000.0,
        num_nextn_predict_layers=1,
    ),
    # Qwen3-Next-80B-A3B's widths and MoE (512 experts there: 64 here, top-10, expert and
    # shared-expert intermediate 512) on 8 layers, with its MTP head: ~2.5 B params
    "qwen3_next_moe": dict(
        _QWEN_WIDTHS,
        **_MOE_512,
        model_type="qwen3_next",
        intermediate_size=5120,
        num_experts=64,
        num_experts_per_tok=10,
        norm_topk_prob=True,
        vocab_size=151936,
        rope_theta=10000000.0,
        num_nextn_predict_layers=1,
    ),
    # transformers' Qwen3_5MoeTextConfig defaults (256 experts, top-8, 248k vocabulary) on 8
    # layers, with an MTP layer
    "qwen35_moe": dict(
        {k: v for k, v in _QWEN_WIDTHS.items() if k != "partial_rotary_factor"},
        **_MOE_512,
        model_type="qwen3_5_moe_text",
        num_experts=256,
        num_experts_per_tok=8,
        vocab_size=248320,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
        },
        mtp_num_hidden_layers=1,
    ),
    # Granite-4.0-H-Tiny's widths (hidden 1536, 48 Mamba2 heads of 64, state 128, 64 experts
    # top-6 of intermediate 512, shared MLP 1024, no positional embedding) on 8 layers, one
    # of them attention
    "granite_h": dict(
        model_type="granitemoehybrid",
        hidden_size=1536,
        num_hidden_layers=8,
        layer_types=["mamba"] * 3 + ["attention"] + ["mamba"] * 4,
        num_attention_heads=12,
        num_key_value_heads=4,
        mamba_n_heads=48,
        mamba_d_head=64,
        mamba_d_state=128,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_expand=2,
        num_local_experts=64,
        num_experts_per_tok=6,
        intermediate_size=512,
        shared_intermediate_size=1024,
        vocab_size=100352,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.0078125,
        logits_scaling=6.0,
        position_embedding_type="nope",
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        eos_token_id=0,
        max_position_embeddings=131072,
    ),
    # a CPU smoke preset: the tests' tiny Qwen3-Next (MoE, MTP) at twice their widths
    "tiny": dict(
        QWEN_HF,
        hidden_size=64,
        intermediate_size=128,
        layer_types=_QWEN_LAYERS,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=8,
        moe_intermediate_size=32,
        vocab_size=512,
        eos_token_id=0,
        max_position_embeddings=8192,
    ),
}


# Qwen3-Next-80B-A3B's whole configuration (its config.json): the widths above on 48 layers
# with 512 experts top-10, ~81 B params (~163 GB in bf16: --tp-size 2 or more on H200s)
PRESETS["qwen3_next_80b"] = dict(
    PRESETS["qwen3_next_moe"], num_hidden_layers=48, layer_types=_QWEN_LAYERS * 12, num_experts=512
)


def build_model(preset: str, dtype: str, tp_size: int = 1):
    """A random-weight model of ``preset`` in ``dtype``: the engine's ``--load-format dummy``
    path, each device drawing its own shards of the ``tp_size`` mesh."""
    import json
    import tempfile

    from lazyspec.engine.sharding import sharding_plan
    from lazyspec.models.registry import load_model, parse_hf_config

    folder = Path(tempfile.mkdtemp(prefix=f"bench-{preset}-"))
    (folder / "config.json").write_text(json.dumps(PRESETS[preset]))
    plan = sharding_plan(parse_hf_config(dict(PRESETS[preset])), tp_size)
    start = time.perf_counter()
    model = load_model(folder, dtype=dtype, place=plan.sharding, load_format="dummy")
    print(f"{preset}: random weights on {tp_size} device(s) in {time.perf_counter() - start:.1f} s")
    return model


def engine_settings(args, backend: str, rows: int, context: int) -> dict:
    """The Engine settings every row shares: the flags' backend, dtype, mesh, page size and
    tuning, ``rows`` running requests of up to ``context`` tokens each."""
    return dict(
        kernel_backend=backend,
        moe_runner_backend=args.moe_runner_backend,
        dtype=args.dtype,
        tp_size=args.tp_size,
        max_running_requests=rows,
        context_length=context,
        max_total_tokens=rows * context,
        page_size=args.page_size,
        kernel_tuning=getattr(args, "kernel_tuning", ""),
    )


def nextn_settings(args) -> dict:
    """The Engine settings of a NEXTN row: ``--spec-steps`` draft steps."""
    return dict(speculative_algorithm="NEXTN", speculative_num_steps=args.spec_steps)


def make_engine(model, backend: str, args, batch: int, spec: bool, decode_steps: int = 1):
    from lazyspec.engine.engine import Engine

    start = time.perf_counter()
    engine = Engine(
        model=model,
        **engine_settings(args, backend, batch, args.context),
        mamba_track_interval=256,
        chunked_prefill_size=args.prompt_len,
        skip_warmup=True,
        decode_program_copies=getattr(args, "decode_program_copies", None),
        num_continuous_decode_steps=decode_steps,
        **(nextn_settings(args) if spec else {}),
    )
    mib = {k: v / 2**20 for k, v in engine.runner.bytes_per_device().items() if k != "tp_size"}
    print(
        f"engine (backend {backend}, tp {args.tp_size}, {batch} rows, page size "
        f"{engine.layout.page_size}) in "
        f"{time.perf_counter() - start:.1f} s; MiB per device: "
        + ", ".join(f"{k.removesuffix('_bytes_per_device')} {v:.0f}" for k, v in mib.items()),
        flush=True,
    )
    return engine


class _WidestDecode:
    """Stands in for the runner's decode step (its ``StepCalls``): calls it and keeps, of its
    widest call (most rows), the batch (to re-run the step alone) and the abstract arguments
    (to lower it again). The abstract arguments are taken only when the widest call changes,
    so the served steps carry no extra host work. The step is handed its batch's words and
    writes its outputs over them, so the batch is kept with its words on the host: each
    re-run moves them to the device afresh, as the engine does each step."""

    def __init__(self, jitted):
        self.jitted, self.batch, self.args, self.rows = jitted, None, None, -1

    def __call__(self, params, pools, batch):
        rows = batch.num_rows  # a PackedBatch
        if rows > self.rows:
            import jax

            to_abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
            self.args = jax.tree.map(to_abstract, (params, pools, batch))
            self.batch = dataclasses.replace(batch, words=np.asarray(batch.words))
            self.rows = rows
        return self.jitted(params, pools, batch)


def _compiled_decode(runner, params, pools, batch):
    """The runner's decode step compiled for these (concrete or abstract) arguments."""
    return _compiled(runner, runner.programs.decode, params, pools, batch)


def _compiled(runner, program, params, pools, batch):
    """The runner's ``program`` (one of ``runner.programs``) compiled for these arguments."""
    static = (runner.family, runner.cfg, runner.static, runner.sharding)
    return program.lower(*static, params, pools, batch).compile()


def _ms_by_category(ops: list[dict[str, Any]], calls: int = 1) -> dict[str, float]:
    """Device milliseconds a call by breakdown category of ``device_ops``' rows, in
    ``floor.BREAKDOWN_ORDER`` whatever order the ops came in: tables of several runs read
    column for column."""
    from lazyspec.bench.floor import BREAKDOWN_ORDER

    out: dict[str, float] = {}
    for r in sorted(ops, key=lambda r: BREAKDOWN_ORDER.index(r["category"])):
        out[r["category"]] = out.get(r["category"], 0.0) + 1e3 * r["s"] / calls
    return out


def served_engine(model, backend: str, args, batch: int, spec: bool):
    """An engine (``make_engine``) that has served ``batch`` random prompts of
    ``args.prompt_len`` tokens for 8 new tokens (every shape of that workload compiled), and
    the ``_WidestDecode`` its decode step was called through."""
    engine = make_engine(model, backend, args, batch, spec)
    recorder = _WidestDecode(engine.runner._decode)
    engine.runner._decode = recorder
    rng = np.random.default_rng(0)
    prompts = [
        [int(t) for t in rng.integers(1, model.config.vocab_size, size=args.prompt_len)]
        for _ in range(batch)
    ]
    engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 8, "ignore_eos": True})
    bind_decode(engine.runner, recorder.rows)
    return engine, recorder


def bind_decode(runner, rows: int) -> int:
    """Bind the decode programs of ``rows`` rows to the runner (``Runner.bind``) as warm-up
    binds a served engine's table, so that the timed steps call what serving calls (the
    engines here skip warm-up: compiling every program would take minutes); how many."""
    from lazyspec.engine.programs import DECODE

    programs = [p for p in runner.program_table() if p.key.kind == DECODE and p.key.rows == rows]
    for program in programs:
        runner.bind(program.key, program.compile())
    return len(programs)


def decode_memory(model, backend: str, args) -> dict:
    """XLA's memory analysis of the decode step compiled at the widest shape served."""
    engine, recorder = served_engine(model, backend, args, args.batch, args.spec)
    analysis = _compiled_decode(engine.runner, *recorder.args).memory_analysis()
    mib = lambda n: n / 2**20  # noqa: E731
    return {
        "backend": backend,
        "batch": args.batch,
        "rows": recorder.rows,
        "temp_mib": mib(analysis.temp_size_in_bytes),
        "argument_mib": mib(analysis.argument_size_in_bytes),
        "output_mib": mib(analysis.output_size_in_bytes),
        "alias_mib": mib(analysis.alias_size_in_bytes),
    }


def _step_alone_seconds(engine, batch, calls: tuple[int, int] = (2, 12), iters: int = 5):
    """Device seconds of one decode step on ``batch``, launched back to back: chains of n1 and
    n2 steps (each ending in one sync), the difference of their medians over n2 - n1."""
    import jax

    runner = engine.runner
    step = runner._decode.jitted

    def chain(n):
        for _ in range(n):
            out, runner.pools = step(runner.params, runner.pools, batch)
        jax.block_until_ready(out)

    medians = []
    for n in calls:
        chain(n)
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            chain(n)
            samples.append(time.perf_counter() - t0)
        medians.append(float(np.median(samples)))
    return (medians[1] - medians[0]) / (calls[1] - calls[0])


def _profile(engine, batch, out_dir: Path, calls: int = 10) -> dict[str, Any]:
    """``calls`` decode steps on ``batch`` under the JAX profiler: ``breakdown_ms``, device
    milliseconds per step by category (lazyspec.bench.floor.device_ops summed by category,
    as ``device_breakdown`` sums them, from one read of the trace); ``kernels``, the kernels
    a step ran; ``device_ms`` and ``busy_ms``, the median step's device span and its
    kernels' time (``device_spans``). Every executed op, its scope and time per
    step go to ``out_dir / "ops.json"``, the compiled step's HLO (the ops' shapes) to
    ``decode_step.hlo.txt``."""
    import json
    import shutil

    import jax

    from lazyspec.bench.floor import device_ops, device_spans

    runner = engine.runner
    step = runner._decode.jitted
    hlo = _compiled_decode(runner, runner.params, runner.pools, batch).as_text()
    shutil.rmtree(out_dir, ignore_errors=True)
    with jax.profiler.trace(str(out_dir), create_perfetto_trace=True):
        for _ in range(calls):
            out, runner.pools = step(runner.params, runner.pools, batch)
        jax.block_until_ready(out)
    ops = device_ops(out_dir, hlo, "decode_step")
    breakdown_ms = _ms_by_category(ops, calls)
    per_step = [
        {
            "op": r["op"],
            "scope": r["scope"],
            "category": r["category"],
            "count": r["count"] / calls,
            "us": 1e6 * r["s"] / calls,
        }
        for r in ops
    ]
    (out_dir / "ops.json").write_text(json.dumps(per_step, indent=1))
    (out_dir / "decode_step.hlo.txt").write_text(hlo)
    spans = device_spans(out_dir, "decode_step", calls)
    return {
        "breakdown_ms": breakdown_ms,
        "kernels": sum(r["count"] for r in per_step),
        "device_ms": 1e3 * float(np.median([s["span"] for s in spans])),
        "busy_ms": 1e3 * float(np.median([s["busy"] for s in spans])),
    }


HOST_CALLS = ("schedule", "launch", "dispatch", "fetch", "process")


def _time_host_calls(engine, recorder: _WidestDecode) -> dict[str, list[float]]:
    """Wrap the engine loop's host calls with timers (the scheduler's ``schedule`` and
    ``process``, the runner's ``launch``, its jitted decode call inside it: ``dispatch``, and
    ``fetch``, which waits for the step's outputs); returns the lists they append to."""
    seconds = {name: [] for name in HOST_CALLS}

    def timed(name, fn):
        def call(*a, **k):
            start = time.perf_counter()
            result = fn(*a, **k)
            seconds[name].append(time.perf_counter() - start)
            return result

        return call

    sched, runner = engine.scheduler, engine.runner
    sched.schedule, sched.process = (
        timed("schedule", sched.schedule),
        timed("process", sched.process),
    )
    runner.launch, runner.fetch = timed("launch", runner.launch), timed("fetch", runner.fetch)
    runner._decode = timed("dispatch", recorder)
    return seconds


def run(
    model, backend: str, args, batch: int, spec: bool, bandwidth: float, decode_steps: int = 1
) -> dict:
    """One row: ``batch`` requests decoded together (all admitted at once), timed per step in
    the engine loop and alone, against the floor of the bytes a step moves; with
    ``decode_steps`` K > 1 every time is per token step (a K-step program's over K)."""
    from lazyspec.bench.floor import shard_shapes, step_floor_bytes
    from lazyspec.engine.runner import kv_bytes_per_token, slot_bytes

    engine = make_engine(model, backend, args, batch, spec, decode_steps)
    recorder = _WidestDecode(engine.runner._decode)
    engine.runner._decode = recorder
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    prompts = [[int(t) for t in rng.integers(1, vocab, size=args.prompt_len)] for _ in range(batch)]
    params = {"max_new_tokens": args.output_len, "ignore_eos": True}
    # warm-up pass compiles the shapes this workload uses
    start = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 4, "ignore_eos": True})
    engine.flush_cache()
    bound = bind_decode(engine.runner, recorder.rows)
    seconds = time.perf_counter() - start
    print(f"  warm-up (compiles) {seconds:.1f} s, {bound} decode programs bound", flush=True)
    reqs = [engine.add_request(input_ids=p, sampling_params=params) for p in prompts]
    times = {"extend": [], "decode": []}
    host = _time_host_calls(engine, recorder)
    host_steps = []  # per decode loop step: seconds in each host call
    start = time.perf_counter()
    while engine.busy:
        kind = engine._inflight[0].kind if engine._inflight else None
        before = {name: len(calls) for name, calls in host.items()}
        t0 = time.perf_counter()
        engine.step()
        if kind is not None:
            times[kind].append(time.perf_counter() - t0)
        if kind == "decode":
            host_steps.append({k: sum(v[before[k] :]) for k, v in host.items()})
    wall = time.perf_counter() - start
    engine.runner._decode = recorder  # the re-runs below call the step's programs
    out_tokens = sum(len(r.output_ids) for r in reqs)
    decode_time = sum(times["decode"])
    per = decode_steps  # token steps per decode program
    loop_ms = 1e3 * float(np.median(times["decode"])) / per if times["decode"] else 0.0
    alone_ms = 1e3 * _step_alone_seconds(engine, recorder.batch) / per
    # one device's shards: over a mesh the floor is that of one device
    abstract = shard_shapes(engine.runner.pools)
    positions = engine.layout.num_verify
    floor = step_floor_bytes(
        shard_shapes(engine.runner.params),
        model.config,
        rows=batch,
        positions=positions,
        mean_context=args.prompt_len + args.output_len / 2,
        slot_bytes=slot_bytes(abstract),
        kv_bytes_per_token=kv_bytes_per_token(abstract),
        mtp_kv_bytes_per_token=_mtp_kv_bytes(abstract),
        tp_size=args.tp_size,
    )
    floor_ms = 1e3 * floor.total / bandwidth
    info = engine.get_server_info()
    row = {
        "preset": args.preset,
        "tp": args.tp_size,
        "backend": backend,
        "batch": batch,
        "spec": f"NEXTN {args.spec_steps}" if spec else f"{per} steps" if per > 1 else "-",
        "wall_s": wall,
        "decode_tok_s": (out_tokens - len(reqs)) / max(decode_time, 1e-9),
        "loop_ms": loop_ms,
        "alone_ms": alone_ms,
        "floor_ms": floor_ms,
        "floor_gb": floor.total / 1e9,
        "weights_gb": floor.weights / 1e9,
        "state_gb": floor.state / 1e9,
        "kv_gb": floor.kv / 1e9,
        "pct_loop": 100 * floor_ms / loop_ms if loop_ms else 0.0,
        "pct_alone": 100 * floor_ms / alone_ms if alone_ms > 0 else 0.0,
        "prefill_tok_s": args.prompt_len * len(reqs) / max(sum(times["extend"]), 1e-9),
        "accept_len": info["avg_accept_length"],
        "copies": engine.runner.decode_copies,
        # median ms per decode loop step in each host call (dispatch is inside launch)
        "host_ms": {
            name: 1e3 * float(np.median([step[name] for step in host_steps])) / per
            for name in HOST_CALLS
        },
    }
    if args.profile:
        name = f"{args.preset}-{backend}-b{batch}-{int(spec)}" + (f"-k{per}" if per > 1 else "")
        profile_dir = Path(args.profile) / name
        profile = _profile(engine, recorder.batch, profile_dir)
        profile["breakdown_ms"] = {k: v / per for k, v in profile["breakdown_ms"].items()}
        profile["kernels"] /= per
        profile["device_ms"] /= per
        profile["busy_ms"] /= per
        row.update(profile)
        row["undeviced_ms"] = max(loop_ms - sum(row["breakdown_ms"].values()), 0.0)
        row["pct_device"] = 100 * floor_ms / row["device_ms"]
    return row


def transformers_row(args, batch: int, floor_ms: float) -> dict:
    """The peer: transformers' model of the same config (random bf16 weights, on the GPU),
    ``generate`` greedy at this batch; decode ms/step is the time of ``output_len`` new
    tokens less that of one (the prefill), over ``output_len - 1``. Its kernels are
    whatever transformers picks with what is installed (fla / mamba_ssm when present)."""
    import torch
    import transformers

    hf = dict(PRESETS[args.preset])
    config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, config.vocab_size, size=(batch, args.prompt_len))
    input_ids = torch.tensor(prompts, device="cuda")

    def generate(new_tokens: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    generate(4)  # warm-up
    prefill, full = generate(1), generate(args.output_len)
    step_ms = 1e3 * (full - prefill) / (args.output_len - 1)
    return {
        "preset": args.preset,
        "tp": 1,
        "backend": f"transformers {transformers.__version__}",
        "batch": batch,
        "spec": "-",
        "loop_ms": step_ms,
        "alone_ms": float("nan"),
        "floor_ms": floor_ms,
        "pct_loop": 100 * floor_ms / step_ms,
        "pct_alone": float("nan"),
        "decode_tok_s": 1e3 * batch / step_ms,
        "accept_len": 1.0,
    }


def _mtp_kv_bytes(abstract) -> int:
    if abstract.mtp_kv is None:
        return 0
    return sum(
        int(np.prod(p.shape[1:])) * p.dtype.itemsize for p in abstract.mtp_kv.k + abstract.mtp_kv.v
    )


def copy_bandwidth(num_bytes: int) -> tuple[float, str]:
    """Bytes/s of a device-to-device copy measured now (torch's cudaMemcpy when torch sees a
    GPU, else XLA's x + 1), and the line that says so."""
    from lazyspec.bench.kernel_timing import copy_bandwidths

    found = copy_bandwidths(num_bytes, iters=20, warmup=3)
    name = "torch copy_" if "torch copy_" in found else "xla x+1"
    line = ", ".join(f"{k} {v:.0f} GB/s" for k, v in found.items())
    return found[
        name
    ] * 1e9, f"copy bandwidth ({num_bytes / 2**20:.0f} MiB): {line}; floor uses {name}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen3_next_moe")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--backends", default="pallas")
    p.add_argument(
        "--moe-runner-backend",
        choices=("auto", "xla", "pallas"),
        default="auto",
        help="routed experts' form (EngineConfig.moe_runner_backend)",
    )
    p.add_argument("--tp-size", type=int, default=1, help="devices of the tensor-parallel mesh")
    p.add_argument("--batches", default="1,16,64", help="decode batch sizes, one row each")
    p.add_argument("--batch", type=int, default=16, help="batch of --memory")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--context", type=int, default=512)
    p.add_argument(
        "--page-size",
        type=int,
        default=1,
        help="tokens per KV page (the engine's --page-size); must divide --prompt-len",
    )
    p.add_argument("--spec", action="store_true", help="also NEXTN rows (the random MTP head)")
    p.add_argument("--spec-only", action="store_true", help="only NEXTN rows")
    p.add_argument("--spec-steps", type=int, default=3)
    p.add_argument(
        "--decode-steps",
        default="1",
        help="rows per K of num_continuous_decode_steps (comma list; rows without speculation)",
    )
    p.add_argument("--copy-mib", type=int, default=1024, help="copy-bandwidth buffer size")
    p.add_argument(
        "--prefill-lens",
        default="",
        help="prompt lengths of prefill rows against the compute floor (comma list; "
        "with --peer, transformers' forward beside them); no decode rows",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="chunked_prefill_size of the prefill rows' engine (default: the engine's)",
    )
    p.add_argument(
        "--decode-program-copies",
        type=int,
        choices=(1, 2),
        default=None,
        help="EngineConfig.decode_program_copies (default: the engine's, 2 on GPU)",
    )
    p.add_argument(
        "--compile-threads",
        type=int,
        default=None,
        help="with --startup: EngineConfig.compile_threads (default: the engine's)",
    )
    p.add_argument(
        "--startup",
        action="store_true",
        help="time the engine's construction to ready and to its whole program table "
        "compiled (--batch rows, --context tokens) instead of decode rows",
    )
    p.add_argument("--profile", default=None, help="folder for profiles: adds a breakdown")
    p.add_argument(
        "--memory",
        action="store_true",
        help="report the compiled decode step's memory analysis instead of timing",
    )
    p.add_argument(
        "--peer",
        action="store_true",
        help="also transformers' model of the same config, one row per batch (GPU, torch)",
    )
    from lazyspec.bench.tuning_flag import add_tuning_argument, tuning_lines

    add_tuning_argument(p)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from lazyspec.bench.origin import code_line, device_line

    print(code_line(), flush=True)  # one tree's code, or a clear error before any work
    device = device_line()
    print(device, flush=True)
    for line in tuning_lines(args.kernel_tuning):
        print(line, flush=True)
    model = build_model(args.preset, args.dtype, args.tp_size)
    if args.memory:
        return memory_table(model, args)
    if args.prefill_lens:
        return prefill_table(model, args, device)
    if args.startup:
        return startup_line(model, args)
    bandwidth, bandwidth_line = copy_bandwidth(args.copy_mib * 2**20)
    print(bandwidth_line, flush=True)
    modes = [True] if args.spec_only else ([False, True] if args.spec else [False])
    rows = []
    steps = [int(k) for k in args.decode_steps.split(",")]
    for backend in args.backends.split(","):
        for spec in modes:
            for batch in (int(b) for b in args.batches.split(",")):
                for k in [1] if spec else steps:
                    row = run(model, backend, args, batch, spec, bandwidth, decode_steps=k)
                    print(row, flush=True)
                    rows.append(row)
    if args.peer:
        # the floor of one token step (K-step rows too: theirs is per token step)
        floors = {r["batch"]: r["floor_ms"] for r in rows if not r["spec"].startswith("NEXTN")}
        for batch in (int(b) for b in args.batches.split(",")):
            try:
                row = transformers_row(args, batch, floors.get(batch, float("nan")))
            except Exception as exc:  # the peer's failure is a result too: keep its message
                print(f"transformers peer, batch {batch}: {type(exc).__name__}: {exc}")
                continue
            print(row, flush=True)
            rows.append(row)
    lines = [device, bandwidth_line, ""]
    lines += markdown_table(
        [
            "preset", "tp", "backend", "batch", "spec", "ms/step (engine loop)", "step alone (ms)",
            "floor (ms)", "% of floor (loop / alone)",
            "floor GB per device: weights + state + KV", "decode tok/s", "accept len",
        ],
        [
            [
                r["preset"], r["tp"], r["backend"], r["batch"], r["spec"], f"{r['loop_ms']:.2f}",
                f"{r['alone_ms']:.2f}", f"{r['floor_ms']:.3f}",
                f"{r['pct_loop']:.0f} % / {r['pct_alone']:.0f} %",
                f"{r['weights_gb']:.3f} + {r['state_gb']:.3f} + {r['kv_gb']:.3f}"
                if "weights_gb" in r
                else "as above",
                f"{r['decode_tok_s']:.0f}", f"{r['accept_len']:.2f}",
            ]
            for r in rows
        ],
    )  # fmt: skip
    lines += [
        "",
        "Host calls per decode loop step (median ms; dispatch, the jitted step's call, is "
        "inside launch; fetch waits for the step's outputs):",
        "",
    ]
    lines += markdown_table(
        ["preset", "backend", "batch", "spec", "decode programs", "loop", *HOST_CALLS],
        [
            [r["preset"], r["backend"], r["batch"], r["spec"], r["copies"], f"{r['loop_ms']:.2f}"]
            + [f"{r['host_ms'][name]:.2f}" for name in HOST_CALLS]
            for r in rows
            if "host_ms" in r
        ],
    )
    if args.profile:
        rows = [r for r in rows if "breakdown_ms" in r]
        from lazyspec.bench.floor import BREAKDOWN_ORDER

        cats = [c for c in BREAKDOWN_ORDER if any(c in r["breakdown_ms"] for r in rows)]
        lines.append("")
        lines += markdown_table(
            [
                "preset", "batch", "spec", "kernels", "device step ms (first kernel to last)",
                "kernels busy ms", "% of floor (device step)", "host", *cats,
            ],
            [
                [
                    r["preset"], r["batch"], r["spec"], f"{r['kernels']:.0f}",
                    f"{r['device_ms']:.3f}", f"{r['busy_ms']:.3f}", f"{r['pct_device']:.0f} %",
                    f"{r['undeviced_ms']:.3f}",
                ]
                + [f"{r['breakdown_ms'].get(c, 0.0):.3f}" for c in cats]
                for r in rows
            ],
        )  # fmt: skip
    emit_table(lines, args.out)


def startup_line(model, args) -> None:
    """Seconds to build an engine of ``--batch`` rows and ``--context`` tokens (NEXTN with
    ``--spec``), ready (the programs a first request needs compiled, the rest compiling in
    the background) and with its whole program table compiled (the persistent cache as JAX
    is configured), and what the warm-up reports."""
    from lazyspec.engine.engine import Engine

    start = time.perf_counter()
    backend = args.backends.split(",")[0]
    settings = engine_settings(args, backend, args.batch, args.context)
    settings["compile_threads"] = args.compile_threads
    if args.spec or args.spec_only:  # the NEXTN engine's table
        settings.update(nextn_settings(args))
    engine = Engine(model=model, background_warmup=True, **settings)
    ready = time.perf_counter() - start
    threads = (engine.warmup_status() or {}).get("compile_threads")
    print(f"engine ready in {ready:.1f} s ({threads} compile threads)", flush=True)
    while not (engine.warmup_status() or {"done": True})["done"]:
        time.sleep(0.1)
    seconds = time.perf_counter() - start
    status = engine.warmup_status() or {}
    print(f"whole table in {seconds:.1f} s: {status}", flush=True)


def prefill_table(model, args, device: str) -> None:
    """Prefill rows: one prompt of each length through ``Engine.generate`` (one new token),
    its FLOPs (``lazyspec.bench.prefill``) over its time against the bf16 matmul rate
    measured here; with ``--peer``, transformers' forward over the same length."""
    from lazyspec.bench.prefill import (
        engine_prefill_seconds,
        matmul_peak,
        prefill_flops,
        transformers_prefill_seconds,
    )
    from lazyspec.engine.engine import Engine

    lengths = [int(n) for n in args.prefill_lens.split(",")]
    peers = dict.fromkeys(lengths, float("nan"))
    if args.peer:
        try:
            peers = transformers_prefill_seconds(PRESETS[args.preset], lengths)
        except Exception as exc:  # the peer's failure is a result too
            print(f"transformers peer: {type(exc).__name__}: {exc}")
    peak = matmul_peak()
    peak_line = f"bf16 matmul peak (8192^3, random data): {peak / 1e12:.0f} TFLOP/s"
    print(peak_line, flush=True)
    lines = [
        device,
        peak_line,
        "",
        "| preset | backend | prompt tokens | chunk | engine s | tok/s | GFLOP counted "
        "(weights + attention + recurrent) | TFLOP/s | % of peak | transformers s | x peer |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    profiles = []
    for backend in args.backends.split(","):
        for length in lengths:
            chunk = args.prefill_chunk or min(length, 8192)
            engine = Engine(
                model=model,
                **engine_settings(args, backend, 1, length + 64),
                chunked_prefill_size=chunk,
                skip_warmup=True,
            )
            seconds = engine_prefill_seconds(engine, length)
            if args.profile:
                out_dir = Path(args.profile) / f"prefill-{backend}-{length}-{chunk}"
                profiles.append((length, chunk, _profile_prefill(engine, length, out_dir)))
            del engine
            flops = prefill_flops(model.params, model.config, length)
            peer = peers[length]
            rate = flops.total / seconds
            lines.append(
                f"| {args.preset} | {backend} | {length} | {chunk} | {seconds:.3f} | "
                f"{length / seconds:.0f} | {flops.total / 1e9:.1f} ({flops.weights / 1e9:.1f} "
                f"+ {flops.attention / 1e9:.1f} + {flops.recurrent / 1e9:.1f}) | "
                f"{rate / 1e12:.2f} | {100 * rate / peak:.1f} % | {peer:.3f} | "
                f"{peer / seconds:.2f} |"
            )
            print(lines[-1], flush=True)
    for length, chunk, (breakdown, top) in profiles:
        lines += ["", f"Prefill of {length} tokens in chunks of {chunk}: device ms by category"]
        lines += markdown_table(list(breakdown), [[f"{ms:.1f}" for ms in breakdown.values()]])
        lines += ["", "Its longest ops (ms in all, runs):", ""]
        lines += markdown_table(
            ["op", "category", "ms", "runs"],
            [[r["op"], r["category"], f"{1e3 * r['s']:.1f}", r["count"]] for r in top],
        )
    emit_table(lines, args.out)


def _profile_prefill(engine, length: int, out_dir: Path, top: int = 20):
    """One prefill of ``length`` tokens (a fresh prompt, one new token) under the JAX
    profiler: device milliseconds of its extend steps by category
    (``lazyspec.bench.floor.device_ops``, the scopes from the widest extend program's HLO)
    and its ``top`` longest ops. Every op goes to ``out_dir / "ops.json"``."""
    import json
    import shutil

    import jax

    from lazyspec.bench.floor import device_ops

    runner = engine.runner
    recorder = _WidestDecode(runner._extend)
    runner._extend = recorder
    prompt = np.random.default_rng(length + 1).integers(1, engine.model.config.vocab_size, length)
    engine.flush_cache()
    shutil.rmtree(out_dir, ignore_errors=True)
    with jax.profiler.trace(str(out_dir), create_perfetto_trace=True):
        engine.generate(input_ids=[int(t) for t in prompt], sampling_params={"max_new_tokens": 1})
    hlo = _compiled(runner, runner.programs.extend, *recorder.args).as_text()
    ops = device_ops(out_dir, hlo, "extend")
    breakdown = _ms_by_category(ops)
    breakdown["all"] = sum(breakdown.values())
    (out_dir / "ops.json").write_text(json.dumps(ops, indent=1))
    return breakdown, ops[:top]


def markdown_table(header: list[str], rows: list[list[Any]]) -> list[str]:
    """A markdown table's lines: the ``header`` cells, the rule, then each row's cells."""

    def line(cells: list[Any]) -> str:
        return "| " + " | ".join(str(cell) for cell in cells) + " |"

    return [line(header), "|" + "---|" * len(header), *map(line, rows)]


def emit_table(lines: list[str], out: str | None) -> None:
    """Print the markdown table and, when ``out`` is given, write it there."""
    table = "\n".join(lines)
    print(table)
    if out:
        Path(out).write_text(table + "\n")


def memory_table(model, args) -> None:
    lines = [
        "| backend | batch | decode rows | temp MiB | arguments MiB | outputs MiB | aliased MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for backend in args.backends.split(","):
        r = decode_memory(model, backend, args)
        print(r, flush=True)
        lines.append(
            f"| {r['backend']} | {r['batch']} | {r['rows']} | {r['temp_mib']:.1f} | "
            f"{r['argument_mib']:.1f} | {r['output_mib']:.1f} | {r['alias_mib']:.1f} |"
        )
    emit_table(lines, args.out)


if __name__ == "__main__":
    main()
