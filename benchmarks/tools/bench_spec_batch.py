"""Decode throughput with and without speculation, per batch size: where NEXTN stops winning.

Greedy, on held-out prompts of the embedded default model's corpus
(``lazyspec.bench.prompts.held_out_prompts``, ``--seed`` picking the windows; cycled when a
batch needs more prompts than there are), so the draft head's accept length is the real
one. For each batch size and mode (plain decode; NEXTN; NEXTN with ``--limit`` as
``speculative_disable_by_batch_size``) one engine serves that many requests together: every
request is prefilled first, then the decode phase is timed to the end (output tokens per
second, engine loop included, as served). A first pass of the same requests, untimed,
compiles every program the timed pass calls (greedy: both passes take the same steps). The
winner per batch size gives the rule: speculation pays up to the largest batch where NEXTN
beats plain decode.

    python benchmarks/tools/bench_spec_batch.py --batches 1,4,16,64 --limit 16
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from lazyspec.bench.prompts import held_out_prompts
from lazyspec.engine.engine import Engine
from lazyspec.models import load_model
from lazyspec.scheduler.batch import mean_accept_length
from lazyspec.server.launch import DEFAULT_MODEL


def make_engine(model, batch: int, args, mode: str) -> Engine:
    spec = {}
    if mode != "plain":
        spec = dict(speculative_algorithm="NEXTN", speculative_num_steps=args.steps)
    if mode == "limit":
        spec["speculative_disable_by_batch_size"] = args.limit
    context = -(-(args.prompt_len + args.output_len + 64) // 64) * 64
    return Engine(
        model=model,
        kernel_backend=args.kernel_backend,
        max_running_requests=batch,
        context_length=context,
        max_total_tokens=context * batch,
        chunked_prefill_size=args.prompt_len,
        skip_warmup=True,
        **spec,
    )


def decode_phase(engine: Engine, prompts: list[list[int]], output_len: int) -> dict:
    """Serve ``prompts``; time from the step after which every request has its first token
    to the end. Returns the decode phase's output tokens, seconds, steps and accept length."""
    params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    reqs = [engine.add_request(input_ids=p, sampling_params=params) for p in prompts]
    while not all(r.output_ids for r in reqs):
        engine.step()
    first = sum(len(r.output_ids) for r in reqs)
    counts0 = engine.scheduler.accept_counts.copy()
    steps, start = 0, time.perf_counter()
    while engine.busy:
        engine.step()
        steps += 1
    seconds = time.perf_counter() - start
    tokens = sum(len(r.output_ids) for r in reqs) - first
    accept = mean_accept_length(engine.scheduler.accept_counts - counts0)
    return {"tokens": tokens, "seconds": seconds, "steps": steps, "accept_len": accept}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=str(DEFAULT_MODEL))
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=3, help="speculative_num_steps")
    p.add_argument("--limit", type=int, default=None, help="also NEXTN with this limit")
    p.add_argument("--kernel-backend", default=None)
    p.add_argument("--seed", type=int, default=0, help="which held-out windows")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    model = load_model(args.model_path)
    batches = [int(b) for b in args.batches.split(",")]
    pool = held_out_prompts(
        model.tokenizer, max(batches), args.prompt_len, args.output_len, args.seed
    )
    if not pool:
        raise SystemExit("no held-out file is long enough for --prompt-len + --output-len")
    modes = ["plain", "nextn"] + (["limit"] if args.limit is not None else [])
    rows = []
    for batch in batches:
        prompts = [pool[i % len(pool)] for i in range(batch)]
        row = {"batch": batch, "distinct_prompts": min(batch, len(pool))}
        for mode in modes:
            engine = make_engine(model, batch, args, mode)
            decode_phase(engine, prompts, args.output_len)  # compiles
            engine.flush_cache()
            compiled = engine.num_compiled()
            got = decode_phase(engine, prompts, args.output_len)
            got["compiled"] = engine.num_compiled() - compiled  # in the timed pass: 0
            row[mode] = {**got, "tok_s": got["tokens"] / got["seconds"]}
            print(batch, mode, json.dumps(row[mode]), flush=True)
        rows.append(row)
    header = "| batch | plain tok/s | NEXTN tok/s | NEXTN / plain | accept length |"
    if args.limit is not None:
        header += f" NEXTN, limit {args.limit}: tok/s |"
    print("\n" + header)
    print("|" + "---|" * (header.count("|") - 1))
    for row in rows:
        plain, nextn = row["plain"], row["nextn"]
        line = (
            f"| {row['batch']} | {plain['tok_s']:.0f} | {nextn['tok_s']:.0f} | "
            f"{nextn['tok_s'] / plain['tok_s']:.2f} | {nextn['accept_len']:.2f} |"
        )
        if args.limit is not None:
            line += f" {row['limit']['tok_s']:.0f} |"
        print(line)
    wins = [row["batch"] for row in rows if row["nextn"]["tok_s"] > row["plain"]["tok_s"]]
    print(
        f"NEXTN wins at batch sizes {wins}; "
        + (f"largest: {max(wins)}" if wins else "never: speculation does not pay here")
    )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
