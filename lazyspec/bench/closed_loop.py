"""Requests in flight on an in-process ``Engine``, stepped until they finish, with the
figures the reuse benchmarks report (``scripts/bench_reuse.py``,
``scripts/bench_multiturn.py``): each request's time to first token, the output tokens, and
over the requests that count toward reuse the prompt tokens served from the cache; and the
engine options both benchmarks take."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any

# ``--spec``: the MTP head drafting three tokens (D = 4)
NEXTN = dict(speculative_algorithm="NEXTN", speculative_num_steps=3)


def add_engine_arguments(parser: argparse.ArgumentParser, kv_tokens: int) -> None:
    """The engine options of the closed-loop benchmarks (``engine_options`` reads them);
    ``kv_tokens`` the default device KV pool. Mutates ``parser``."""
    parser.add_argument("--interval", type=int, default=64, help="mamba_track_interval")
    parser.add_argument("--chunk", type=int, default=64, help="mamba_chunk_size")
    parser.add_argument("--chunked-prefill", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--kv-tokens", type=int, default=kv_tokens, help="device KV pool")
    parser.add_argument("--spec", action="store_true", help="NEXTN speculation (3 steps, D=4)")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """``Engine`` settings of ``add_engine_arguments``' options, every program compiled
    before the clock starts (later engines of the process find them compiled), so that TTFT
    and throughput measure serving, not compilation."""
    return dict(
        mamba_track_interval=args.interval,
        mamba_chunk_size=args.chunk,
        chunked_prefill_size=args.chunked_prefill,
        max_total_tokens=args.kv_tokens,
        context_length=args.context,
        skip_warmup=False,
        **(NEXTN if args.spec else {}),
    )


@dataclass
class ClosedLoop:
    """The live requests of ``engine`` and the running figures. ``ttfts``: submission to the
    step after which a request had its first token (queueing included), one a finished
    request; ``reuse`` / ``counted``: over the requests ``finish`` was told count, the sum of
    cached tokens over the sum of prompt tokens, and how many hit / were counted."""

    engine: Any
    ttfts: list[float] = field(default_factory=list)
    num_out: int = 0
    cached_tokens: int = 0
    prompt_tokens: int = 0
    hits: int = 0
    counted: int = 0
    _live: dict[int, tuple[Any, Any, float]] = field(default_factory=dict, init=False, repr=False)
    _first: dict[int, float] = field(default_factory=dict, init=False, repr=False)

    def __len__(self) -> int:
        return len(self._live)

    def submit(self, prompt: list[int], max_new_tokens: int, tag: Any) -> None:
        """Add ``prompt`` (greedy length ``max_new_tokens``, EOS ignored) to the engine;
        ``tag`` comes back with it from ``step``. Mutates the engine."""
        params = {"max_new_tokens": max_new_tokens, "ignore_eos": True}
        req = self.engine.add_request(input_ids=prompt, sampling_params=params)
        self._live[req.rid] = (req, tag, time.perf_counter())

    def step(self) -> list[tuple[Any, Any]]:
        """One engine step; the requests it finished, as (req, tag), in submission order,
        their TTFT and output tokens counted (not yet their reuse: ``count_reuse``)."""
        self.engine.step()
        now = time.perf_counter()
        finished = []
        for rid, (req, tag, sent) in list(self._live.items()):
            if req.output_ids and rid not in self._first:
                self._first[rid] = now - sent
            if req.finished:
                del self._live[rid]
                self.ttfts.append(self._first.get(rid, now - sent))
                self.num_out += len(req.output_ids)
                finished.append((req, tag))
        return finished

    def count_reuse(self, req: Any) -> None:
        """Count a finished request toward the reuse figures."""
        self.cached_tokens += req.cached_tokens
        self.prompt_tokens += len(req.input_ids)
        self.hits += req.cached_tokens > 0
        self.counted += 1

    @property
    def reuse(self) -> float:
        return self.cached_tokens / max(self.prompt_tokens, 1)
