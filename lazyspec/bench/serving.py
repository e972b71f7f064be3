"""Shared-prefix serving benchmark against a running lazyspec (or SGLang) server.

Builds ``--num-groups`` groups of prompts; the prompts of a group share a random
``--prefix-len``-token prefix and differ in a random suffix (``--suffix-len`` tokens). Each
request is streamed from ``/generate`` (greedy, ``ignore_eos``, ``--output-len`` tokens) with at
most ``--concurrency`` in flight and, optionally, Poisson arrivals at ``--request-rate``.
Reports time to first token, inter-token latency, end-to-end latency, request and token
throughput, and the prefix-cache hit rate (cached / prompt tokens, from each response's
``meta_info``), as a table.

    python scripts/serve.py --model-path /path/to/model &
    python scripts/bench_serving.py --url http://127.0.0.1:30000 --num-groups 8 \\
        --prompts-per-group 16 --prefix-len 1024 --suffix-len 128 --output-len 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str | None = None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", default="http://127.0.0.1:30000", help="Server base URL.")
    p.add_argument(
        "--num-groups", type=int, default=8, help="Prompt groups (one shared prefix each)."
    )
    p.add_argument("--prompts-per-group", type=int, default=8, help="Prompts per group.")
    p.add_argument("--prefix-len", type=int, default=256, help="Shared prefix tokens per group.")
    p.add_argument(
        "--suffix-len",
        type=int,
        default=64,
        help="Largest unique suffix (each prompt draws 1..this many tokens).",
    )
    p.add_argument("--output-len", type=int, default=64, help="Tokens generated per request.")
    p.add_argument("--concurrency", type=int, default=32, help="Most requests in flight.")
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrival rate in requests/s (inf: all at once).",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="Token ids are drawn below this (default: /server_info's vocab_size).",
    )
    p.add_argument("--seed", type=int, default=0, help="Workload random seed.")
    p.add_argument("--flush", action="store_true", help="POST /flush_cache before the run.")
    p.add_argument("--json-out", default=None, help="Also write the summary to this file.")
    return p


def make_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """Group-major prompts shuffled together, so requests of a group arrive interleaved."""
    rng = np.random.default_rng(args.seed)
    low = min(16, vocab - 1)
    prompts = []
    for _ in range(args.num_groups):
        prefix = rng.integers(low, vocab, size=args.prefix_len).tolist()
        for _ in range(args.prompts_per_group):
            suffix = rng.integers(low, vocab, size=int(rng.integers(1, args.suffix_len + 1)))
            prompts.append(prefix + suffix.tolist())
    order = rng.permutation(len(prompts))
    return [prompts[i] for i in order]


async def one_request(
    client: httpx.AsyncClient, prompt: list[int], output_len: int
) -> RequestStats:
    """Stream one /generate request and time its chunks."""
    stats = RequestStats(prompt_tokens=len(prompt))
    body = {
        "input_ids": prompt,
        "stream": True,
        "sampling_params": {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True},
    }
    start = last = time.perf_counter()
    seen = 0
    try:
        async with client.stream("POST", "/generate", json=body) as response:
            if response.status_code != 200:
                stats.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return stats
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    stats.error = str(chunk["error"])
                    break
                now, num = time.perf_counter(), len(chunk["output_ids"])
                if num > seen:
                    if stats.ttft is None:
                        stats.ttft = now - start
                        seen, last = 1, now
                    if num > seen:
                        stats.itl += [(now - last) / (num - seen)] * (num - seen)
                        seen, last = num, now
                stats.cached_tokens = chunk["meta_info"].get("cached_tokens", 0)
    except httpx.HTTPError as exc:
        stats.error = repr(exc)
    stats.output_tokens = seen
    stats.latency = time.perf_counter() - start
    return stats


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the workload; returns the summary dict (also what ``--json-out`` writes)."""
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=args.url, timeout=None, limits=limits) as client:
        vocab = args.vocab_size or (await client.get("/server_info")).json()["vocab_size"]
        if args.flush:
            (await client.post("/flush_cache")).raise_for_status()
        prompts = make_prompts(args, vocab)
        gate = asyncio.Semaphore(args.concurrency)
        rng = np.random.default_rng(args.seed + 1)

        async def limited(prompt: list[int]) -> RequestStats:
            async with gate:
                return await one_request(client, prompt, args.output_len)

        tasks, start = [], time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if np.isfinite(args.request_rate):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration)


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    a = np.asarray(values) * 1000.0
    return {
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
    }


def summarize(results: list[RequestStats], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    return {
        "requests": len(results),
        "completed": len(ok),
        "errors": [r.error for r in results if r.error][:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": output / duration,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "cache_hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "ttft_ms": _percentiles([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": _percentiles([x for r in ok for x in r.itl]),
        "e2e_ms": _percentiles([r.latency for r in ok]),
    }


def format_table(summary: dict[str, Any]) -> str:
    lines = [
        f"{'requests completed':<28}{summary['completed']} / {summary['requests']}",
        f"{'duration (s)':<28}{summary['duration_s']:.2f}",
        f"{'request throughput (req/s)':<28}{summary['request_throughput']:.2f}",
        f"{'output throughput (tok/s)':<28}{summary['output_throughput']:.1f}",
        f"{'prompt / output tokens':<28}{summary['prompt_tokens']} / {summary['output_tokens']}",
        f"{'cache hit rate':<28}{summary['cache_hit_rate']:.3f} "
        f"({summary['cached_tokens']} cached prompt tokens)",
        "",
        f"{'latency (ms)':<16}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for key, label in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_ms", "end-to-end")):
        row = summary[key]
        lines.append(
            f"{label:<16}" + "".join(f"{row[q]:>10.1f}" for q in ("mean", "p50", "p90", "p99"))
        )
    for error in summary["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    summary = asyncio.run(run(args))
    print(format_table(summary))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=2)
    return summary


if __name__ == "__main__":
    main()
