"""The radix cache's host tier (cache/host_tier.py, cache/tree_tiers.py), host-only.

A simulated pair of memories stands in for the device and host pools: every KV page and
state slot holds a label (the token prefix it belongs to), written when a request's KV is
inserted and moved only by the ``Transfer`` records the tree queues, run in their order (a
load after a store whose host write is still pending waits for it, as the runner does) and
completed later, as the engine completes them. After every operation the ids on both tiers
partition (``check_all``) and every id the tree holds carries its node's label: what a load
brings back is what was stored.
"""

from __future__ import annotations

import numpy as np
import pytest

from lazyspec.cache.allocators import KVAllocator, SlotAllocator, check_all
from lazyspec.cache.host_tier import (
    LOAD,
    STORE,
    WRITE_BACK,
    WRITE_POLICIES,
    WRITE_THROUGH,
    WRITE_THROUGH_SELECTIVE,
    HostTier,
    Transfer,
)
from lazyspec.cache.radix_cache import RadixCache, TreeNode


class Memories:
    """Labels in the device and host pools, moved by transfers."""

    def __init__(self) -> None:
        self.device_kv: dict[int, tuple] = {}
        self.device_state: dict[int, tuple] = {}
        self.host_kv: dict[int, tuple] = {}
        self.host_state: dict[int, tuple] = {}
        self.pending: list[tuple[Transfer, list, tuple | None]] = []  # stores not landed

    def run(self, transfers: list[Transfer]) -> None:
        for t in transfers:
            if t.kind == STORE:
                pages = [self.device_kv[int(p)] for p in t.device_pages]
                state = self.device_state[t.device_slot] if t.device_slot else None
                self.pending.append((t, pages, state))
                continue
            assert t.kind == LOAD
            if self._reads_pending(t):
                self.land()
            for d, h in zip(t.device_pages, t.host_pages):
                self.device_kv[int(d)] = self.host_kv[int(h)]
            if t.device_slot:
                self.device_state[t.device_slot] = self.host_state[t.host_slot]

    def _reads_pending(self, load: Transfer) -> bool:
        sources = set(load.host_pages.tolist())
        for store, _, _ in self.pending:
            if sources & set(store.host_pages.tolist()):
                return True
            if load.device_slot and store.device_slot and store.host_slot == load.host_slot:
                return True
        return False

    def land(self) -> None:
        for t, pages, state in self.pending:
            for h, label in zip(t.host_pages, pages):
                self.host_kv[int(h)] = label
            if state is not None:
                self.host_state[t.host_slot] = state
        self.pending = []


class Setup:
    def __init__(
        self,
        policy: str,
        page_size: int = 1,
        pages: int = 16,
        slots: int = 6,
        host_pages: int = 24,
        host_slots: int = 8,
        eviction: str = "sglang",
    ) -> None:
        self.ps = page_size
        self.kv, self.slots = KVAllocator(pages, page_size), SlotAllocator(slots)
        self.host = HostTier(KVAllocator(host_pages, page_size), SlotAllocator(host_slots), policy)
        self.tree = RadixCache(page_size, self.kv, self.slots, eviction=eviction, host=self.host)
        self.mem = Memories()
        self.taken: list[Transfer] = []
        self.locks: list[TreeNode] = []

    # ---- operations ---------------------------------------------------------------

    def insert(self, key: list[int]) -> bool:
        """Insert ``key`` as a finishing request: fresh KV and slot (evicting for them),
        labelled with their prefixes; False if no room."""
        if self.slots.num_free == 0:
            self.tree.evict_state(1)
        need = len(key) // self.ps - self.kv.num_free_pages
        if need > 0:
            self.tree.evict_kv(need * self.ps)
        self.issue()  # the copies read the evicted ids before a request writes them
        pages = self.kv.alloc_pages(len(key) // self.ps)
        got = self.slots.alloc(1)
        if pages is None or got is None:
            self.kv.free_pages([] if pages is None else pages)
            self.slots.free(got or [])
            return False
        for i, page in enumerate(pages.tolist()):
            self.mem.device_kv[page] = tuple(key[: (i + 1) * self.ps])
        self.mem.device_state[got[0]] = tuple(key)
        rows = self.kv.pages_to_token_indices(pages)
        if not self.tree.insert(key, rows, got[0]).state_taken:
            self.slots.free(got)
        self.issue()
        return True

    def admit(self, query: list[int]):
        """Match, lock, make room and load as ``RequestCache.reserve``; None if no room."""
        match = self.tree.match_prefix(query)
        lock_slots, lock_tokens = self.tree.lock_cost(match.node)
        need_slots, need_pages = int(match.load_state), match.load_tokens // self.ps
        slots = self.slots.num_free + self.tree.num_evictable_slots - lock_slots
        tokens = self.tree.num_evictable_kv_tokens - lock_tokens
        pages = self.kv.num_free_pages + tokens // self.ps
        if slots < need_slots or pages < need_pages:
            return None
        self.tree.inc_lock(match.node)
        if self.slots.num_free < need_slots:
            self.tree.evict_state(need_slots - self.slots.num_free)
        if self.kv.num_free_pages < need_pages:
            self.tree.evict_kv((need_pages - self.kv.num_free_pages) * self.ps)
        loaded = self.tree.load(match)
        assert loaded.prefix_len == match.prefix_len == len(loaded.kv_indices)
        assert not loaded.needs_load and (loaded.state_slot or match.prefix_len == 0)
        self.locks.append(match.node)
        self.issue()
        for i, page in enumerate(self.kv.token_indices_to_pages(loaded.kv_indices).tolist()):
            assert self.mem.device_kv[page] == tuple(query[: (i + 1) * self.ps])
        if loaded.state_slot:
            assert self.mem.device_state[loaded.state_slot] == tuple(query[: loaded.prefix_len])
        return loaded

    def issue(self) -> None:
        transfers = self.host.take()
        self.mem.run(transfers)
        self.taken += transfers

    def complete(self) -> None:
        self.mem.land()
        self.host.complete(self.taken)
        self.taken = []

    def unlock_all(self) -> None:
        for node in self.locks:
            self.tree.dec_lock(node)
        self.locks = []

    # ---- checks -------------------------------------------------------------------

    def check(self) -> None:
        check_all(self.kv, self.slots, self.tree, [], [])
        for node in self.tree.iter_nodes():
            prefix = _prefix(node)
            start = len(prefix) - len(node.key)
            labels = [prefix[: start + i + self.ps] for i in range(0, len(node.key), self.ps)]
            if node.on_device:
                pages = self.kv.token_indices_to_pages(node.value).tolist()
                assert [self.mem.device_kv[p] for p in pages] == labels, node.node_id
            if node.state_slot is not None:
                assert self.mem.device_state[node.state_slot] == prefix
            if self.host.is_busy(node) or self.mem.pending:
                continue
            if node.on_host:
                pages = self.host.kv.token_indices_to_pages(node.host_value).tolist()
                assert [self.mem.host_kv[p] for p in pages] == labels, node.node_id
            if node.host_slot is not None:
                assert self.mem.host_state[node.host_slot] == prefix

    def flush_and_check_empty(self) -> None:
        self.unlock_all()
        self.complete()
        self.tree.flush()
        self.check()
        assert self.kv.num_free_pages == self.kv.num_pages
        assert self.slots.num_free == self.slots.num_slots
        assert self.host.kv.num_free_pages == self.host.kv.num_pages
        assert self.host.slots.num_free == self.host.slots.num_slots


def _prefix(node: TreeNode) -> tuple:
    keys = []
    while not node.is_root:
        keys.append(node.key.tolist())
        node = node.parent
    return tuple(t for key in reversed(keys) for t in key)


def test_write_back_keeps_an_evicted_conversation_on_the_host_and_loads_it_exact():
    s = Setup(WRITE_BACK)
    first = [1, 2, 3, 4, 5, 6]
    assert s.insert(first)
    assert not s.host.take() and s.host.stats.num_stored_tokens == 0  # nothing copied yet
    assert s.tree.evict_kv(6) == 6  # the device evicts: write_back copies it first
    s.issue()
    (node,) = s.tree.iter_nodes()
    assert not node.on_device and node.on_host and node.host_slot is not None
    assert s.host.stats.num_stored_tokens == 6 and s.host.stats.num_stored_states == 1
    s.check()
    match = s.tree.match_prefix(first + [7, 8])
    assert (match.prefix_len, match.load_tokens, match.load_state) == (6, 6, True)
    assert len(match.kv_indices) == 0 and match.state_slot == 0
    loaded = s.admit(first + [7, 8])  # checks the loaded labels (the store landed first)
    assert loaded.prefix_len == 6 and node.on_device and node.on_host
    assert s.host.stats.num_host_hits == 1 and s.host.stats.num_loaded_tokens == 6
    s.complete()
    s.check()
    s.flush_and_check_empty()


def test_write_through_copies_at_insert_and_eviction_only_drops_the_device_copy():
    s = Setup(WRITE_THROUGH)
    assert s.insert([1, 2, 3, 4])
    (node,) = s.tree.iter_nodes()
    assert node.on_host and node.host_slot is not None and s.host.is_busy(node)
    s.complete()
    assert not s.host.is_busy(node)
    assert s.tree.evict_state(1) == 1  # the state stays on the host; the node keeps its KV
    assert node.on_device and node.state_slot is None and node.has_state
    assert s.tree.evict_kv(4) == 4 and not s.host.take()  # nothing more to copy
    assert not node.on_device and node.on_host
    s.check()
    s.admit([1, 2, 3, 4, 9])
    s.complete()
    s.check()
    s.flush_and_check_empty()


def test_write_through_selective_copies_a_node_at_its_second_hit():
    s = Setup(WRITE_THROUGH_SELECTIVE)
    assert s.insert([1, 2, 3])
    (node,) = s.tree.iter_nodes()
    assert not node.on_host and node.hit_count == 1
    s.admit([1, 2, 3, 4])
    assert node.on_host and node.hit_count == 2 and s.host.stats.num_stored_states == 1
    s.unlock_all()
    s.complete()
    assert s.insert([7, 7])
    (other,) = [n for n in s.tree.iter_nodes() if n is not node]
    assert s.tree.evict_kv(100) == 5  # the node hit once is not kept: deleted
    assert node.on_host and not node.on_device and other.node_id not in s.tree._kv_lru
    assert len(list(s.tree.iter_nodes())) == 1
    s.check()
    s.flush_and_check_empty()


def test_the_host_lru_evicts_neither_busy_nor_locked_only_copies():
    s = Setup(WRITE_BACK, pages=8, slots=4, host_pages=4, host_slots=2)
    assert s.insert([1, 2, 3, 4])
    s.tree.evict_kv(4)  # to the host: 4 host pages, 1 host slot, its store in flight
    s.issue()
    (old,) = s.tree.iter_nodes()
    assert s.host.is_busy(old)
    assert s.insert([5, 6, 7, 8])
    s.tree.evict_kv(4)  # the host is full and its only node is busy: deleted instead
    s.issue()
    assert [n.node_id for n in s.tree.iter_nodes()] == [old.node_id]
    s.complete()
    s.check()
    match = s.tree.match_prefix([1, 2, 3, 4])
    s.tree.inc_lock(match.node)  # locked while only on the host: host eviction skips it
    assert not s.tree.evict_host(1, 4)
    assert old.on_host
    s.tree.dec_lock(match.node)
    assert s.tree.evict_host(1, 4)  # unlocked and idle: its host copy goes, and the node
    assert list(s.tree.iter_nodes()) == []
    s.check()
    s.flush_and_check_empty()


def test_a_locked_node_keeps_the_host_copy_of_its_only_state():
    s = Setup(WRITE_THROUGH, host_slots=1)
    assert s.insert([1, 2, 3, 4])
    s.complete()
    assert s.tree.evict_state(1) == 1  # the device keeps the KV, the host the state
    (node,) = s.tree.iter_nodes()
    match = s.tree.match_prefix([1, 2, 3, 4, 5])
    assert match.load_state and match.load_tokens == 0 and match.node is node
    s.tree.inc_lock(node)
    assert not s.tree.evict_host(1, 0) and node.host_slot is not None
    s.tree.dec_lock(node)
    assert s.tree.evict_host(1, 0)  # now a tombstone leaf: deleted, device KV and all
    assert list(s.tree.iter_nodes()) == [] and s.kv.num_free_pages == s.kv.num_pages
    s.check()


def test_a_deleted_busy_node_holds_its_host_ids_until_its_copy_completes():
    s = Setup(WRITE_THROUGH)
    assert s.insert([1, 2])
    s.tree.evict_state(1)  # internal? no: a leaf kept on the host (write_through copied it)
    (node,) = s.tree.iter_nodes()
    assert s.host.is_busy(node) and node.on_host
    s.tree.flush()  # the copy is in flight: its ids are orphaned, not freed
    assert s.host.orphaned_slot_ids() and len(s.host.orphaned_pages()) == 2
    check_all(s.kv, s.slots, s.tree, [], [])
    s.complete()
    assert not s.host.orphaned_slot_ids() and s.host.slots.num_free == s.host.slots.num_slots
    s.check()


@pytest.mark.parametrize("policy", WRITE_POLICIES)
@pytest.mark.parametrize("page_size,eviction", [(1, "sglang"), (2, "value")])
def test_random_operations_keep_both_tiers_exact(policy, page_size, eviction):
    """Inserts, admissions (lock, evict, load), evictions, completions and unlocks in a
    random order, on pools small enough that both tiers evict; the labels and the
    partition hold after each."""
    rng = np.random.default_rng(10 * WRITE_POLICIES.index(policy) + page_size)
    s = Setup(policy, page_size, pages=12, slots=5, host_pages=20, host_slots=6, eviction=eviction)
    stems = [[int(t) for t in rng.integers(0, 3, size=3 * page_size)] for _ in range(4)]
    inserted: list[list[int]] = [stems[0]]
    for _ in range(300):
        stem = stems[int(rng.integers(len(stems)))]
        tail = [int(t) for t in rng.integers(0, 3, size=int(rng.integers(1, 3)) * page_size)]
        op = rng.random()
        if op < 0.35 and s.insert(stem + tail):
            inserted.append(stem + tail)
        elif 0.35 <= op < 0.6 and len(s.locks) < 3:  # mostly a conversation that returns
            s.admit(inserted[int(rng.integers(len(inserted)))] + tail)
        elif 0.6 <= op < 0.7:
            s.tree.evict_kv(int(rng.integers(1, 8)))
            s.issue()
        elif 0.7 <= op < 0.8:
            s.tree.evict_state(int(rng.integers(1, 3)))
            s.issue()
        elif 0.8 <= op < 0.9:
            s.complete()
        elif op >= 0.9:
            s.unlock_all()
        s.check()
    stats = s.host.stats
    assert stats.num_stored_tokens and stats.num_host_hits  # not vacuous
    if policy != WRITE_THROUGH_SELECTIVE:
        assert stats.num_host_evictions
    s.flush_and_check_empty()


@pytest.mark.parametrize("eviction", ["sglang", "value"])
def test_the_host_evicts_by_the_checkpoint_eviction_policy(eviction):
    """The host's two states: the older one saves eight tokens (worth 8 x 1/2), the newer
    two (worth 2 x 1): "sglang" drops the least recent host copy, "value" the one worth
    least, as the device ranks its states."""
    s = Setup(WRITE_THROUGH, pages=16, slots=4, host_slots=2, eviction=eviction)
    assert s.insert([1, 2, 3, 4, 5, 6, 7, 8]) and s.insert([20, 21])
    s.complete()
    older, newer = sorted(s.tree.iter_nodes(), key=lambda node: node.node_id)
    assert older.host_slot is not None and newer.host_slot is not None
    assert s.tree.evict_host(1, 0)
    dropped, kept = (older, newer) if eviction == "sglang" else (newer, older)
    assert dropped.host_slot is None and not dropped.on_host and dropped.on_device
    assert kept.host_slot is not None and kept.on_host
    assert s.host.stats.num_host_evictions == 1
    s.check()
    s.flush_and_check_empty()
