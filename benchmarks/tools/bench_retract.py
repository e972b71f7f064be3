"""Admission under KV pressure: large max_tokens, short actual outputs, a small KV pool.

N requests ask for ``--max-new-tokens`` (2048) but stop after 16..64 tokens (a stop string
matched on the text side: ``Engine.stop``). Reserving every request's max_new_tokens up
front lets one or two run at once in a pool of a few thousand tokens; admitting against
the estimated use (``new_token_ratio``, retraction when a decode step is short) runs many.
Reported per ``--schedule-conservativeness``: running requests per step (mean and max),
steps, output tokens per second (after the warm-up compiled every shape), retractions.
CPU, tiny random model.

    python benchmarks/tools/bench_retract.py                         # this tree
    PYTHONPATH=<a checkout of an older tree> python benchmarks/tools/bench_retract.py

An older tree without ``schedule_conservativeness`` is measured once, as it admits.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def run_once(model, conservativeness: float | None, args) -> dict:
    from lazyspec.config import EngineConfig
    from lazyspec.engine.engine import Engine

    extra = {}
    if conservativeness is not None:
        extra["schedule_conservativeness"] = conservativeness
    engine = Engine(
        model=model,
        max_running_requests=args.max_running,
        max_total_tokens=args.kv_tokens,
        context_length=args.context,
        mamba_track_interval=256,
        chunked_prefill_size=256,
        **extra,
    )
    rng = np.random.default_rng(args.seed)
    params = {"max_new_tokens": args.max_new_tokens, "ignore_eos": True}
    reqs, stop_at = [], {}
    for _ in range(args.requests):
        prompt = rng.integers(3, model.config.vocab_size, size=int(rng.integers(32, 129)))
        req = engine.add_request(input_ids=prompt.tolist(), sampling_params=params)
        reqs.append(req)
        stop_at[req.rid] = int(rng.integers(16, 65))
    running, start = [], time.perf_counter()
    while engine.busy:
        engine.step()
        if engine.scheduler.running:
            running.append(len(engine.scheduler.running))
        for req in reqs:
            if not req.finished and len(req.output_ids) >= stop_at[req.rid]:
                engine.stop(req.rid)
    seconds = time.perf_counter() - start
    tokens = sum(len(r.output_ids) for r in reqs)
    info = engine.get_server_info()
    has_flag = "schedule_conservativeness" in EngineConfig.field_names()
    return {
        "admission": f"estimate x{conservativeness}" if has_flag else "reserve max_new_tokens",
        "mean_running": round(float(np.mean(running)), 2),
        "max_running": int(np.max(running)),
        "steps": len(running),
        "output_tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
        "retractions": info.get("num_retractions", 0),
        "errors": sum(1 for r in reqs if r.finish_reason.get("status_code")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=2048)
    parser.add_argument("--kv-tokens", type=int, default=4096)
    parser.add_argument("--context", type=int, default=2304)
    parser.add_argument("--max-running", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--schedule-conservativeness", type=float, nargs="+", default=[1.0, 0.3, 0.05]
    )
    args = parser.parse_args()

    from lazyspec.config import EngineConfig
    from lazyspec.testing.tiny_models import tiny_model

    model = tiny_model()
    values = args.schedule_conservativeness
    if "schedule_conservativeness" not in EngineConfig.field_names():
        values = [None]
    for value in values:
        print(json.dumps(run_once(model, value, args)), flush=True)


if __name__ == "__main__":
    main()
