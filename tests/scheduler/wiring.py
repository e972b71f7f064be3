"""The small engine settings of the scheduler tests and a scheduler wired on them as the
engine wires one: allocators, tree, slot policy, request cache. No jax."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from lazyspec.cache.allocators import KVAllocator, SlotAllocator
from lazyspec.cache.radix_cache import RadixCache
from lazyspec.config import EngineConfig
from lazyspec.scheduler.cache import RequestCache
from lazyspec.scheduler.layout import Layout
from lazyspec.scheduler.policy import SlotPolicy
from lazyspec.scheduler.scheduler import Scheduler

CHUNK, INTERVAL, CHUNKED_PREFILL, PAGE = 16, 32, 64, 2
MODEL = SimpleNamespace(max_position_embeddings=4096)


def small_config(
    num_pages: int,
    num_slots: int,
    max_running: int,
    strategy: str = "extra_buffer",
    num_verify: int = 1,
    **settings: Any,
) -> EngineConfig:
    """``num_pages`` pages of ``PAGE`` tokens, ``num_slots`` state slots, ``max_running``
    requests, 256-token contexts, the tests' chunk, interval and prefill chunk, NEXTN
    speculation where ``num_verify`` > 1; ``settings`` added."""
    spec = {"speculative_algorithm": "NEXTN", "speculative_num_steps": num_verify - 1}
    return EngineConfig(
        page_size=PAGE,
        max_running_requests=max_running,
        max_total_tokens=num_pages * PAGE,
        max_mamba_cache_size=num_slots,
        context_length=256,
        mamba_scheduler_strategy=strategy,
        mamba_track_interval=INTERVAL,
        mamba_chunk_size=CHUNK,
        chunked_prefill_size=CHUNKED_PREFILL,
        **(spec if num_verify > 1 else {}),
        **settings,
    )


def wired_scheduler(
    layout: Layout,
    kv: KVAllocator,
    slots: SlotAllocator,
    grid: int | None = None,
    **options: Any,
) -> tuple[RadixCache, Scheduler]:
    """(the tree, a scheduler of ``layout`` over ``kv`` and ``slots``) wired as the engine
    wires them; ``grid`` the slot policy's checkpoint grid, ``options`` the scheduler's
    (EOS id 2 unless they say)."""
    tree = RadixCache(layout.page_size, kv, slots)
    policy = SlotPolicy(
        layout.strategy, layout.track_interval, layout.num_verify, slots, tree, grid=grid
    )
    cache = RequestCache(layout, tree, kv, slots)
    return tree, Scheduler(layout, policy, cache, **{"eos_ids": (2,), **options})
