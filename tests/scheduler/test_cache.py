"""``RequestCache``'s decode growth: a request's own pages grow in place, one page a step,
and stay exactly the pages its row of the request table points at."""

from __future__ import annotations

import numpy as np
import pytest

from lazyspec.cache.allocators import check_all
from lazyspec.scheduler.request import Req, SamplingParams
from tests.scheduler.test_admission import _scheduler


def _own_rows_in_table(cache, req: Req) -> np.ndarray:
    """The KV rows the request table gives the request's own positions."""
    end = cache.covered_len(req)
    return cache.req_to_token[req.req_row, req.prefix_len : end]


def test_decode_growth_appends_pages_in_place():
    sched = _scheduler(max_total_tokens=256, context_length=200)
    cache = sched.cache
    req = Req("a", list(range(1, 9)), SamplingParams(max_new_tokens=150, ignore_eos=True))
    match = sched.tree.match_prefix(req.input_ids)
    cache.admit(req, match, cache.pages_needed(req, len(req.input_ids), 0))
    addresses = []  # where the list lies after each step: a move copies every page
    for length in range(cache.covered_len(req) + 1, 160):
        assert cache.pages_to_cover(req, length) == 1
        cache.grow([req], [length])
        assert cache.covered_len(req) == length
        own = cache.kv.pages_to_token_indices(req.own_pages)
        np.testing.assert_array_equal(_own_rows_in_table(cache, req), own)
        addresses.append(req.own_pages.ctypes.data)
    moves = sum(a != b for a, b in zip(addresses, addresses[1:]))
    check_all(cache.kv, cache.slots, sched.tree, [], req.own_pages)
    # ~150 appends, each new buffer twice the length of the last: a handful of moves
    assert moves <= 5, moves
    assert len(set(req.own_pages.tolist())) == len(req.own_pages)


def test_growth_after_trimming_keeps_the_pages_apart():
    """A running request's insert trims its own pages (the tree owns the front); growing
    after that must neither write into pages still listed elsewhere nor lose any."""
    sched = _scheduler(max_total_tokens=256, context_length=200)
    cache = sched.cache
    req = Req("a", list(range(1, 9)), SamplingParams(max_new_tokens=150, ignore_eos=True))
    cache.admit(req, sched.tree.match_prefix(req.input_ids), 8 + cache.layout.run_past_headroom)
    for length in range(cache.covered_len(req) + 1, 40):
        cache.grow([req], [length])
    req.output_ids = list(range(100, 130))
    before = req.own_pages.copy()
    taken = cache.cache_req(req, 24, slot=cache.slots.alloc(1)[0], finished=False)
    assert taken and req.prefix_len == 24
    trimmed = req.own_pages.copy()
    np.testing.assert_array_equal(trimmed, before[24:])
    for length in range(cache.covered_len(req) + 1, 90):
        cache.grow([req], [length])
    np.testing.assert_array_equal(req.own_pages[: len(trimmed)], trimmed)
    np.testing.assert_array_equal(
        _own_rows_in_table(cache, req), cache.kv.pages_to_token_indices(req.own_pages)
    )
    assert not np.isin(req.own_pages, before[:24]).any()  # the tree's pages stay the tree's


def test_growing_several_requests_at_once_fills_each_row():
    """One ``grow`` for several requests (pages of 4 tokens; one request needing no page,
    one growing by several, one up to context_len): each row's table entries are exactly
    its own pages' token rows and no other entry changes, and the pending updates name
    exactly the entries that changed."""
    sched = _scheduler(max_total_tokens=256, context_length=44, page_size=4, max_running_requests=4)
    cache = sched.cache
    reqs = []
    for rid, prompt_len in (("a", 8), ("b", 12), ("c", 4), ("d", 32)):
        req = Req(rid, list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=8))
        cache.admit(req, sched.tree.match_prefix(req.input_ids), -(-prompt_len // 4))
        reqs.append(req)
    cache.take_updates([r.req_row for r in reqs])
    before = cache.req_to_token.copy()
    lengths = [8, 21, 6, 41]  # no page, 3 pages, 1 page, 3 pages up to context_len, 44
    counts = [cache.pages_to_cover(r, n) for r, n in zip(reqs, lengths)]
    assert counts == [0, 3, 1, 3]
    cache.grow(reqs, lengths, counts)
    for req, length in zip(reqs, lengths):
        own = cache.kv.pages_to_token_indices(req.own_pages)
        end = cache.covered_len(req)
        assert end >= length
        np.testing.assert_array_equal(_own_rows_in_table(cache, req), own)
        np.testing.assert_array_equal(
            cache.req_to_token[req.req_row, end:], before[req.req_row, end:]
        )
    rows, positions, values = cache.take_updates([r.req_row for r in reqs])
    changed = np.argwhere(cache.req_to_token != before)
    np.testing.assert_array_equal(np.stack([rows, positions], axis=1), changed)
    np.testing.assert_array_equal(values, cache.req_to_token[rows, positions])
    check_all(cache.kv, cache.slots, sched.tree, [], np.concatenate([r.own_pages for r in reqs]))


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_reused_row_keeps_no_entry_of_its_last_holder(page_size):
    """A row's entries past its request's pages are zero, also after the row's last holder
    grew it step by step (at page size 1 a decode step adds one entry per row): admission
    clears what the last holder wrote."""
    sched = _scheduler(max_total_tokens=256, context_length=64, page_size=page_size)
    cache = sched.cache
    first = Req("a", list(range(1, 9)), SamplingParams(max_new_tokens=40, ignore_eos=True))
    cache.admit(first, sched.tree.match_prefix(first.input_ids), -(-8 // page_size))
    for length in range(9, 41):
        cache.grow([first], [length])
    row = first.req_row
    assert cache.req_to_token[row, 39] != 0
    cache.drop(first)
    second = Req("b", list(range(50, 54)), SamplingParams(max_new_tokens=4, ignore_eos=True))
    cache.admit(second, sched.tree.match_prefix(second.input_ids), -(-4 // page_size))
    assert second.req_row == row
    end = cache.covered_len(second)
    own = cache.kv.pages_to_token_indices(second.own_pages)
    np.testing.assert_array_equal(cache.req_to_token[row, :end], own)
    assert not cache.req_to_token[row, end:].any()


def test_an_entry_written_twice_before_a_step_is_sent_once():
    """A row's entries written by one holder and then by the next before any step took
    them are each sent once, with the table's current value, and then no longer."""
    sched = _scheduler(max_total_tokens=256, context_length=64)
    cache = sched.cache
    before = cache.req_to_token.copy()
    first = Req("a", list(range(1, 13)), SamplingParams(max_new_tokens=4, ignore_eos=True))
    cache.admit(first, sched.tree.match_prefix(first.input_ids), 12)
    row = first.req_row
    cache.drop(first)
    second = Req("b", list(range(50, 55)), SamplingParams(max_new_tokens=4, ignore_eos=True))
    cache.admit(second, sched.tree.match_prefix(second.input_ids), 5)
    assert second.req_row == row
    rows, positions, values = cache.take_updates([row])
    entries = list(zip(rows.tolist(), positions.tolist()))
    assert len(set(entries)) == len(entries) >= 12
    np.testing.assert_array_equal(values, cache.req_to_token[rows, positions])
    changed = {tuple(e) for e in np.argwhere(cache.req_to_token != before).tolist()}
    assert changed <= set(entries)
    assert cache.take_updates([row]).shape == (3, 0)
