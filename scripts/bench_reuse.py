"""The RadixCache reuse benchmark suite: workloads x checkpoint strategies x cache policies.

Workloads (``lazyspec/bench/reuse_workloads.py``): the source document's multi-turn
conversations (N conversations x T turns; turn k+1 = turn k's prompt + its output + new user
tokens, submitted when turn k finishes), few-shot prefix sharing, agentic multi-turn with
tool outputs, and random prompts (nothing shared). At most ``--max-running`` requests run at
once against a state pool of ``--pools`` slots. Reported per run: the fraction of the counted
requests' prompt tokens served from the cache (sum cached_tokens / sum prompt_tokens; a
counted request is one that could hit: a later turn, a later member of a group), the counted
requests that hit, the mean time to first token (wall clock from submission, queueing
included) and output tokens per second.

    python scripts/bench_reuse.py --model-path lazyspec/assets/default_model --spec \
        --output-len 160 --pools 96 --seeds 0,1,2          # the source document's workload
    python scripts/bench_reuse.py --workloads fewshot,agentic,random --pools 96

Strategies: extra_buffer, extra_buffer_lazy, lazy with the old evict-on-failure behaviour
restored (``debug_lazy_evict_on_failure``), which shows why it was removed, and cache_off
(the radix cache disabled: the outputs every other run must equal).
Policies (``mamba_cache_policy``): value (the default) and sglang (SGLang's LRU rules).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from lazyspec.bench.closed_loop import ClosedLoop, add_engine_arguments, engine_options
from lazyspec.bench.reuse_workloads import DEFAULT_SHAPES, WORKLOADS, Workload

STRATEGIES = {
    "extra_buffer": dict(mamba_scheduler_strategy="extra_buffer"),
    "extra_buffer_lazy": dict(mamba_scheduler_strategy="extra_buffer_lazy"),
    "lazy+evict_on_failure": dict(
        mamba_scheduler_strategy="extra_buffer_lazy", debug_lazy_evict_on_failure=True
    ),
    # the cache-free run: every output must equal it (reuse 0 by construction)
    "cache_off": dict(disable_radix_cache=True),
}
POLICIES = ("value", "sglang")


@dataclass(frozen=True)
class Result:
    workload: str
    strategy: str
    policy: str
    pool: int
    seed: int
    reuse: float
    hit_requests: int
    requests: int
    ttft_s: float  # mean over every request
    output_tok_s: float
    accept_len: float | None
    outputs: list[list[int]]  # per request in submission order (identical across policies)


def shape_of(workload: str, args) -> object:
    """The workload's shape; the multi-turn one takes the command line's lengths."""
    if workload != "multiturn":
        return replace(DEFAULT_SHAPES[workload], output_len=args.suite_output_len)
    return replace(
        DEFAULT_SHAPES["multiturn"],
        conversations=args.conversations,
        turns=args.turns,
        first_len=args.first_len,
        turn_len=args.turn_len,
        output_len=args.output_len,
    )


def run_once(model, workload: str, strategy: str, policy: str, pool: int, seed: int, args):
    from lazyspec.engine.engine import Engine

    engine = Engine(
        model=model,
        max_running_requests=args.max_running,
        max_mamba_cache_size=pool,
        random_seed=seed,
        mamba_cache_policy=policy,
        **STRATEGIES[strategy],
        **engine_options(args),
    )
    work = Workload(workload, shape_of(workload, args), model.config.vocab_size, seed)
    loop, outputs = ClosedLoop(engine), []

    def submit(request) -> None:
        loop.submit(request.prompt, request.max_new_tokens, (request, len(outputs)))
        outputs.append(None)

    for request in work.first():
        submit(request)
    start = time.perf_counter()
    while len(loop):
        for req, (request, index) in loop.step():
            outputs[index] = list(req.output_ids)
            if request.counted:
                loop.count_reuse(req)
            nxt = work.follow(request, list(req.output_ids))
            if nxt is not None:
                submit(nxt)
    elapsed = time.perf_counter() - start
    engine.shutdown()
    engine.check_integrity()
    accept = engine.get_server_info()["avg_accept_length"]
    return Result(
        workload,
        strategy,
        policy,
        pool,
        seed,
        loop.reuse,
        loop.hits,
        loop.counted,
        float(np.mean(loop.ttfts)),
        loop.num_out / elapsed,
        accept,
        outputs,
    )


def summarize(results: list[Result]) -> str:
    """One row per workload x pool x strategy x policy: reuse mean (min-max) and per seed,
    hit requests, TTFT and throughput means; then whether every run of a workload, pool
    and seed gave the same outputs."""
    lines = [
        "| workload | pool | strategy | policy | reuse mean (min-max) | per seed | hit requests "
        "| TTFT mean (s) | output tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(r.workload, r.pool, r.strategy, r.policy) for r in results}, key=_order)
    for workload, pool, strategy, policy in keys:
        runs = [
            r
            for r in results
            if (r.workload, r.pool, r.strategy, r.policy) == (workload, pool, strategy, policy)
        ]
        reuse = [r.reuse for r in runs]
        seeds = ", ".join(f"{r.seed}: {r.reuse:.3f}" for r in runs)
        hits = f"{np.mean([r.hit_requests for r in runs]):.1f} / {runs[0].requests}"
        lines.append(
            f"| {workload} | {pool} | {strategy} | {policy} | {np.mean(reuse):.3f} "
            f"({min(reuse):.3f}-{max(reuse):.3f}) | {seeds} | {hits} "
            f"| {np.mean([r.ttft_s for r in runs]):.2f} "
            f"| {np.mean([r.output_tok_s for r in runs]):.1f} |"
        )
    groups = {}
    for r in results:
        groups.setdefault((r.workload, r.pool, r.seed), []).append(r)
    differ = [
        key for key, runs in groups.items() if any(r.outputs != runs[0].outputs for r in runs)
    ]
    lines.append("")
    lines.append(
        f"outputs identical across strategies and policies: {not differ}"
        + (f" (differ: {differ})" if differ else "")
    )
    return "\n".join(lines)


def _order(key: tuple) -> tuple:
    workload, pool, strategy, policy = key
    return (
        WORKLOADS.index(workload),
        -pool,
        list(STRATEGIES).index(strategy),
        POLICIES.index(policy),
    )


def plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r.workload, r.pool, r.strategy, r.policy) for r in results}, key=_order)
    means = [
        np.mean([r.reuse for r in results if (r.workload, r.pool, r.strategy, r.policy) == k])
        for k in keys
    ]
    fig, ax = plt.subplots(figsize=(max(7, 0.6 * len(keys)), 4))
    colors = ["tab:blue" if k[3] == "value" else "tab:gray" for k in keys]
    ax.bar(np.arange(len(keys)), means, color=colors)
    ax.set_xticks(np.arange(len(keys)))
    ax.set_xticklabels([f"{w}\n{s}\n{p} ({n})" for w, n, s, p in keys], fontsize=6)
    ax.set_ylabel("counted prompt tokens served from cache")
    ax.set_title("RadixCache reuse by workload, strategy and policy (blue: value, gray: sglang)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="HF folder; default: tiny random Qwen3-Next")
    p.add_argument("--conversations", type=int, default=48)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--first-len", type=int, default=200, help="turn-1 prompt tokens")
    p.add_argument("--turn-len", type=int, default=60, help="new user tokens per later turn")
    p.add_argument("--output-len", type=int, default=40, help="output tokens, multiturn")
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--pools", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 96])
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    p.add_argument(
        "--strategies",
        type=lambda s: s.split(","),
        default=list(STRATEGIES)[:3],
        help=", ".join(STRATEGIES),
    )
    p.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES))
    p.add_argument("--workloads", type=lambda s: s.split(","), default=["multiturn"])
    p.add_argument(
        "--suite-output-len", type=int, default=32, help="output tokens, other workloads"
    )
    add_engine_arguments(p, kv_tokens=262144)
    p.add_argument("--out-dir", default=None, help="write results.json, table.md, reuse.png here")
    return p.parse_args(argv)


def main(argv=None) -> None:
    from tqdm import tqdm

    args = parse_args(argv)
    if args.model_path:
        from lazyspec.models import load_model

        model = load_model(args.model_path)
    else:
        from lazyspec.testing.tiny_models import tiny_model

        model = tiny_model("qwen3_next")
    for name, choices in (
        ("workloads", WORKLOADS),
        ("strategies", STRATEGIES),
        ("policies", POLICIES),
    ):
        unknown = set(getattr(args, name)) - set(choices)
        if unknown:
            raise SystemExit(f"--{name}: unknown {sorted(unknown)}; known: {list(choices)}")
    jobs = [
        (w, s, policy, p, seed)
        for w in args.workloads
        for p in args.pools
        for s in args.strategies
        for policy in args.policies
        for seed in args.seeds
        # the cache-free run has no policy to vary: once, under the first one
        if s != "cache_off" or policy == args.policies[0]
    ]
    results = [run_once(model, *job, args) for job in tqdm(jobs, desc="reuse")]
    table = summarize(results)
    print(table)
    if args.out_dir:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
        (out / "table.md").write_text(table + "\n")
        plot(results, out / "reuse.png")


if __name__ == "__main__":
    main()
