"""Offline engine throughput on a random-weight Qwen3-Next-shaped model.

Runs N requests (fixed prompt and output lengths, ignore_eos) through the Engine and times
every step: prefill tokens/s, decode tokens/s and the median decode step time, per kernel
backend. Random weights: the numbers are about speed, not text.

    python scripts/bench_engine.py --preset medium --backends xla,pallas --out engine.md
    python scripts/bench_engine.py --preset tiny --backends xla            # CPU smoke run
    python scripts/bench_engine.py --memory --preset medium --backends xla --batch 16 --spec

``--memory`` reports, instead of timings, XLA's memory analysis of the compiled decode step
at the batch's widest shape (temporary, argument and output bytes): what one decode step
allocates besides the donated pools. On CPU only the xla backend is meaningful (Pallas
runs interpreted there).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

PRESETS = {
    # Qwen3-Next-80B's GDN shapes (16 key / 32 value heads of 128) on 8 layers, dense MLP
    "medium": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        vocab_size=32000,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        vocab_size=512,
    ),
}


def build_model(preset: str, dtype: str):
    from types import SimpleNamespace

    import jax
    import jax.numpy as jnp

    from lazyspec.models import qwen3_next
    from lazyspec.models.registry import parse_hf_config

    hf = dict(
        model_type="qwen3_next",
        num_experts=0,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        eos_token_id=0,
        max_position_embeddings=8192,
        full_attention_interval=4,
        partial_rotary_factor=0.25,
        rope_theta=10000.0,
        num_nextn_predict_layers=1,
        **PRESETS[preset],
    )
    cfg = parse_hf_config(hf)
    params = qwen3_next.init_params(
        cfg, jax.random.PRNGKey(0), dtype=jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    )
    return SimpleNamespace(config=cfg, params=params, tokenizer=None, family=qwen3_next)


def make_engine(model, backend: str, args):
    from lazyspec.engine.engine import Engine

    spec = dict(speculative_algorithm="NEXTN", speculative_num_steps=3) if args.spec else {}
    return Engine(
        model=model,
        kernel_backend=backend,
        dtype=args.dtype,
        max_running_requests=args.batch,
        mamba_track_interval=256,
        chunked_prefill_size=args.prompt_len,
        context_length=args.context,
        max_total_tokens=args.batch * args.context,
        skip_warmup=True,
        **spec,
    )


class _Recorder:
    """Stands in for a jitted step: calls it and keeps the abstract arguments of its widest
    call (most decode rows)."""

    def __init__(self, jitted):
        self.jitted, self.args = jitted, None

    def __call__(self, *args):
        import jax

        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
        if self.args is None or shapes[2].num_rows > self.args[2].num_rows:
            self.args = shapes
        return self.jitted(*args)


def decode_memory(model, backend: str, args) -> dict:
    """XLA's memory analysis of the decode step compiled at the widest shape served."""
    engine = make_engine(model, backend, args)
    recorder = _Recorder(engine.runner._decode)
    engine.runner._decode = recorder
    rng = np.random.default_rng(0)
    prompts = [
        [int(t) for t in rng.integers(1, model.config.vocab_size, size=args.prompt_len)]
        for _ in range(args.batch)
    ]
    engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 8, "ignore_eos": True})
    analysis = recorder.jitted.lower(*recorder.args).compile().memory_analysis()
    mib = lambda n: n / 2**20  # noqa: E731
    return {
        "backend": backend,
        "batch": args.batch,
        "rows": recorder.args[2].num_rows,
        "temp_mib": mib(analysis.temp_size_in_bytes),
        "argument_mib": mib(analysis.argument_size_in_bytes),
        "output_mib": mib(analysis.output_size_in_bytes),
        "alias_mib": mib(analysis.alias_size_in_bytes),
    }


def run(model, backend: str, args) -> dict:
    engine = make_engine(model, backend, args)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    prompts = [
        [int(t) for t in rng.integers(1, vocab, size=args.prompt_len)]
        for _ in range(args.num_requests)
    ]
    params = {"max_new_tokens": args.output_len, "ignore_eos": True}
    # warm-up pass compiles the shapes this workload uses
    engine.generate(
        input_ids=prompts[: args.batch], sampling_params={"max_new_tokens": 4, "ignore_eos": True}
    )
    engine.flush_cache()
    reqs = [engine.add_request(input_ids=p, sampling_params=params) for p in prompts]
    times = {"extend": [], "decode": []}
    start = time.perf_counter()
    while engine.busy:
        kind = engine._inflight[0].kind if engine._inflight else None
        t0 = time.perf_counter()
        engine.step()
        if kind is not None:
            times[kind].append(time.perf_counter() - t0)
    wall = time.perf_counter() - start
    out_tokens = sum(len(r.output_ids) for r in reqs)
    decode_time = sum(times["decode"])
    return {
        "backend": backend,
        "batch": args.batch,
        "wall_s": wall,
        "output_tok_s": out_tokens / wall,
        "decode_tok_s": (out_tokens - len(reqs)) / max(decode_time, 1e-9),
        "median_decode_step_ms": 1e3 * float(np.median(times["decode"]))
        if times["decode"]
        else 0.0,
        "prefill_tok_s": args.prompt_len * len(reqs) / max(sum(times["extend"]), 1e-9),
        "accept_len": engine.get_server_info()["avg_accept_length"],
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="medium")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--backends", default="xla,pallas")
    p.add_argument("--batch", type=int, default=64, help="max_running_requests")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--spec", action="store_true", help="NEXTN with the (random) MTP head")
    p.add_argument(
        "--memory",
        action="store_true",
        help="report the compiled decode step's memory analysis instead of timing",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    model = build_model(args.preset, args.dtype)
    if args.memory:
        return memory_table(model, args)
    rows = []
    for backend in args.backends.split(","):
        row = run(model, backend, args)
        print(row, flush=True)
        rows.append(row)
    lines = [
        "| backend | batch | output tok/s | decode tok/s | median decode step (ms) "
        "| prefill tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['backend']} | {r['batch']} | {r['output_tok_s']:.0f} | "
            f"{r['decode_tok_s']:.0f} | {r['median_decode_step_ms']:.2f} | "
            f"{r['prefill_tok_s']:.0f} |"
        )
    emit_table(lines, args.out)


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
