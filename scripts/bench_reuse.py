"""The RadixCache reuse benchmark: multi-turn conversations against a shared state pool.

N independent conversations x T turns; turn k+1 = turn k's prompt + its output + new user
tokens, submitted when turn k finishes; at most ``--max-running`` requests run at once.
Reported: the fraction of prompt tokens served from the cache on turns 2..T
(sum cached_tokens / sum prompt_tokens), per strategy and state-pool size, over seeds.

    python scripts/bench_reuse.py --out-dir bench_out            # the default grid
    python scripts/bench_reuse.py --spec --out-dir bench_out     # with NEXTN speculation

Strategies: extra_buffer, extra_buffer_lazy, and lazy with the old evict-on-failure
behaviour restored (``debug_lazy_evict_on_failure``), which shows why it was removed.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

STRATEGIES = {
    "extra_buffer": dict(mamba_scheduler_strategy="extra_buffer"),
    "extra_buffer_lazy": dict(mamba_scheduler_strategy="extra_buffer_lazy"),
    "lazy+evict_on_failure": dict(
        mamba_scheduler_strategy="extra_buffer_lazy", debug_lazy_evict_on_failure=True
    ),
}


@dataclass(frozen=True)
class Result:
    strategy: str
    pool: int
    seed: int
    reuse: float
    hit_requests: int
    requests: int
    accept_len: float | None


def run_once(model, strategy: str, pool: int, seed: int, args) -> Result:
    from lazyspec.engine.engine import Engine

    spec = dict(speculative_algorithm="NEXTN", speculative_num_steps=3) if args.spec else {}
    engine = Engine(
        model=model,
        max_running_requests=args.max_running,
        max_mamba_cache_size=pool,
        mamba_track_interval=args.interval,
        mamba_chunk_size=args.chunk,
        chunked_prefill_size=args.chunked_prefill,
        max_total_tokens=args.kv_tokens,
        context_length=args.context,
        random_seed=seed,
        skip_warmup=True,
        **STRATEGIES[strategy],
        **spec,
    )
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size

    def jitter(n: int) -> int:
        """Lengths vary +-25 % per request (seeded), so seeds change the schedule."""
        return max(1, int(round(n * rng.uniform(0.75, 1.25))))

    def user_tokens(n: int) -> list[int]:
        return [int(t) for t in rng.integers(3, vocab, size=jitter(n))]

    def params() -> dict:
        return {"max_new_tokens": jitter(args.output_len), "ignore_eos": True}

    live = {}  # rid -> (request, conversation, turn, prompt)
    for conv in range(args.conversations):
        prompt = user_tokens(args.first_len)
        req = engine.add_request(input_ids=prompt, sampling_params=params())
        live[req.rid] = (req, conv, 1, prompt)
    cached = prompt_tokens = hits = count = 0
    while live:
        engine.step()
        for rid, (req, conv, turn, prompt) in list(live.items()):
            if not req.finished:
                continue
            del live[rid]
            if turn >= 2:
                cached += req.cached_tokens
                prompt_tokens += len(prompt)
                hits += req.cached_tokens > 0
                count += 1
            if turn < args.turns:
                nxt = prompt + req.output_ids + user_tokens(args.turn_len)
                new = engine.add_request(input_ids=nxt, sampling_params=params())
                live[new.rid] = (new, conv, turn + 1, nxt)
    engine.shutdown()
    engine.check_integrity()
    accept = engine.get_server_info()["avg_accept_length"]
    return Result(strategy, pool, seed, cached / max(prompt_tokens, 1), hits, count, accept)


def summarize(results: list[Result]) -> str:
    pools = sorted({r.pool for r in results}, reverse=True)
    lines = [
        "| state pool (slots) | " + " | ".join(STRATEGIES) + " |",
        "|---|" + "---|" * len(STRATEGIES),
    ]
    for pool in pools:
        cells = []
        for name in STRATEGIES:
            vals = [r.reuse for r in results if r.pool == pool and r.strategy == name]
            cells.append(f"{np.mean(vals):.4f} ({min(vals):.4f}-{max(vals):.4f})" if vals else "-")
        lines.append(f"| {pool} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pools = sorted({r.pool for r in results}, reverse=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(STRATEGIES)
    for i, name in enumerate(STRATEGIES):
        means = [
            np.mean([r.reuse for r in results if r.pool == p and r.strategy == name]) for p in pools
        ]
        ax.bar(np.arange(len(pools)) + i * width, means, width, label=name)
    ax.set_xticks(np.arange(len(pools)) + width * (len(STRATEGIES) - 1) / 2)
    ax.set_xticklabels([f"{p} slots" for p in pools])
    ax.set_ylabel("prompt tokens served from cache (turns 2+)")
    ax.set_title("RadixCache reuse by checkpoint strategy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="HF folder; default: tiny random Qwen3-Next")
    p.add_argument("--conversations", type=int, default=48)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--first-len", type=int, default=200, help="turn-1 prompt tokens")
    p.add_argument("--turn-len", type=int, default=60, help="new user tokens per later turn")
    p.add_argument("--output-len", type=int, default=40)
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--pools", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 96])
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    p.add_argument("--strategies", type=lambda s: s.split(","), default=list(STRATEGIES))
    p.add_argument("--interval", type=int, default=64)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--chunked-prefill", type=int, default=256)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--kv-tokens", type=int, default=262144)
    p.add_argument("--spec", action="store_true", help="NEXTN speculation (3 steps, D=4)")
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
    jobs = [(s, p, seed) for p in args.pools for s in args.strategies for seed in args.seeds]
    results = [run_once(model, s, p, seed, args) for s, p, seed in tqdm(jobs, desc="reuse")]
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
