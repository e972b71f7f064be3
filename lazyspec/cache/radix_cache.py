"""The mamba-aware radix prefix cache (host side, plain Python + numpy).

A node owns the KV rows of its edge tokens and at most one recurrent-state slot, valid only
for the prefix that ends exactly at the node's end. Internal nodes may be *tombstones* (KV, no
state); a leaf never is. Keys are matched a whole page at a time. Two LRU orders (KV, state)
and two lock counts per node: ``kv_lock`` covers the node and its ancestors, ``state_lock``
the node alone, so ``kv_lock >= state_lock`` everywhere.

Ownership: ``insert`` takes every KV index it is given (keeps it or frees duplicates); a state
slot is taken only when ``InsertResult.state_taken`` says so, otherwise the caller frees it.

Which state ``evict_state`` gives up is the tree's eviction policy (``EVICTION_POLICIES``):
``"sglang"`` takes the least recently used unlocked state, as SGLang's mamba radix cache does;
``"value"`` takes the one worth least (``checkpoint_value.py``: prefill tokens saved per slot
times the likelihood of a hit, checkpoints superseded on their own chain first), and a caller
may ask it to evict only states worth less than the one it wants to insert.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from lazyspec.cache.allocators import KVAllocator, SlotAllocator, check_all
from lazyspec.cache.checkpoint_value import Worth, rank_states

EVICTION_POLICIES = ("value", "sglang")

__all__ = [
    "EVICTION_POLICIES",
    "CacheStats",
    "InsertResult",
    "MatchResult",
    "RadixCache",
    "TreeNode",
    "Worth",
    "check_all",
]


@dataclass(eq=False)
class TreeNode:
    """One edge of the tree: ``key`` tokens, their KV rows ``value``, an optional state slot."""

    node_id: int
    key: np.ndarray  # int64 token ids of this edge (a whole number of pages)
    value: np.ndarray  # int32 token-level KV rows, same length as key
    parent: TreeNode | None
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    state_slot: int | None = None  # None = tombstone (or the root)
    kv_lock: int = 0
    state_lock: int = 0

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def has_state(self) -> bool:
        return self.state_slot is not None


@dataclass(frozen=True)
class MatchResult:
    kv_indices: np.ndarray  # int32 KV rows of the matched prefix (len == prefix_len)
    node: TreeNode  # deepest node on the path holding a state (root if none)
    state_slot: int  # that node's slot, 0 for the root
    prefix_len: int  # tokens covered by kv_indices and by the state
    kv_match_len: int = 0  # whole-page tokens whose KV is cached (>= prefix_len): branch point


@dataclass(frozen=True)
class InsertResult:
    node: TreeNode  # the node ending exactly at the inserted key (root for an empty key)
    state_taken: bool  # False: the caller still owns (and must free) the slot it passed
    num_new_tokens: int  # tokens newly added to the tree


@dataclass
class CacheStats:
    """Cumulative match counters for server info; they survive ``flush``."""

    num_queries: int = 0
    num_queried_tokens: int = 0
    num_matched_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_matched_tokens / max(self.num_queried_tokens, 1)


class RadixCache:
    """Radix tree over token ids whose nodes hold KV pages and recurrent-state checkpoints."""

    def __init__(
        self,
        page_size: int,
        kv_allocator: KVAllocator,
        slot_allocator: SlotAllocator,
        disable: bool = False,
        eviction: str = "sglang",
    ) -> None:
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction={eviction!r} must be one of {EVICTION_POLICIES}")
        if page_size != kv_allocator.page_size:
            raise ValueError(
                f"page_size {page_size!r} differs from the KV allocator's {kv_allocator.page_size}"
            )
        self.page_size = int(page_size)
        self.kv_allocator = kv_allocator
        self.slot_allocator = slot_allocator
        self.disable = disable
        self.eviction = eviction
        self.stats = CacheStats()
        self._reset()

    def _reset(self) -> None:
        self._next_node_id = 1
        empty_key, empty_value = np.zeros(0, np.int64), np.zeros(0, np.int32)
        self.root = TreeNode(0, empty_key, empty_value, parent=None)
        self._kv_lru: OrderedDict[int, TreeNode] = OrderedDict()  # every non-root node
        self._state_lru: OrderedDict[int, TreeNode] = OrderedDict()  # every node with a state
        self._num_cached_tokens = 0
        self._num_locked_tokens = 0  # edge tokens of nodes with kv_lock > 0
        self._num_locked_slots = 0  # states of nodes with state_lock > 0

    @property
    def num_cached_tokens(self) -> int:
        return self._num_cached_tokens

    @property
    def num_cached_slots(self) -> int:
        return len(self._state_lru)

    @property
    def num_evictable_kv_tokens(self) -> int:
        """Tokens ``evict_kv`` can free now (an unlocked node's subtree is all unlocked)."""
        return self._num_cached_tokens - self._num_locked_tokens

    @property
    def num_evictable_slots(self) -> int:
        return len(self._state_lru) - self._num_locked_slots

    # ---- match ---------------------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """The longest cached whole-page prefix of ``token_ids`` that has a state.

        Never changes the tree's shape: a state lives at a node's end, so the returned prefix
        ends at a node boundary and no split is needed. Mutates only the LRU orders (the whole
        matched path in the KV LRU, the returned node alone in the state LRU) and ``stats``.
        """
        key = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        self.stats.num_queries += 1
        self.stats.num_queried_tokens += len(key)
        if self.disable:
            return MatchResult(self.root.value.copy(), self.root, 0, 0, 0)
        path, kv_match_len, partial = self._walk(key[: len(key) // self.page_size * self.page_size])
        best_depth, best_len, depth_len = 0, 0, 0
        for depth, node in enumerate(path, start=1):
            depth_len += len(node.key)
            if node.has_state:
                best_depth, best_len = depth, depth_len
        for node in path + ([partial[0]] if partial else []):
            self._kv_lru.move_to_end(node.node_id)
        best = path[best_depth - 1] if best_depth else self.root
        if best_depth:
            self._state_lru.move_to_end(best.node_id)
        kv_indices = np.concatenate([self.root.value] + [n.value for n in path[:best_depth]])
        self.stats.num_matched_tokens += best_len
        return MatchResult(kv_indices, best, best.state_slot or 0, best_len, kv_match_len)

    def _walk(self, key: np.ndarray) -> tuple[list[TreeNode], int, tuple[TreeNode, int] | None]:
        """Read-only walk: the fully matched nodes, the tokens matched, and (node, tokens) for
        a node whose edge matched only partly (at least one page) if the walk ended inside it."""
        node, pos, path = self.root, 0, []
        while pos < len(key):
            child = node.children.get(self._page_at(key, pos))
            if child is None:
                return path, pos, None
            common = self._common_len(child.key, key[pos:])
            if common < len(child.key):
                return path, pos + common, (child, common)
            path.append(child)
            node, pos = child, pos + common
        return path, pos, None

    # ---- insert --------------------------------------------------------------------------

    def insert(
        self, token_ids: Sequence[int], kv_indices: np.ndarray, state_slot: int | None
    ) -> InsertResult:
        """Add ``token_ids`` with their KV rows and the state after the whole key.

        Takes ownership of every KV index: rows for tokens already in the tree that differ
        from the tree's are freed. ``state_slot`` is attached only if the key ends at a new
        node or a tombstone (``state_taken``); existing states keep their LRU place.
        ``state_slot=None`` is allowed only when the key adds no tokens (a new leaf must hold a
        state). A key ending inside an edge splits it; the new parent is a tombstone until
        revived by this very insert. ValueError, with nothing changed, on bad input.
        """
        key, value = self._validate_insert(token_ids, kv_indices, state_slot)
        if self.disable:
            self.kv_allocator.free_token_indices(value)
            return InsertResult(self.root, False, 0)
        path, matched, partial = self._walk(key)
        if matched < len(key) and state_slot is None:
            raise ValueError(
                f"inserting {len(key) - matched} new tokens needs a state slot, got None"
            )
        if partial is not None:
            path.append(self._split(*partial))
        self._free_duplicates(path, value[:matched])
        for node in path:
            self._kv_lru.move_to_end(node.node_id)
        end = path[-1] if path else self.root
        if matched < len(key):
            leaf = self._add_leaf(end, key[matched:], value[matched:], state_slot)
            return InsertResult(leaf, True, len(key) - matched)
        if end.is_root or end.has_state or state_slot is None:
            return InsertResult(end, False, 0)
        self._set_state(end, state_slot)  # revive a tombstone
        return InsertResult(end, True, 0)

    def _validate_insert(
        self, token_ids: Sequence[int], kv_indices: np.ndarray, state_slot: int | None
    ) -> tuple[np.ndarray, np.ndarray]:
        key = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        value = np.asarray(kv_indices).reshape(-1)
        if len(value) != len(key):
            raise ValueError(f"{len(key)} tokens but {len(value)} KV indices")
        if len(key) % self.page_size:
            raise ValueError(
                f"key length {len(key)} is not a multiple of page_size {self.page_size}"
            )
        pages = self.kv_allocator.token_indices_to_pages(value)  # whole aligned pages only
        if (pages < 1).any():
            raise ValueError("KV indices point at the null page 0")
        num_slots = self.slot_allocator.num_slots
        if state_slot is not None and not 1 <= state_slot <= num_slots:
            raise ValueError(f"state_slot {state_slot!r} is out of range 1..{num_slots}")
        return key, value.astype(np.int32)

    def _free_duplicates(self, path: list[TreeNode], given: np.ndarray) -> None:
        """Free the given pages that duplicate (differ from) the tree's pages on ``path``.
        Rows are whole aligned pages, so a page either equals the tree's or shares no row."""
        ours = np.concatenate([self.root.value] + [n.value for n in path])
        differs = (ours != given).reshape(-1, self.page_size).any(axis=1)
        if differs.any():
            self.kv_allocator.free_token_indices(given.reshape(-1, self.page_size)[differs])

    def _add_leaf(
        self, parent: TreeNode, key: np.ndarray, value: np.ndarray, slot: int
    ) -> TreeNode:
        leaf = TreeNode(self._new_id(), key.copy(), value.copy(), parent)
        parent.children[self._page_at(key, 0)] = leaf
        self._kv_lru[leaf.node_id] = leaf
        self._num_cached_tokens += len(key)
        self._set_state(leaf, slot)
        return leaf

    def _split(self, child: TreeNode, length: int) -> TreeNode:
        """Cut ``child``'s edge after ``length`` tokens; return the new tombstone parent, which
        inherits the child's kv_lock (every lock below covers it) and has no state_lock."""
        parent = child.parent
        upper = TreeNode(self._new_id(), child.key[:length], child.value[:length], parent)
        upper.kv_lock = child.kv_lock
        parent.children[self._page_at(child.key, 0)] = upper
        child.key, child.value, child.parent = child.key[length:], child.value[length:], upper
        upper.children[self._page_at(child.key, 0)] = child
        self._kv_lru[upper.node_id] = upper
        return upper

    # ---- locks ---------------------------------------------------------------------------

    def lock_cost(self, node: TreeNode) -> tuple[int, int]:
        """(states, KV tokens) that ``inc_lock(node)`` would take out of the evictable counts
        (``num_evictable_slots`` / ``num_evictable_kv_tokens``). A query: nothing changes."""
        if node.is_root:
            return 0, 0
        tokens, walk = 0, node
        while not walk.is_root:
            tokens += len(walk.key) if walk.kv_lock == 0 else 0
            walk = walk.parent
        return int(node.state_lock == 0), tokens

    def inc_lock(self, node: TreeNode) -> None:
        """Protect ``node``'s state and its path's KV from eviction (no-op on the root).
        Only state nodes can be locked: a locked tombstone could become a locked leaf."""
        if node.is_root:
            return
        if not node.has_state:
            raise ValueError(f"node {node.node_id} is a tombstone; only state nodes are locked")
        self._num_locked_slots += node.state_lock == 0
        node.state_lock += 1
        self._add_kv_lock(node, +1)

    def dec_lock(self, node: TreeNode) -> None:
        """Undo one ``inc_lock(node)``; ValueError if ``node`` holds no lock."""
        if node.is_root:
            return
        if node.state_lock < 1:
            raise ValueError(f"node {node.node_id} is not locked (state_lock {node.state_lock})")
        node.state_lock -= 1
        self._num_locked_slots -= node.state_lock == 0
        self._add_kv_lock(node, -1)

    def _add_kv_lock(self, node: TreeNode, delta: int) -> None:
        while not node.is_root:
            if (node.kv_lock == 0) != (node.kv_lock + delta == 0):
                self._num_locked_tokens += len(node.key) * delta
            node.kv_lock += delta
            node = node.parent

    # ---- eviction ------------------------------------------------------------------------

    def evict_kv(self, num_tokens: int) -> int:
        """Delete unlocked leaves in KV-LRU order, and tombstone parents left as leaves,
        until ``num_tokens`` KV tokens are freed or nothing is evictable; returns tokens freed
        (whole leaves, so possibly more than asked)."""
        if num_tokens < 0:
            raise ValueError(f"cannot evict {num_tokens!r} tokens")
        rank = {node_id: i for i, node_id in enumerate(self._kv_lru)}
        heap = [(rank[n.node_id], n) for n in self._kv_lru.values() if n.is_leaf and n.kv_lock == 0]
        heapq.heapify(heap)  # ranks are unique, so nodes themselves are never compared
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)[1]
            parent = leaf.parent
            freed += self._delete_leaf(leaf)
            pruned, survivor = self._prune_tombstones(parent)
            freed += pruned
            if not survivor.is_root and survivor.is_leaf and survivor.kv_lock == 0:
                heapq.heappush(heap, (rank[survivor.node_id], survivor))
        return freed

    def evict_state(self, num_slots: int, below: Worth | None = None) -> int:
        """Free up to ``num_slots`` unlocked states: an internal node becomes a tombstone (KV
        kept); a leaf is deleted with its KV, then any tombstone parents left as leaves.
        Returns slots freed. Which states go is the eviction policy's choice: ``"sglang"``
        takes them in state-LRU order (``below`` is ignored); ``"value"`` takes the state
        worth least, one at a time (each eviction changes what the others are worth), and
        with ``below`` only states worth less than it (possibly none)."""
        if num_slots < 0:
            raise ValueError(f"cannot evict {num_slots!r} slots")
        if self.eviction == "value":
            return self._evict_by_value(num_slots, below)
        freed = 0
        # Deletions below only remove tombstones besides `node`, so the snapshot stays valid.
        for node in list(self._state_lru.values()):
            if freed >= num_slots:
                break
            if node.state_lock > 0:
                continue
            self._evict_one_state(node)
            freed += 1
        return freed

    def _evict_by_value(self, num_slots: int, below: Worth | None) -> int:
        freed = 0
        while freed < num_slots:
            ranked = rank_states(self.root, self._state_lru)
            if not ranked or (below is not None and not ranked[0][0] < below):
                break
            self._evict_one_state(ranked[0][1])
            freed += 1
        return freed

    def fresh_worth(self, saved_tokens: int) -> Worth | None:
        """What a running request's new checkpoint is worth to the eviction policy: it saves
        ``saved_tokens`` over the request's deepest cached state and is the most recent, but
        the same request supersedes it as it goes on. None under ``"sglang"`` (a fresh
        checkpoint may evict any unlocked state). A query."""
        if self.eviction != "value":
            return None
        return Worth.of(saved_tokens, recency=1.0, superseded=True)

    def _evict_one_state(self, node: TreeNode) -> None:
        assert node.state_lock == 0 and node.has_state, node.node_id
        if node.is_leaf:
            parent = node.parent
            self._delete_leaf(node)
            self._prune_tombstones(parent)
        else:
            self.slot_allocator.free([node.state_slot])
            self._drop_state(node)

    def _delete_leaf(self, leaf: TreeNode) -> int:
        """Free an unlocked leaf's KV and state and unlink it; returns its token count."""
        assert leaf.is_leaf and not leaf.is_root and leaf.kv_lock == 0, leaf.node_id
        self.kv_allocator.free_token_indices(leaf.value)
        if leaf.has_state:
            self.slot_allocator.free([leaf.state_slot])
            self._drop_state(leaf)
        del leaf.parent.children[self._page_at(leaf.key, 0)]
        del self._kv_lru[leaf.node_id]
        self._num_cached_tokens -= len(leaf.key)
        return len(leaf.key)

    def _prune_tombstones(self, node: TreeNode) -> tuple[int, TreeNode]:
        """Delete ``node`` and its ancestors while they are tombstone leaves; returns (tokens
        freed, first surviving node)."""
        freed = 0
        while not node.is_root and node.is_leaf and not node.has_state:
            parent = node.parent
            freed += self._delete_leaf(node)
            node = parent
        return freed, node

    def _set_state(self, node: TreeNode, slot: int) -> None:
        node.state_slot = int(slot)
        self._state_lru[node.node_id] = node  # a new state enters as the most recent

    def _drop_state(self, node: TreeNode) -> None:
        assert node.state_lock == 0, f"dropping the locked state of node {node.node_id}"
        node.state_slot = None
        del self._state_lru[node.node_id]

    def flush(self) -> None:
        """Free every cached page and slot and empty the tree; ValueError if a lock is held."""
        locked = [c.node_id for c in self.root.children.values() if c.kv_lock > 0]
        if locked:
            raise ValueError(f"cannot flush: nodes {locked} are locked")
        self.kv_allocator.free_pages(self.cached_pages())
        self.slot_allocator.free(self.cached_slot_ids())
        self._reset()

    # ---- inspection ----------------------------------------------------------------------

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every non-root node, each after its parent."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def cached_slot_ids(self) -> list[int]:
        return [node.state_slot for node in self.iter_nodes() if node.has_state]

    def cached_pages(self) -> np.ndarray:
        rows = np.concatenate([self.root.value] + [n.value for n in self.iter_nodes()])
        return self.kv_allocator.token_indices_to_pages(rows)

    def check_integrity(self) -> None:
        """AssertionError with detail if a rule is broken: node shapes, no tombstone leaves,
        ``kv_lock == state_lock + sum(children's kv_lock)``, LRUs hold exactly the right
        nodes, counters match a full walk, cached pages / slots are allocated and unique."""
        nodes = list(self.iter_nodes())
        root = self.root
        assert root.kv_lock == root.state_lock == 0 and not root.has_state, "root holds locks"
        for node in [root] + nodes:
            _check_node(self, node)
        assert self._kv_lru == {n.node_id: n for n in nodes}, "KV LRU != the non-root nodes"
        assert self._state_lru == {n.node_id: n for n in nodes if n.has_state}, (
            "state LRU != the nodes holding a state"
        )
        counted = (
            sum(len(n.key) for n in nodes),
            sum(len(n.key) for n in nodes if n.kv_lock),
            sum(1 for n in nodes if n.has_state and n.state_lock),
        )
        kept = (self._num_cached_tokens, self._num_locked_tokens, self._num_locked_slots)
        assert kept == counted, f"(cached, locked) tokens / locked slots: {kept} != {counted}"
        try:
            pages = self.cached_pages()
        except ValueError as error:
            raise AssertionError(f"cached KV rows are not whole pages: {error}") from error
        slots = np.asarray(self.cached_slot_ids(), dtype=np.int64)
        for what, ids, allocator in (
            ("slot", slots, self.slot_allocator),
            ("page", pages, self.kv_allocator),
        ):
            unique, counts = np.unique(ids, return_counts=True)
            assert (counts == 1).all(), f"{what}s {unique[counts > 1].tolist()} cached twice"
            loose = ids[~allocator.is_allocated(ids)]
            assert loose.size == 0, f"cached {what}s {loose.tolist()} are free in the allocator"

    # ---- keys and ids --------------------------------------------------------------------

    def _new_id(self) -> int:
        self._next_node_id += 1
        return self._next_node_id - 1

    def _page_at(self, key: np.ndarray, pos: int) -> tuple[int, ...]:
        return tuple(key[pos : pos + self.page_size].tolist())

    def _common_len(self, edge: np.ndarray, key: np.ndarray) -> int:
        """Tokens shared by ``edge`` and ``key`` from the start, rounded down to whole pages."""
        n = min(len(edge), len(key))
        mismatch = np.flatnonzero(edge[:n] != key[:n])
        common = int(mismatch[0]) if mismatch.size else n
        return common // self.page_size * self.page_size


def _check_node(tree: RadixCache, node: TreeNode) -> None:
    """Shape and lock rules of one node and its child links."""
    name = f"node {node.node_id}"
    child_locks = 0
    for first_page, child in node.children.items():
        assert child.parent is node, f"node {child.node_id} does not point back to {name}"
        assert first_page == tree._page_at(child.key, 0), (
            f"node {child.node_id} filed under {first_page}"
        )
        child_locks += child.kv_lock
    if node.is_root:
        return
    assert len(node.key) > 0 and len(node.key) % tree.page_size == 0, f"{name}: key {node.key}"
    assert len(node.value) == len(node.key), f"{name}: {len(node.value)} rows, {len(node.key)} keys"
    assert node.has_state or not node.is_leaf, f"{name} is a tombstone leaf"
    assert node.has_state or node.state_lock == 0, f"{name}: state_lock on a tombstone"
    assert node.kv_lock >= node.state_lock >= 0, f"{name}: locks {node.kv_lock}, {node.state_lock}"
    assert node.kv_lock == node.state_lock + child_locks, (
        f"{name}: kv_lock {node.kv_lock} != state_lock {node.state_lock} + children {child_locks}"
    )
