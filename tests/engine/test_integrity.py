"""``Engine.check_integrity`` accounts for every KV page as well as every state slot: each
is exactly one of free, cached in the tree, or owned by one running request. A page leaked,
freed behind a running request's back, or held twice is reported. It also compares the
device's request table with the host's (pending updates applied)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lazyspec.engine.engine import Engine
from lazyspec.scheduler import batch as batch_module
from lazyspec.testing.tiny_models import small_engine, tiny_model


@pytest.fixture(scope="module")
def running_engine():
    """Two requests mid-decode, one of them past a cached in-prompt checkpoint."""
    engine = small_engine(
        tiny_model(), "extra_buffer_lazy", chunked_prefill_size=32, max_total_tokens=1024
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


# (allocator, its alloc and free methods, what check_integrity says of one leaked unit)
LEAKS = {
    "page": ("kv_allocator", "alloc_pages", "free_pages", "allocated but not cached or in use"),
    "slot": ("slot_allocator", "alloc", "free", "slots"),
}


@pytest.mark.parametrize("kind", LEAKS)
def test_leaked_page_or_slot_is_reported(running_engine, kind):
    engine, _ = running_engine
    name, alloc, free, message = LEAKS[kind]
    allocator = getattr(engine, name)
    leaked = getattr(allocator, alloc)(1)
    with pytest.raises(AssertionError, match=message):
        engine.check_integrity()
    getattr(allocator, free)(leaked)
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


def test_run_to_completion_after_the_checks(running_engine):
    engine, reqs = running_engine
    engine.run_until_done(reqs, check=Engine.check_integrity)
    assert all(len(r.output_ids) == 40 for r in reqs)
    assert engine.flush_cache()
    engine.check_integrity()
    assert engine.kv_allocator.num_free_pages == engine.layout.num_pages


def test_request_table_differing_from_the_host_is_reported(running_engine):
    engine, reqs = running_engine
    runner, row = engine.runner, reqs[0].req_row
    table = runner.pools.req_to_token
    runner.pools = dataclasses.replace(runner.pools, req_to_token=table.at[row, 3].add(1))
    try:
        with pytest.raises(AssertionError, match="device request table differs"):
            engine.check_integrity()
    finally:
        runner.pools = dataclasses.replace(runner.pools, req_to_token=table)
    engine.check_integrity()


def test_request_table_follows_every_kind_of_host_write(monkeypatch):
    """Admission (a fresh row, a matched prefix, a reused row) and the switch of a running
    request onto the tree's pages reach the device table; checked after every step. A
    small per-step bucket sends most updates in the chunks applied before a step."""
    monkeypatch.setattr(batch_module, "TABLE_UPDATES_PER_STEP", 8)
    engine = small_engine(
        tiny_model(),
        "extra_buffer_lazy",
        chunked_prefill_size=32,
        max_running_requests=2,
        max_total_tokens=1024,
        context_length=128,
    )
    rng = np.random.default_rng(5)
    prompt = list(rng.integers(3, 128, size=40))
    params = {"max_new_tokens": 12, "ignore_eos": True}
    first, twin = (engine.add_request(input_ids=prompt, sampling_params=params) for _ in "ab")
    table = engine.scheduler.cache.req_to_token
    own_start = None
    while not twin.output_ids:  # until the twin's prefill results are processed
        engine.step()
        engine.check_integrity()
        own_start = own_start if own_start is not None else table[twin.req_row, 0]
    # its checkpointed prompt now reads the first one's pages (its own duplicates are freed)
    assert table[twin.req_row, 0] != own_start
    np.testing.assert_array_equal(table[twin.req_row, :32], table[first.req_row, :32])
    # a prefix match and a reused row (the longer previous holder's entries are cleared)
    engine.run_until_done([first, twin], check=Engine.check_integrity)
    later = engine.add_request(input_ids=prompt[:36], sampling_params={"max_new_tokens": 2})
    engine.run_until_done([later], check=Engine.check_integrity)
    assert later.cached_tokens == 32 and later.req_row in (first.req_row, twin.req_row)
