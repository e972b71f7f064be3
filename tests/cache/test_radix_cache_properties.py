"""Random operation sequences on RadixCache checked against a dictionary model.

The model keeps ``states``: inserted prefix -> slot (prefixes still holding a state), their
state-LRU order, ``pages``: token prefix through a page -> the page the tree holds for it,
the locks taken, and the pages / slots held outside the tree. After every operation the tree
must agree with the model exactly (states, pages, evictable counts), pass ``check_integrity``,
and account for every page and slot (free + cached + held == total). Matches must return the
longest cached state prefix with its KV; ``evict_state`` must take exactly the least recently
used unlocked states; ``evict_kv`` may only remove unlocked entries and frees what it reports.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lazyspec.cache.allocators import KVAllocator, SlotAllocator
from lazyspec.cache.radix_cache import RadixCache, TreeNode, check_all

NUM_PAGES, NUM_SLOTS = 24, 8

# Page patterns that share leading tokens, so mismatches land inside pages too.
PATTERNS = {
    1: ([0], [1], [2]),
    2: ([0, 0], [0, 1], [1, 0]),
    4: ([0, 0, 0, 0], [0, 0, 0, 1], [1, 0, 0, 0]),
}

# An operation: (kind, pages, flag, number); kinds by share of draws, inserts most often
# because they build the trees the other operations need.
KINDS = [
    ("insert", 40),
    ("match", 12),
    ("lock", 10),
    ("unlock", 12),
    ("evict_kv", 7),
    ("evict_state", 7),
    ("hold", 5),
    ("release", 5),
    ("flush", 2),
]
KIND_OF_DRAW = [name for name, share in KINDS for _ in range(share)]
operations = st.tuples(
    st.integers(0, len(KIND_OF_DRAW) - 1).map(KIND_OF_DRAW.__getitem__),
    st.lists(st.integers(0, 2), max_size=4),
    st.booleans(),
    st.integers(0, 7),
)


def tree_view(tree: RadixCache) -> tuple[dict[tuple, int], dict[tuple, int]]:
    """(prefix -> slot for every state, prefix through each page -> page id) from a walk."""
    states: dict[tuple, int] = {}
    pages: dict[tuple, int] = {}
    ps = tree.page_size
    stack: list[tuple[TreeNode, tuple]] = [(c, ()) for c in tree.root.children.values()]
    while stack:
        node, above = stack.pop()
        prefix = above + tuple(node.key.tolist())
        for i in range(0, len(node.key), ps):
            pages[above + tuple(node.key[: i + ps].tolist())] = int(node.value[i]) // ps
        if node.has_state:
            states[prefix] = node.state_slot
        stack.extend((c, prefix) for c in node.children.values())
    return states, pages


class Model:
    def __init__(self, page_size: int) -> None:
        self.ps = page_size
        self.kv = KVAllocator(NUM_PAGES, page_size)
        self.slots = SlotAllocator(NUM_SLOTS)
        self.tree = RadixCache(page_size, self.kv, self.slots)
        self.states: dict[tuple, int] = {}
        self.state_order: list[tuple] = []  # least recently used first
        self.pages: dict[tuple, int] = {}
        self.locks: list[tuple[TreeNode, tuple]] = []
        self.held_pages: list[int] = []
        self.held_slots: list[int] = []

    def tokens(self, page_ids: list[int]) -> list[int]:
        return [t for p in page_ids for t in PATTERNS[self.ps][p]]

    def query(self, page_ids: list[int], from_cache: bool, number: int) -> list[int]:
        """Random pages, or (``from_cache``) a cached state's key followed by them, so that
        matches often end at a state below other states."""
        if not from_cache or not self.states:
            return self.tokens(page_ids)
        return list(sorted(self.states)[number % len(self.states)]) + self.tokens(page_ids)

    # ---- checked operations ---------------------------------------------------------

    def match(self, query: list[int]):
        aligned = tuple(query[: len(query) // self.ps * self.ps])
        best = max((k for k in self.states if aligned[: len(k)] == k), key=len, default=())
        result = self.tree.match_prefix(query)
        assert result.prefix_len == len(best) == len(result.kv_indices)
        assert result.state_slot == self.states.get(best, 0)
        expected_pages = [self.pages[best[: i + self.ps]] for i in range(0, len(best), self.ps)]
        assert np.array_equal(result.kv_indices, self.kv.pages_to_token_indices(expected_pages))
        cached = [i for i in range(self.ps, len(aligned) + 1, self.ps) if aligned[:i] in self.pages]
        assert result.kv_match_len == max(cached, default=0)
        if best:
            self.state_order.remove(best)
            self.state_order.append(best)
        return result

    def insert(self, key: list[int], reuse: bool, with_state: bool) -> None:
        """Insert ``key`` like a finishing request: make room first (evictions are checked
        too), then reuse the matched KV or recompute it all, with a fresh slot or None."""
        slot = None
        if with_state:
            if self.slots.num_free == 0:
                self.evict_state(1)
            slot = (self.slots.alloc(1) or [None])[0]
        if self.kv.num_free_pages < len(key) // self.ps:
            self.evict_kv(len(key) - self.ps * self.kv.num_free_pages)
        prefix_kv = self.match(key).kv_indices if reuse else np.zeros(0, dtype=np.int32)
        fresh = self.kv.alloc_pages((len(key) - len(prefix_kv)) // self.ps)
        if fresh is None:  # what is left is locked
            self.slots.free([] if slot is None else [slot])
            return
        kv = np.concatenate([prefix_kv, self.kv.pages_to_token_indices(fresh)]).astype(np.int32)
        given_pages = kv.reshape(-1, self.ps)[:, 0] // self.ps
        prefixes = [tuple(key[: i + self.ps]) for i in range(0, len(key), self.ps)]
        known = [p in self.pages for p in prefixes]
        if slot is None and not all(known):
            with pytest.raises(ValueError, match="needs a state slot"):
                self.tree.insert(key, kv, None)
            self.kv.free_pages(fresh)
            return
        result = self.tree.insert(key, kv, slot)
        assert result.num_new_tokens == self.ps * known.count(False)
        expect_taken = slot is not None and len(key) > 0 and tuple(key) not in self.states
        assert result.state_taken == expect_taken
        assert len(key) == 0 or result.node.has_state == (expect_taken or tuple(key) in self.states)
        for prefix, page, was_known in zip(prefixes, given_pages.tolist(), known):
            if not was_known:
                self.pages[prefix] = page
            elif self.pages[prefix] != page:
                assert not self.kv.is_allocated([page])[0], f"duplicate page {page} not freed"
        if expect_taken:
            self.states[tuple(key)] = slot
            self.state_order.append(tuple(key))
        elif slot is not None:
            self.slots.free([slot])

    def locked_keys(self) -> set[tuple]:
        return {key for _, key in self.locks if key}

    def evict_state(self, num_slots: int) -> None:
        locked = self.locked_keys()
        expected = [k for k in self.state_order if k not in locked][:num_slots]
        assert self.tree.evict_state(num_slots) == len(expected)
        for key in expected:
            del self.states[key]
            self.state_order.remove(key)
        self.resync_pages()

    def evict_kv(self, num_tokens: int) -> None:
        evictable, before = self.tree.num_evictable_kv_tokens, self.tree.num_cached_tokens
        freed = self.tree.evict_kv(num_tokens)
        assert freed == before - self.tree.num_cached_tokens
        assert freed == evictable if evictable <= num_tokens else num_tokens <= freed <= evictable
        states, _ = tree_view(self.tree)
        assert states.items() <= self.states.items()
        assert self.locked_keys() <= states.keys(), "a locked state was evicted"
        self.states = states
        self.state_order = [k for k in self.state_order if k in states]
        self.resync_pages()

    def resync_pages(self) -> None:
        """Drop model pages the tree no longer holds (evictions only ever remove)."""
        _, pages = tree_view(self.tree)
        assert pages.items() <= self.pages.items()
        self.pages = pages

    def flush(self) -> None:
        if any(key for _, key in self.locks):
            with pytest.raises(ValueError, match="locked"):
                self.tree.flush()
            return
        self.tree.flush()
        self.states, self.state_order, self.pages = {}, [], {}

    def run(self, op: tuple) -> None:
        name, page_ids, flag, number = op
        if name == "insert":
            self.insert(self.tokens(page_ids), reuse=flag, with_state=number > 0)
        elif name == "match":
            self.match(self.query(page_ids, flag, number) + [7] * min(number, self.ps - 1))
        elif name == "lock":
            query = self.query(page_ids, flag, number)
            result = self.match(query)
            self.tree.inc_lock(result.node)
            self.locks.append((result.node, tuple(query[: result.prefix_len])))
        elif name == "unlock" and self.locks:
            node, _ = self.locks.pop(number % len(self.locks))
            self.tree.dec_lock(node)
        elif name == "evict_kv":
            self.evict_kv(number)
        elif name == "evict_state":
            self.evict_state(number % 3)
        elif name == "hold" and len(self.held_pages) < 4 and len(self.held_slots) < 2:
            pages = self.kv.alloc_pages(number % 3)
            self.held_pages += [] if pages is None else pages.tolist()
            self.held_slots += self.slots.alloc(int(flag)) or []
        elif name == "release":
            held = self.held_pages if flag else self.held_slots
            if held:
                value = held.pop(number % len(held))
                (self.kv.free_pages if flag else self.slots.free)([value])
        elif name == "flush":
            self.flush()

    def check(self) -> None:
        check_all(self.kv, self.slots, self.tree, self.held_slots, self.held_pages)
        states, pages = tree_view(self.tree)
        assert states == self.states and pages == self.pages
        assert sorted(self.state_order) == sorted(self.states)
        assert self.tree.num_cached_slots == len(states)
        assert self.tree.num_cached_tokens == len(pages) * self.ps
        locked = self.locked_keys()
        locked_pages = {key[: i + self.ps] for key in locked for i in range(0, len(key), self.ps)}
        assert self.tree.num_evictable_slots == len(states) - len(locked)
        assert self.tree.num_evictable_kv_tokens == (len(pages) - len(locked_pages)) * self.ps


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(page_size=st.sampled_from([1, 2, 4]), ops=st.lists(operations, min_size=20, max_size=60))
def test_random_operations_agree_with_the_model(page_size: int, ops: list[tuple]) -> None:
    model = Model(page_size)
    for op in ops:
        model.run(op)
        model.check()
    for node, _ in model.locks:
        model.tree.dec_lock(node)
    model.locks.clear()
    model.flush()
    model.kv.free_pages(model.held_pages)
    model.slots.free(model.held_slots)
    assert model.kv.num_free_pages == NUM_PAGES and model.slots.num_free == NUM_SLOTS
