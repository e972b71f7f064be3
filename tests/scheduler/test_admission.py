"""Admission is query-then-mutate: ``can_admit`` changes nothing the request needs, and a
request that does not fit leaves the cache as it was (no eviction for nothing)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from lazyspec.cache.allocators import KVAllocator, SlotAllocator, check_all
from lazyspec.config import EngineConfig
from lazyspec.scheduler.layout import plan_memory
from lazyspec.scheduler.request import Phase, Req, SamplingParams
from lazyspec.scheduler.scheduler import Scheduler
from tests.scheduler.wiring import wired_scheduler

MODEL = SimpleNamespace(max_position_embeddings=4096)


def _scheduler(**overrides) -> Scheduler:
    config = dict(
        max_running_requests=4,
        max_total_tokens=48,
        max_mamba_cache_size=12,
        context_length=64,
        mamba_scheduler_strategy="extra_buffer",
        mamba_track_interval=16,
        mamba_chunk_size=8,
        chunked_prefill_size=16,
    )
    layout = plan_memory(EngineConfig(**(config | overrides)), MODEL)
    kv, slots = KVAllocator(layout.num_pages, layout.page_size), SlotAllocator(layout.num_slots)
    return wired_scheduler(layout, kv, slots, eos_ids=())[1]


def _req(rid: str, prompt: list[int], max_new: int) -> Req:
    return Req(rid, prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True))


def _cache_prefix(sched: Scheduler, tokens: list[int]) -> None:
    """Put ``tokens`` in the tree with a state, the way a finished request would."""
    kv, slots = sched.cache.kv, sched.cache.slots
    rows = kv.pages_to_token_indices(kv.alloc_pages(len(tokens)))
    sched.tree.insert(tokens, rows, slots.alloc(1)[0])


def _state(sched: Scheduler) -> tuple:
    cache = sched.cache
    return (
        cache.kv.num_free_pages,
        cache.slots.num_free,
        sched.tree.num_cached_tokens,
        sched.tree.num_cached_slots,
        len(cache.free_rows),
    )


def test_a_request_that_cannot_fit_evicts_nothing():
    sched = _scheduler()
    rng = np.random.default_rng(0)
    for _ in range(3):
        _cache_prefix(sched, rng.integers(1, 100, 16).tolist())
    before = _state(sched)
    assert before[0] == 0 and before[2] == 48 and before[3] == 3
    # 46 prompt tokens + the run-past headroom (3) need more than free + evictable (48)
    big = _req("big", rng.integers(1, 100, 46).tolist(), 30)
    assert sched.can_admit(big) is None
    assert _state(sched) == before
    sched.add(big)
    assert sched.schedule() is None  # cannot run even alone: refused, cache intact
    assert big.phase is Phase.FINISHED and big.finish_reason["type"] == "abort"
    assert _state(sched) == before
    check_all(sched.cache.kv, sched.cache.slots, sched.tree, [], [])


def test_a_request_that_fits_after_eviction_is_admitted_with_exactly_its_resources():
    sched = _scheduler()
    rng = np.random.default_rng(1)
    for _ in range(3):
        _cache_prefix(sched, rng.integers(1, 100, 16).tolist())
    req = _req("r", rng.integers(1, 100, 20).tolist(), 20)
    admission = sched.can_admit(req)
    assert admission is not None and admission.num_slots == 3
    # the prompt and the run-past headroom: decode steps allocate as they go
    assert admission.num_pages == 20 + sched.layout.run_past_headroom
    sched.admit(req, admission)
    assert req.phase is Phase.PREFILL and len(req.slots.owned()) == 3
    assert len(req.own_pages) == admission.num_pages
    check_all(sched.cache.kv, sched.cache.slots, sched.tree, req.slots.owned(), req.own_pages)


def test_the_matched_prefix_is_locked_not_evicted_to_make_room():
    sched = _scheduler()
    rng = np.random.default_rng(2)
    shared = rng.integers(1, 100, 16).tolist()
    _cache_prefix(sched, shared)
    _cache_prefix(sched, rng.integers(1, 100, 16).tolist())
    req = _req("r", shared + rng.integers(1, 100, 8).tolist(), 20)
    admission = sched.can_admit(req)
    assert admission is not None and admission.match.prefix_len == 16
    sched.admit(req, admission)
    assert req.prefix_len == req.cached_tokens == 16
    assert sched.tree.match_prefix(shared + [0]).prefix_len == 16  # still cached
    check_all(sched.cache.kv, sched.cache.slots, sched.tree, req.slots.owned(), req.own_pages)


def _first_admitted(policy: str, cached: list[int], prompts: list[list[int]]) -> list[str]:
    """Ids of the requests the first schedule admits (one place) under ``policy``."""
    sched = _scheduler(max_running_requests=1)
    sched.schedule_policy = policy
    _cache_prefix(sched, cached)
    for i, prompt in enumerate(prompts):
        sched.add(_req(f"r{i}", prompt, 4))
    sched.schedule()
    return [r.rid for r in sched.running]


def test_lpm_admits_the_longest_cached_prefix_first(monkeypatch):
    rng = np.random.default_rng(1)
    cached = rng.integers(1, 100, 16).tolist()
    other = rng.integers(100, 200, 20).tolist()
    prompts = [other, cached[:8] + other[:4], cached + other[:4]]  # 0, 8 and 16 cached
    assert _first_admitted("fcfs", cached, prompts) == ["r0"]
    assert _first_admitted("lpm", cached, prompts) == ["r2"]
    # equal matches keep arrival order
    assert _first_admitted("lpm", cached, [prompts[0], other[::-1]]) == ["r0"]
    # past the cut-off the queue keeps arrival order, as SGLang's
    monkeypatch.setattr("lazyspec.scheduler.scheduler.LPM_MAX_WAITING", 2)
    assert _first_admitted("lpm", cached, prompts) == ["r0"]
