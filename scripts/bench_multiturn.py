"""Multi-turn benchmark of the radix cache's host tier: reuse, TTFT and throughput with the
tier on and off (device only), the same requests, the same outputs.

N conversations x T turns: turn 1 is a prompt of ``--first-len`` tokens; turn k+1 is turn
k's prompt + its output + a tool output of ``--tool-len`` tokens + ``--user-len`` new user
tokens (lengths jittered +-25 %, seeded). Every turn is sent once the conversation's
previous turn finished, at most ``--concurrency`` at once, in the ``--order`` given:

| order       | which conversation's next turn goes next                                     |
|-------------|-------------------------------------------------------------------------------|
| round-robin | every conversation's turn 1, then every turn 2, ...: the longest reuse distance |
| random      | each round's conversations in a fresh random order                            |
| bursty      | ``--burst`` conversations run all their turns, then the next group             |

Reported per run: reuse (the later turns' prompt tokens served from the cache: sum of their
cached_tokens / sum of their prompt tokens), the later turns that hit, TTFT (submission to
first token; p50 and mean over every request), output tokens per second (wall clock over
the run), the tier's host hits and tokens moved, and whether the outputs equal the other
runs'. Programs are compiled before the clock starts. On CPU the tier's copies are plain
numpy copies; the embedded model (``lazyspec/assets/default_model``) is the default.

    python scripts/bench_multiturn.py                       # 24 x 3, round-robin, 4096 KV
    python scripts/bench_multiturn.py --order bursty --burst 4
    python scripts/bench_multiturn.py --tiny --conversations 8 --first-len 120   # seconds
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from lazyspec.bench.closed_loop import ClosedLoop, add_engine_arguments, engine_options

ORDERS = ("round-robin", "random", "bursty")
DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "lazyspec" / "assets" / "default_model"


def arrival_order(order: str, conversations: int, turns: int, burst: int, seed: int):
    """The (conversation, turn) pairs in the order they are sent (each after the
    conversation's previous turn finished)."""
    if order == "round-robin":
        return [(c, t) for t in range(turns) for c in range(conversations)]
    if order == "random":
        rng = np.random.default_rng(seed)
        return [(int(c), t) for t in range(turns) for c in rng.permutation(conversations)]
    if order == "bursty":
        groups = [range(g, min(g + burst, conversations)) for g in range(0, conversations, burst)]
        return [(c, t) for group in groups for t in range(turns) for c in group]
    raise ValueError(f"order {order!r} is not one of {ORDERS}")


class Conversations:
    """The prompts, built turn by turn from the outputs (seeded lengths and tokens)."""

    def __init__(self, args, vocab: int) -> None:
        self.args, self.vocab = args, vocab
        self.rng = np.random.default_rng(args.seed)
        self.prompts = [self._tokens(args.first_len) for _ in range(args.conversations)]

    def _tokens(self, n: int) -> list[int]:
        size = max(1, int(round(n * self.rng.uniform(0.75, 1.25))))
        return [int(t) for t in self.rng.integers(3, self.vocab, size=size)]

    def next_prompt(self, conversation: int, outputs: list[int]) -> None:
        added = self._tokens(self.args.tool_len) + self._tokens(self.args.user_len)
        self.prompts[conversation] = self.prompts[conversation] + outputs + added


@dataclass
class Result:
    tier: bool
    reuse: float
    hit_turns: int
    later_turns: int
    ttft_p50_s: float
    ttft_mean_s: float
    output_tok_s: float
    seconds: float
    host_hits: int
    loaded_tokens: int
    stored_tokens: int
    host_evictions: int
    outputs: list


def build_engine(model, args, tier: bool):
    from lazyspec.engine.engine import Engine

    pinned = {"extra_buffer": 3, "extra_buffer_lazy": 2, "no_buffer": 1}[args.strategy]
    return Engine(
        model=model,
        mamba_scheduler_strategy=args.strategy,
        max_running_requests=args.concurrency,
        max_mamba_cache_size=pinned * args.concurrency + args.spare_slots,
        enable_hierarchical_cache=tier,
        hicache_ratio=args.hicache_ratio,
        hicache_write_policy=args.write_policy,
        **engine_options(args),
    )


def run(model, args, tier: bool) -> Result:
    engine = build_engine(model, args, tier)
    conv = Conversations(args, model.config.vocab_size)
    order = deque(arrival_order(args.order, args.conversations, args.turns, args.burst, args.seed))
    done_turns = [0] * args.conversations
    loop, outputs = ClosedLoop(engine), {}
    start = time.perf_counter()
    while order or len(loop):
        while order and len(loop) < args.concurrency and done_turns[order[0][0]] == order[0][1]:
            c, t = order.popleft()
            loop.submit(conv.prompts[c], args.output_len, (c, t))
            done_turns[c] = -1  # in flight
        for req, (c, t) in loop.step():
            outputs[(c, t)] = list(req.output_ids)
            if t > 0:  # a later turn: it could hit
                loop.count_reuse(req)
            conv.next_prompt(c, list(req.output_ids))
            done_turns[c] = t + 1
    seconds = time.perf_counter() - start
    engine.shutdown()
    info = engine.get_server_info()
    assert engine.flush_cache()
    engine.check_integrity()
    return Result(
        tier=tier,
        reuse=loop.reuse,
        hit_turns=loop.hits,
        later_turns=loop.counted,
        ttft_p50_s=float(np.median(loop.ttfts)),
        ttft_mean_s=float(np.mean(loop.ttfts)),
        output_tok_s=loop.num_out / seconds,
        seconds=seconds,
        host_hits=info.get("hicache_num_host_hits", 0),
        loaded_tokens=info.get("hicache_num_loaded_tokens", 0),
        stored_tokens=info.get("hicache_num_stored_tokens", 0),
        host_evictions=info.get("hicache_num_host_evictions", 0),
        outputs=[outputs[key] for key in sorted(outputs)],
    )


def working_set(args) -> float:
    """Expected tokens of every conversation's last prompt (the cache a run could reuse)."""
    last = args.first_len + (args.turns - 1) * (args.output_len + args.tool_len + args.user_len)
    return args.conversations * last


def table(results: list[Result], args) -> str:
    lines = [
        "| tier | reuse | later turns hit | TTFT p50 (s) | TTFT mean (s) | output tok/s "
        "| host hits | tokens loaded / stored | host evictions |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {'on' if r.tier else 'off (device only)'} | {r.reuse:.3f} "
            f"| {r.hit_turns} / {r.later_turns} | {r.ttft_p50_s:.2f} | {r.ttft_mean_s:.2f} "
            f"| {r.output_tok_s:.1f} | {r.host_hits} | {r.loaded_tokens} / {r.stored_tokens} "
            f"| {r.host_evictions} |"
        )
    same = all(r.outputs == results[0].outputs for r in results)
    ratio = working_set(args) / args.kv_tokens
    lines += ["", f"working set ~{working_set(args):.0f} tokens = {ratio:.1f}x the device KV pool"]
    lines.append(f"outputs identical across runs: {same}")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=str(DEFAULT_MODEL))
    p.add_argument("--tiny", action="store_true", help="a random tiny Qwen3-Next instead")
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--first-len", type=int, default=400, help="turn-1 prompt tokens")
    p.add_argument("--tool-len", type=int, default=120, help="tool-output tokens per turn")
    p.add_argument("--user-len", type=int, default=20, help="new user tokens per turn")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--order", choices=ORDERS, default="round-robin")
    p.add_argument("--burst", type=int, default=4, help="conversations per group (bursty)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight at most")
    p.add_argument("--spare-slots", type=int, default=16, help="state slots past the pinned")
    p.add_argument("--hicache-ratio", type=float, default=6.0)
    p.add_argument("--write-policy", default="write_through")
    p.add_argument("--strategy", default="extra_buffer")
    add_engine_arguments(p, kv_tokens=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.tiny:
        from lazyspec.testing.tiny_models import tiny_model

        model = tiny_model("qwen3_next")
    else:
        from lazyspec.models import load_model

        model = load_model(args.model_path)
    results = [run(model, args, tier=False), run(model, args, tier=True)]
    print(table(results, args))
    if args.out:
        Path(args.out).write_text(json.dumps([asdict(r) for r in results], indent=1))


if __name__ == "__main__":
    main()
