"""Host time of one decode (or, with ``--extend``, prefill) step: ``Scheduler.schedule()`` +
``Runner.launch()`` + ``Scheduler.process()``.

Runs a batch of decoding requests on the tiny random-weight model of ``bench_engine.py``
(on CPU) with a long context and times, per decode step, the host calls of the overlapped
loop: planning the batch, dispatching it (moving the batch to the device included) and
applying its results once fetched. The device time itself (and the fetch, which waits for
it) is not measured.

    python benchmarks/tools/bench_host_step.py --batch 64 --context 32768
    python benchmarks/tools/bench_host_step.py --batch 16 --context 1024 --steps 300 --page-size 16
    python benchmarks/tools/bench_host_step.py --extend --batch 64 --prompt-len 290 --context 4096

``--extend``: a burst of ``--batch`` prompts prefilled in 512-token chunks (at most
``--max-prefill-tokens`` a step); the burst runs twice (the first compiles, the cache is
flushed between) and the second's extend steps are timed, and its first schedule (the
admissions before its first launch).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

# bench_engine (its presets and model builder) is a user tool under scripts/
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--steps", type=int, default=30, help="decode steps timed")
    p.add_argument("--page-size", type=int, default=1, help="the engine's --page-size")
    p.add_argument("--extend", action="store_true", help="time a burst's prefill steps")
    p.add_argument(
        "--max-prefill-tokens", type=int, default=None, help="with --extend (default: the engine's)"
    )
    args = p.parse_args(argv)
    if args.extend:
        extend_steps(args)
        return

    from bench_engine import build_model

    from lazyspec.engine.engine import Engine

    model = build_model("tiny", "float32")
    engine = Engine(
        model=model,
        kernel_backend="xla",
        max_running_requests=args.batch,
        mamba_track_interval=256,
        chunked_prefill_size=64,
        context_length=args.context,
        max_total_tokens=args.batch * 256,
        skip_warmup=True,
        page_size=args.page_size,
    )
    rng = np.random.default_rng(0)
    params = {"max_new_tokens": args.steps + 10, "ignore_eos": True}
    for _ in range(args.batch):
        prompt = [int(t) for t in rng.integers(1, 500, size=args.prompt_len)]
        engine.add_request(input_ids=prompt, sampling_params=params)
    sched, runner = engine.scheduler, engine.runner
    schedule_s, launch_s, process_s = [], [], []
    inflight = None
    while len(schedule_s) < args.steps + 3:
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        outputs = runner.launch(plan.batch, plan.table_chunks)
        t2 = time.perf_counter()
        if plan.kind == "decode" and len(plan.records) == args.batch:
            schedule_s.append(t1 - t0)
            launch_s.append(t2 - t1)
        if inflight is not None:
            done, results = inflight[0], runner.fetch(inflight[1])
            t3 = time.perf_counter()
            sched.process(done, results, plan.records)
            if done.kind == "decode" and len(done.records) == args.batch:
                process_s.append(time.perf_counter() - t3)
        inflight = (plan, outputs)
    # the first decode steps compile
    schedule_ms = 1e3 * np.median(schedule_s[3:])
    launch_ms = 1e3 * np.median(launch_s[3:])
    process_ms = 1e3 * np.median(process_s[3:])
    print(
        f"batch {args.batch}, context {args.context}, page size {args.page_size}: "
        "median per decode step "
        f"schedule {schedule_ms:.3f} ms, launch {launch_ms:.3f} ms, "
        f"process {process_ms:.3f} ms, total {schedule_ms + launch_ms + process_ms:.3f} ms"
    )


def extend_steps(args) -> None:
    from bench_engine import build_model

    from lazyspec.engine.engine import Engine

    engine = Engine(
        model=build_model("tiny", "float32"),
        kernel_backend="xla",
        max_running_requests=args.batch,
        chunked_prefill_size=512,
        max_prefill_tokens=args.max_prefill_tokens,
        context_length=args.context,
        max_total_tokens=args.batch * (args.prompt_len + 64),
        skip_warmup=True,
        page_size=args.page_size,
    )
    rng = np.random.default_rng(0)
    sched, runner = engine.scheduler, engine.runner
    for _burst in range(2):
        engine.flush_cache()
        for _ in range(args.batch):
            prompt = [int(t) for t in rng.integers(1, 500, size=args.prompt_len)]
            engine.add_request(input_ids=prompt, sampling_params={"max_new_tokens": 1})
        times, shapes, first = [], [], None
        while (
            engine.scheduler.has_work
        ):  # without overlap: each step's results are processed at once
            t0 = time.perf_counter()
            plan = sched.schedule()
            if plan is None:
                break
            t1 = time.perf_counter()
            outputs = runner.launch(plan.batch, plan.table_chunks)
            t2 = time.perf_counter()
            results = runner.fetch(outputs)
            t3 = time.perf_counter()
            sched.process(plan, results, inflight=())
            if first is None:
                first = t1 - t0
            if plan.kind == "extend":
                times.append((t1 - t0, t2 - t1, time.perf_counter() - t3, t3 - t2))
                shapes.append(plan.batch.tokens.shape)
    schedule_ms, launch_ms, process_ms, fetch_ms = (1e3 * np.median(c) for c in zip(*times))
    print(
        f"{args.batch} prompts of {args.prompt_len} tokens, context {args.context}: "
        f"{len(times)} extend steps {sorted(set(shapes))}; median per step schedule "
        f"{schedule_ms:.3f} ms, launch {launch_ms:.3f} ms, process {process_ms:.3f} ms "
        f"(host {schedule_ms + launch_ms + process_ms:.3f} ms; waiting on the device "
        f"{fetch_ms:.3f} ms); the burst's first schedule (what it admits before its first "
        f"launch) {1e3 * first:.3f} ms"
    )


if __name__ == "__main__":
    main()
