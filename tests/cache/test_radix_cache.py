"""Unit tests of every RadixCache rule: splits, tombstones, matches, duplicates, locks, LRU."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from lazyspec.cache.allocators import KVAllocator, SlotAllocator
from lazyspec.cache.radix_cache import RadixCache, check_all

PAGE_SIZES = [1, 4]


class Setup:
    """A tree over fresh allocators, with methods that allocate KV / slots for inserts."""

    def __init__(
        self, page_size: int, num_pages: int = 64, num_slots: int = 16, disable: bool = False
    ) -> None:
        self.page_size = page_size
        self.kv = KVAllocator(num_pages, page_size)
        self.slots = SlotAllocator(num_slots)
        self.tree = RadixCache(page_size, self.kv, self.slots, disable=disable)
        self.rng = np.random.default_rng(1234 + page_size)

    def tokens(self, num_pages: int) -> list[int]:
        return self.rng.integers(0, 50_000, size=num_pages * self.page_size).tolist()

    def fresh_kv(self, num_tokens: int) -> np.ndarray:
        return self.kv.pages_to_token_indices(self.kv.alloc_pages(num_tokens // self.page_size))

    def insert(self, key: list[int], kv: np.ndarray | None = None):
        """Insert ``key`` with fresh KV (unless given) and a fresh slot; frees an untaken slot."""
        slot = self.slots.alloc(1)[0]
        result = self.tree.insert(key, self.fresh_kv(len(key)) if kv is None else kv, slot)
        if not result.state_taken:
            self.slots.free([slot])
        return result, slot

    def check(self) -> None:
        check_all(self.kv, self.slots, self.tree, [], [])


@pytest.fixture(params=PAGE_SIZES)
def s(request: pytest.FixtureRequest) -> Iterator[Setup]:
    """A ``Setup`` at each of ``PAGE_SIZES``, whose allocators and tree are checked
    (``Setup.check``) once the test is done with them."""
    setup = Setup(request.param)
    yield setup
    setup.check()


def test_insert_then_match_returns_the_inserted_kv_and_state(s: Setup) -> None:
    key = s.tokens(3)
    kv = s.fresh_kv(len(key))
    slot = s.slots.alloc(1)[0]
    result = s.tree.insert(key, kv, slot)
    assert result.state_taken and result.num_new_tokens == len(key)
    assert result.node.state_slot == slot
    query = key + s.tokens(2)[: s.page_size + 1]  # a longer query with an unaligned tail
    match = s.tree.match_prefix(query)
    assert match.prefix_len == len(key) == len(match.kv_indices) == match.kv_match_len
    assert match.kv_indices.dtype == np.int32 and np.array_equal(match.kv_indices, kv)
    assert match.state_slot == slot and match.node is result.node
    assert s.tree.num_cached_tokens == len(key) and s.tree.num_cached_slots == 1


def test_split_makes_a_tombstone_parent_and_match_skips_it(s: Setup) -> None:
    shared, tail_a, tail_b = s.tokens(1), s.tokens(2), s.tokens(1)
    first, _ = s.insert(shared + tail_a)
    second, slot_b = s.insert(shared + tail_b)
    parent = first.node.parent
    assert parent is second.node.parent and not parent.is_root
    assert parent.state_slot is None and len(parent.key) == len(shared)  # the tombstone
    assert second.num_new_tokens == len(tail_b)
    match = s.tree.match_prefix(shared + s.tokens(1))
    assert match.prefix_len == 0 and match.node is s.tree.root and match.state_slot == 0
    assert match.kv_match_len == len(shared)  # the KV is there, the state is not
    assert s.tree.match_prefix(shared + tail_b).state_slot == slot_b


def test_inserting_at_a_tombstone_revives_it(s: Setup) -> None:
    shared = s.tokens(1)
    first, _ = s.insert(shared + s.tokens(2))
    s.insert(shared + s.tokens(1))
    tombstone = first.node.parent
    kv_before = tombstone.value.copy()
    revived, slot = s.insert(shared)
    assert revived.state_taken and revived.node is tombstone and revived.num_new_tokens == 0
    assert tombstone.state_slot == slot and np.array_equal(tombstone.value, kv_before)
    match = s.tree.match_prefix(shared + s.tokens(1))
    assert match.state_slot == slot and match.prefix_len == len(shared)


def test_insert_ending_inside_an_edge_splits_and_takes_the_state(s: Setup) -> None:
    key = s.tokens(3)
    first, slot_long = s.insert(key)
    short, slot_short = s.insert(key[: 2 * s.page_size])
    assert short.state_taken and short.node.state_slot == slot_short
    assert first.node.parent is short.node and first.node.state_slot == slot_long
    assert s.tree.match_prefix(key[: 2 * s.page_size] + s.tokens(1)).state_slot == slot_short


def test_insert_at_an_existing_state_does_not_take_the_slot(s: Setup) -> None:
    key = s.tokens(2)
    first, slot = s.insert(key)
    free_pages = s.kv.num_free_pages
    other_slot = s.slots.alloc(1)[0]
    again = s.tree.insert(key, s.fresh_kv(len(key)), other_slot)
    assert not again.state_taken and again.node is first.node and again.num_new_tokens == 0
    assert first.node.state_slot == slot
    assert s.kv.num_free_pages == free_pages  # the duplicate pages went straight back
    s.slots.free([other_slot])


def test_deepest_state_match_truncates_the_kv(s: Setup) -> None:
    prefix, rest = s.tokens(1), s.tokens(3)
    near, slot_near = s.insert(prefix)
    s.insert(prefix + rest)
    s.insert(prefix + rest[: 2 * s.page_size] + s.tokens(1))  # tombstone at 3 pages
    match = s.tree.match_prefix(prefix + rest[: 2 * s.page_size] + s.tokens(1))
    assert match.node is near.node and match.state_slot == slot_near
    assert match.prefix_len == len(prefix) and np.array_equal(match.kv_indices, near.node.value)
    assert match.kv_match_len == 3 * s.page_size


def test_duplicate_kv_is_freed_and_shared_kv_kept(s: Setup) -> None:
    key = s.tokens(4)
    s.insert(key[: 2 * s.page_size])
    matched = s.tree.match_prefix(key)
    own_tail = s.fresh_kv(2 * s.page_size)
    dup_head = s.fresh_kv(2 * s.page_size)
    # one request reused the cached KV, another recomputed the whole prefix itself
    reuse, _ = s.insert(key, np.concatenate([matched.kv_indices, own_tail]))
    assert reuse.num_new_tokens == 2 * s.page_size
    assert s.kv.is_allocated(s.kv.token_indices_to_pages(own_tail)).all()
    assert s.kv.is_allocated(s.kv.token_indices_to_pages(matched.kv_indices)).all()
    recompute_kv = np.concatenate([dup_head, s.fresh_kv(2 * s.page_size)])
    recompute, _ = s.insert(key, recompute_kv)
    assert recompute.num_new_tokens == 0 and not recompute.state_taken
    assert not s.kv.is_allocated(s.kv.token_indices_to_pages(recompute_kv)).any()
    full = s.tree.match_prefix(key)
    assert np.array_equal(full.kv_indices, np.concatenate([matched.kv_indices, own_tail]))


def test_locks_block_eviction_until_released(s: Setup) -> None:
    base = s.tokens(1)
    parent, _ = s.insert(base)
    child, child_slot = s.insert(base + s.tokens(2))
    other, _ = s.insert(s.tokens(1))
    node = s.tree.match_prefix(base + child.node.key.tolist()).node
    assert node is child.node
    s.tree.inc_lock(node)
    assert (child.node.kv_lock, child.node.state_lock) == (1, 1)
    assert (parent.node.kv_lock, parent.node.state_lock) == (1, 0)
    assert s.tree.num_evictable_kv_tokens == s.page_size and s.tree.num_evictable_slots == 2
    assert s.tree.evict_kv(10**6) == s.page_size  # only the other branch
    assert s.tree.evict_state(10**6) == 1  # the unlocked parent state -> tombstone
    assert parent.node.state_slot is None and s.tree.num_cached_tokens == 3 * s.page_size
    assert s.tree.match_prefix(base + child.node.key.tolist()).state_slot == child_slot
    s.check()
    s.tree.dec_lock(node)
    assert child.node.kv_lock == parent.node.kv_lock == 0
    assert s.tree.num_evictable_kv_tokens == 3 * s.page_size
    assert s.tree.evict_kv(1) == 3 * s.page_size  # the leaf, then its tombstone parent
    assert s.tree.num_cached_tokens == 0 and s.kv.num_free_pages == s.kv.num_pages
    with pytest.raises(ValueError, match="not locked"):
        s.tree.dec_lock(node)


def test_split_of_a_locked_edge_keeps_lock_counts(s: Setup) -> None:
    key = s.tokens(3)
    leaf, _ = s.insert(key)
    s.tree.inc_lock(leaf.node)
    s.insert(key[: s.page_size] + s.tokens(1))  # splits the locked edge
    upper = leaf.node.parent
    assert upper.kv_lock == 1 and upper.state_lock == 0 and upper.state_slot is None
    assert s.tree.num_evictable_kv_tokens == s.page_size  # just the new sibling
    s.check()
    s.tree.dec_lock(leaf.node)
    assert upper.kv_lock == 0 and s.tree.num_evictable_kv_tokens == 4 * s.page_size


def test_lock_of_a_tombstone_is_rejected() -> None:
    s = Setup(1)
    shared = s.tokens(1)
    first, _ = s.insert(shared + s.tokens(1))
    s.insert(shared + s.tokens(1))
    with pytest.raises(ValueError, match="tombstone"):
        s.tree.inc_lock(first.node.parent)


def test_evict_state_tombstones_internal_nodes_and_deletes_leaves(s: Setup) -> None:
    shared = s.tokens(1)
    internal, internal_slot = s.insert(shared)
    s.insert(shared + s.tokens(1))
    assert s.tree.evict_state(1) == 1  # the oldest state: the internal node
    assert internal.node.state_slot is None and s.tree.num_cached_tokens == 2 * s.page_size
    assert not s.slots.is_allocated([internal_slot])[0]
    s.check()
    lone, _ = s.insert(s.tokens(2))
    assert s.tree.evict_state(1) == 1  # the leaf under the tombstone: deleted, tombstone too
    assert s.tree.num_cached_tokens == 2 * s.page_size and s.tree.num_cached_slots == 1
    assert s.tree.match_prefix(lone.node.key.tolist()).node is lone.node
    assert s.tree.match_prefix(shared).kv_match_len == 0  # the tombstone went with its leaf


def test_match_touches_only_the_returned_node_in_the_state_lru(s: Setup) -> None:
    base = s.tokens(1)
    upper, _ = s.insert(base)
    lower, _ = s.insert(base + s.tokens(1))
    other, _ = s.insert(s.tokens(1))
    s.tree.match_prefix(base + lower.node.key.tolist())  # walks through `upper`
    # state LRU is now upper, other, lower: `upper` was not refreshed
    assert s.tree.evict_state(1) == 1
    assert upper.node.state_slot is None and other.node.state_slot is not None
    # the KV LRU did refresh the whole path: evict_kv takes `other` first
    assert s.tree.evict_kv(1) == s.page_size
    assert s.tree.match_prefix(other.node.key.tolist()).prefix_len == 0
    assert s.tree.match_prefix(base + lower.node.key.tolist()).node is lower.node


def test_evict_kv_takes_the_least_recently_used_leaf(s: Setup) -> None:
    first, _ = s.insert(s.tokens(2))
    second, _ = s.insert(s.tokens(1))
    s.tree.match_prefix(first.node.key.tolist())
    assert s.tree.evict_kv(s.page_size) == s.page_size
    assert s.tree.match_prefix(second.node.key.tolist()).prefix_len == 0
    assert s.tree.match_prefix(first.node.key.tolist()).prefix_len == 2 * s.page_size


def test_match_is_page_granular(s: Setup) -> None:
    key = s.tokens(3)
    s.insert(key[: s.page_size])
    s.insert(key)
    changed = list(key)
    changed[3 * s.page_size - 1] += 1  # differ in the last token of the last page
    num_nodes = len(list(s.tree.iter_nodes()))
    match = s.tree.match_prefix(changed)
    assert match.prefix_len == s.page_size and match.kv_match_len == 2 * s.page_size
    assert len(list(s.tree.iter_nodes())) == num_nodes  # a match ending mid-edge splits nothing
    assert s.tree.match_prefix(key[: 3 * s.page_size - 1]).prefix_len == s.page_size
    assert s.tree.match_prefix(key).prefix_len == 3 * s.page_size


def test_stats_count_queried_and_matched_tokens() -> None:
    s = Setup(4)
    key = s.tokens(2)
    s.insert(key)
    s.tree.match_prefix(key + [1, 2, 3])
    s.tree.match_prefix(s.tokens(1))
    stats = s.tree.stats
    assert (stats.num_queries, stats.num_queried_tokens, stats.num_matched_tokens) == (2, 15, 8)
    assert stats.hit_rate == pytest.approx(8 / 15)


def test_flush_frees_everything_and_refuses_while_locked(s: Setup) -> None:
    shared = s.tokens(1)
    s.insert(shared + s.tokens(2))
    held, _ = s.insert(shared + s.tokens(1))
    s.tree.inc_lock(held.node)
    with pytest.raises(ValueError, match="locked"):
        s.tree.flush()
    assert s.tree.num_cached_tokens == 4 * s.page_size
    s.tree.dec_lock(held.node)
    s.tree.flush()
    assert s.tree.num_cached_tokens == 0 and s.tree.num_cached_slots == 0
    assert s.kv.num_free_pages == s.kv.num_pages and s.slots.num_free == s.slots.num_slots
    assert s.tree.match_prefix(shared).prefix_len == 0


def test_disabled_cache_matches_nothing_and_frees_inserted_kv() -> None:
    s = Setup(2, disable=True)
    key = s.tokens(3)
    result, slot = s.insert(key)
    assert not result.state_taken and result.num_new_tokens == 0
    assert s.kv.num_free_pages == s.kv.num_pages and s.slots.num_free == s.slots.num_slots
    match = s.tree.match_prefix(key)
    assert match.prefix_len == 0 and match.state_slot == 0 and len(match.kv_indices) == 0
    assert s.tree.stats.num_queried_tokens == len(key)
    s.check()


def test_insert_validates_its_input_and_changes_nothing_on_error() -> None:
    s = Setup(4)
    key = s.tokens(2)
    kv = s.fresh_kv(len(key))
    with pytest.raises(ValueError, match="multiple of page_size"):
        s.tree.insert(key[:6], kv[:6], 1)
    with pytest.raises(ValueError, match="KV indices"):
        s.tree.insert(key, kv[:4], 1)
    with pytest.raises(ValueError, match="page-aligned"):
        s.tree.insert(key, kv[::-1], 1)
    with pytest.raises(ValueError, match="out of range"):
        s.tree.insert(key, kv, s.slots.num_slots + 1)
    with pytest.raises(ValueError, match="needs a state slot"):
        s.tree.insert(key, kv, None)
    assert s.tree.num_cached_tokens == 0 and s.kv.num_free_pages == s.kv.num_pages - 2
    s.tree.insert(key, kv, s.slots.alloc(1)[0])
    again = s.tree.insert(key[:4], s.fresh_kv(4), None)  # no new tokens: no state needed
    assert not again.state_taken and again.node.state_slot is None  # a split tombstone
    s.check()


def test_empty_key_and_null_page_inserts_change_nothing() -> None:
    s = Setup(2)
    slot = s.slots.alloc(1)[0]
    empty = s.tree.insert([], np.zeros(0, np.int32), slot)
    assert empty.node is s.tree.root and not empty.state_taken and empty.num_new_tokens == 0
    key = s.tokens(2)
    cached, _ = s.insert(key)
    with pytest.raises(ValueError, match="null page"):
        s.tree.insert(key + s.tokens(1), np.concatenate([cached.node.value, [0, 1]]), slot)
    assert s.tree.num_cached_tokens == len(key) and cached.node.is_leaf
    s.slots.free([slot])
    s.check()


def test_check_integrity_detects_broken_invariants() -> None:
    s = Setup(1)
    result, slot = s.insert(s.tokens(2))
    result.node.kv_lock = 1
    with pytest.raises(AssertionError, match="kv_lock"):
        s.tree.check_integrity()
    result.node.kv_lock = 0
    s.slots.free([slot])  # freed behind the tree's back
    with pytest.raises(AssertionError, match="free in the allocator"):
        s.tree.check_integrity()
    s.slots.alloc(1)
    s.tree._state_lru.clear()
    with pytest.raises(AssertionError, match="state LRU"):
        s.tree.check_integrity()


def test_lock_cost_is_what_inc_lock_takes_from_the_evictable_counts(s: Setup) -> None:
    base = s.tokens(1)
    parent, _ = s.insert(base)
    child, _ = s.insert(base + s.tokens(2))
    sibling, _ = s.insert(base + s.tokens(3))
    assert s.tree.lock_cost(s.tree.root) == (0, 0)
    for node in (child.node, sibling.node, parent.node, child.node):
        before = (s.tree.num_evictable_slots, s.tree.num_evictable_kv_tokens)
        cost = s.tree.lock_cost(node)
        assert s.tree.lock_cost(node) == cost  # a query: asking twice changes nothing
        s.tree.inc_lock(node)
        after = (s.tree.num_evictable_slots, s.tree.num_evictable_kv_tokens)
        assert cost == (before[0] - after[0], before[1] - after[1])
    # the first lock of the child took its state and its whole path; the second took nothing
    assert s.tree.lock_cost(child.node) == (0, 0)
