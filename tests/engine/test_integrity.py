"""``Engine.check_integrity`` accounts for every KV page as well as every state slot: each
is exactly one of free, cached in the tree, or owned by one running request. A page leaked,
freed behind a running request's back, or held twice is reported."""

from __future__ import annotations

import numpy as np
import pytest

from lazyspec.engine.engine import Engine
from lazyspec.testing.tiny_models import tiny_model


@pytest.fixture(scope="module")
def running_engine():
    """Two requests mid-decode, one of them past a cached in-prompt checkpoint."""
    engine = Engine(
        model=tiny_model(),
        mamba_scheduler_strategy="extra_buffer_lazy",
        mamba_track_interval=16,
        mamba_chunk_size=16,
        chunked_prefill_size=32,
        max_running_requests=4,
        max_total_tokens=1024,
        context_length=256,
        skip_warmup=True,
    )
    rng = np.random.default_rng(4)
    params = {"max_new_tokens": 40, "ignore_eos": True}
    reqs = [
        engine.add_request(input_ids=list(rng.integers(3, 128, size=n)), sampling_params=params)
        for n in (37, 20)
    ]
    for _ in range(8):
        engine.step()
        engine.check_integrity()
    assert len(engine.scheduler.running) == 2 and all(len(r.output_ids) > 2 for r in reqs)
    assert engine.tree.num_cached_tokens > 0  # own_pages were trimmed for the cached prefix
    return engine, reqs


def test_leaked_page_is_reported(running_engine):
    engine, _ = running_engine
    leaked = engine.kv_allocator.alloc_pages(1)
    with pytest.raises(AssertionError, match="allocated but not cached or in use"):
        engine.check_integrity()
    engine.kv_allocator.free_pages(leaked)
    engine.check_integrity()


def test_page_freed_behind_a_running_request_is_reported(running_engine):
    engine, reqs = running_engine
    page = int(reqs[0].own_pages[-1])
    engine.kv_allocator.free_pages([page])
    with pytest.raises(AssertionError, match="held but free"):
        engine.check_integrity()
    assert engine.kv_allocator.alloc_pages(1).tolist() == [page]  # the free list is LIFO
    engine.check_integrity()


def test_page_held_twice_is_reported(running_engine):
    engine, reqs = running_engine
    own = reqs[1].own_pages
    reqs[1].own_pages = np.concatenate([own, reqs[0].own_pages[-1:]])
    try:
        with pytest.raises(AssertionError, match="held twice"):
            engine.check_integrity()
    finally:
        reqs[1].own_pages = own
    engine.check_integrity()


def test_leaked_slot_is_reported(running_engine):
    engine, _ = running_engine
    leaked = engine.slot_allocator.alloc(1)
    with pytest.raises(AssertionError, match="slots"):
        engine.check_integrity()
    engine.slot_allocator.free(leaked)
    engine.check_integrity()


def test_run_to_completion_after_the_checks(running_engine):
    engine, reqs = running_engine
    engine.run_until_done(reqs, check=Engine.check_integrity)
    assert all(len(r.output_ids) == 40 for r in reqs)
    assert engine.flush_cache()
    engine.check_integrity()
    assert engine.kv_allocator.num_free_pages == engine.layout.num_pages
