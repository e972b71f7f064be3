"""Decode step time against the configured context: engines that differ only in
``context_length`` serve the same requests, and each one's decode step is re-run alone
(``bench_engine._step_alone_seconds``); the ratio of the longest context's step to the
shortest's says whether a step's cost follows the tokens present or the context configured.

    python scripts/bench_context.py --backends xla --context 1024,32768   # the CPU check

The engines run back to back in one process, so a ratio survives a loaded machine better than
either time does. Random weights of ``bench_engine``'s presets (``--preset tiny`` on CPU).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_engine, beside this file

import bench_engine  # noqa: E402


def step_ms(model, backend: str, args, context: int) -> float:
    """Median device milliseconds of the widest decode step of ``args.batch`` requests on an
    engine of ``context`` tokens of context (the requests as ``bench_engine.served_engine``
    serves them)."""
    args = argparse.Namespace(**{**vars(args), "context": context})
    engine, recorder = bench_engine.served_engine(model, backend, args, args.batch, False)
    engine.runner._decode = recorder
    return 1e3 * bench_engine._step_alone_seconds(engine, recorder.batch)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(bench_engine.PRESETS), default="tiny")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32")
    p.add_argument("--backends", default="xla")
    p.add_argument("--context", default="1024,32768", help="context lengths, one engine each")
    p.add_argument("--batch", type=int, default=8, help="requests decoded together")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--moe-runner-backend", default="auto")
    p.add_argument("--kernel-tuning", default="")
    args = p.parse_args(argv)
    args.tp_size, args.decode_program_copies, args.spec_steps = 1, None, 0
    contexts = [int(c) for c in args.context.split(",")]
    hf = bench_engine.PRESETS[args.preset]
    most = max(contexts)
    if hf.get("max_position_embeddings", most) < most:  # room for the longest context
        bench_engine.PRESETS[args.preset] = dict(hf, max_position_embeddings=most)
    model = bench_engine.build_model(args.preset, args.dtype)
    rows = []
    for backend in args.backends.split(","):
        times = {}
        for context in contexts:
            start = time.perf_counter()
            times[context] = step_ms(model, backend, args, context)
            took = time.perf_counter() - start
            print(f"{backend} context {context}: {times[context]:.3f} ms a step ({took:.0f} s)")
        base = times[contexts[0]]
        for context in contexts:
            row = {"backend": backend, "context": context, "step_ms": times[context]}
            rows.append(dict(row, ratio=times[context] / base))
    print("| backend | context | decode step (ms) | ratio to the first |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['backend']} | {r['context']} | {r['step_ms']:.3f} | {r['ratio']:.2f} |")
    return rows


if __name__ == "__main__":
    main()
