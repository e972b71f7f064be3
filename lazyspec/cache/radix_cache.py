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

With a host tier (``host=HostTier(...)``, ``host_tier.py``) a node's KV and state are on the
device, the host or both, and the device's evictions keep on the host what the write policy
copied there; ``match_prefix`` may end on the host, and ``load`` brings that part back
(the rules, checked by ``tree_check.check_tree``):

* device KV is prefix-closed (a node on the device has its parent there), so ``evict_kv``
  takes *device leaves* (no child on the device) and a match's device part is its head;
* a host copy is a whole node (its KV, and its state if it had one on the device);
* a node on neither tier is deleted; no leaf is a tombstone on both tiers.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import numpy as np

from lazyspec.cache.allocators import KVAllocator, SlotAllocator, check_all
from lazyspec.cache.checkpoint_value import Worth, rank_states
from lazyspec.cache.host_tier import HostTier
from lazyspec.cache.tree_check import check_tree
from lazyspec.cache.tree_node import CacheStats, InsertResult, MatchResult, TreeNode
from lazyspec.cache.tree_tiers import HostTierOps

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


class RadixCache(HostTierOps):
    """Radix tree over token ids whose nodes hold KV pages and recurrent-state checkpoints."""

    def __init__(
        self,
        page_size: int,
        kv_allocator: KVAllocator,
        slot_allocator: SlotAllocator,
        disable: bool = False,
        eviction: str = "sglang",
        host: HostTier | None = None,
    ) -> None:
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction={eviction!r} must be one of {EVICTION_POLICIES}")
        for allocator in (kv_allocator, host.kv if host else kv_allocator):
            if page_size != allocator.page_size:
                raise ValueError(
                    f"page_size {page_size!r} differs from a KV allocator's {allocator.page_size}"
                )
        self.page_size = int(page_size)
        self.kv_allocator = kv_allocator
        self.slot_allocator = slot_allocator
        self.disable = disable
        self.eviction = eviction
        self.host = None if disable else host
        self.stats = CacheStats()
        self._reset()

    def _reset(self) -> None:
        self._next_node_id = 1
        empty_key, empty_value = np.zeros(0, np.int64), np.zeros(0, np.int32)
        self.root = TreeNode(0, empty_key, empty_value, parent=None)
        self._kv_lru: OrderedDict[int, TreeNode] = OrderedDict()  # every node on the device
        self._state_lru: OrderedDict[int, TreeNode] = OrderedDict()  # every device state
        # device counts only: the host's are its allocators'
        self._num_cached_tokens = 0
        self._num_locked_tokens = 0  # edge tokens of device nodes with kv_lock > 0
        self._num_locked_slots = 0  # device states of nodes with state_lock > 0

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
        A prefix partly on the host only is returned with what ``load`` must bring back.
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
        self._touch(path + ([partial[0]] if partial else []))
        best = path[best_depth - 1] if best_depth else self.root
        if best.state_slot is not None and best_depth:
            self._state_lru.move_to_end(best.node_id)
        device = [node.value for node in path[:best_depth] if node.on_device]
        kv_indices = np.concatenate([self.root.value] + device)
        self.stats.num_matched_tokens += best_len
        return MatchResult(
            kv_indices,
            best,
            best.state_slot or 0,
            best_len,
            kv_match_len,
            load_tokens=best_len - len(kv_indices),
            load_state=best_depth > 0 and best.state_slot is None,
        )

    def _touch(self, nodes: list[TreeNode]) -> None:
        """Mutates: ``nodes`` become the most recent in the KV LRU (and the host LRU)."""
        for node in nodes:
            if node.on_device:
                self._kv_lru.move_to_end(node.node_id)
            if node.on_host:
                self.host.touch(node)

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
        from the tree's are freed (a node only on the host takes them as its device copy).
        ``state_slot`` is attached only if the key ends at a new node or one without a device
        state (``state_taken``); existing states keep their LRU place.
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
        self._adopt_or_free(path, value[:matched])
        self._touch(path)
        end = path[-1] if path else self.root
        if matched < len(key):
            leaf = self._add_leaf(end, key[matched:], value[matched:], state_slot)
            self._note_hit(leaf)
            return InsertResult(leaf, True, len(key) - matched)
        if end.is_root or end.state_slot is not None or state_slot is None:
            return InsertResult(end, False, 0)
        self._set_state(end, state_slot)  # revive a tombstone, or a state only on the host
        self._num_locked_slots += end.state_lock > 0
        self._write_if_due(end)
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

    def _adopt_or_free(self, path: list[TreeNode], given: np.ndarray) -> None:
        """Free the given pages that duplicate (differ from) the tree's pages on ``path``; a
        node of ``path`` only on the host takes its given rows as its device copy. Rows are
        whole aligned pages, so a page either equals the tree's or shares no row."""
        start, duplicates = 0, []
        for node in path:
            rows = given[start : start + len(node.key)]
            start += len(node.key)
            if not node.on_device:
                self._set_device_kv(node, rows)
                continue
            differs = (node.value != rows).reshape(-1, self.page_size).any(axis=1)
            duplicates.append(rows.reshape(-1, self.page_size)[differs])
        if duplicates and sum(len(d) for d in duplicates):
            self.kv_allocator.free_token_indices(np.concatenate(duplicates))

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
        inherits the child's kv_lock (every lock below covers it), tiers and hits and has no
        state_lock."""
        parent = child.parent
        upper = TreeNode(self._new_id(), child.key[:length], None, parent)
        upper.kv_lock, upper.hit_count = child.kv_lock, child.hit_count
        if child.on_device:
            upper.value, child.value = child.value[:length], child.value[length:]
            self._kv_lru[upper.node_id] = upper
        if child.on_host:
            upper.host_value, child.host_value = (
                child.host_value[:length],
                child.host_value[length:],
            )
            self.host.touch(upper)
        parent.children[self._page_at(child.key, 0)] = upper
        child.key, child.parent = child.key[length:], upper
        upper.children[self._page_at(child.key, 0)] = child
        return upper

    # ---- locks ---------------------------------------------------------------------------

    def lock_cost(self, node: TreeNode) -> tuple[int, int]:
        """(states, KV tokens) that ``inc_lock(node)`` would take out of the evictable counts
        (``num_evictable_slots`` / ``num_evictable_kv_tokens``). A query: nothing changes."""
        if node.is_root:
            return 0, 0
        tokens, walk = 0, node
        while not walk.is_root:
            tokens += len(walk.key) if walk.kv_lock == 0 and walk.on_device else 0
            walk = walk.parent
        return int(node.state_lock == 0 and node.state_slot is not None), tokens

    def inc_lock(self, node: TreeNode) -> None:
        """Protect ``node``'s state and its path's KV from eviction (no-op on the root).
        Only state nodes can be locked: a locked tombstone could become a locked leaf."""
        if node.is_root:
            return
        if not node.has_state:
            raise ValueError(f"node {node.node_id} is a tombstone; only state nodes are locked")
        self._num_locked_slots += node.state_lock == 0 and node.state_slot is not None
        node.state_lock += 1
        self._add_kv_lock(node, +1)

    def dec_lock(self, node: TreeNode) -> None:
        """Undo one ``inc_lock(node)``; ValueError if ``node`` holds no lock."""
        if node.is_root:
            return
        if node.state_lock < 1:
            raise ValueError(f"node {node.node_id} is not locked (state_lock {node.state_lock})")
        node.state_lock -= 1
        self._num_locked_slots -= node.state_lock == 0 and node.state_slot is not None
        self._add_kv_lock(node, -1)

    def _add_kv_lock(self, node: TreeNode, delta: int) -> None:
        while not node.is_root:
            if node.on_device and (node.kv_lock == 0) != (node.kv_lock + delta == 0):
                self._num_locked_tokens += len(node.key) * delta
            node.kv_lock += delta
            node = node.parent

    # ---- eviction ------------------------------------------------------------------------

    def evict_kv(self, num_tokens: int) -> int:
        """Free the device KV of unlocked device leaves (nodes with no child on the device)
        in KV-LRU order, and of tombstone parents left as leaves, until ``num_tokens`` KV
        tokens are freed or nothing is evictable; returns tokens freed (whole nodes, so
        possibly more than asked). A node the host tier keeps (``_keeps``) stays in the tree
        on the host; any other is deleted, with its descendants (on the host only)."""
        if num_tokens < 0:
            raise ValueError(f"cannot evict {num_tokens!r} tokens")
        rank = {node_id: i for i, node_id in enumerate(self._kv_lru)}
        heap = [(rank[n.node_id], n) for n in self._kv_lru.values() if self._kv_evictable(n)]
        heapq.heapify(heap)  # ranks are unique, so nodes themselves are never compared
        freed = 0
        while freed < num_tokens and heap:
            node = heapq.heappop(heap)[1]
            if not self._kv_evictable(node):  # a host eviction took it meanwhile
                continue
            parent = node.parent
            if self._keeps(node):
                freed += self._drop_device(node)
                freed += self._prune_tombstones(node)[0]
            else:
                freed += self._delete_subtree(node)
            pruned, survivor = self._prune_tombstones(parent)
            freed += pruned
            if survivor.node_id in rank and self._kv_evictable(survivor):
                heapq.heappush(heap, (rank[survivor.node_id], survivor))
        return freed

    def _kv_evictable(self, node: TreeNode) -> bool:
        """An unlocked node on the device with no child there (``evict_kv``'s candidates)."""
        if node.kv_lock or not node.on_device or node.is_root:
            return False
        return not any(child.on_device for child in node.children.values())

    def evict_state(self, num_slots: int, below: Worth | None = None) -> int:
        """Free up to ``num_slots`` unlocked device states: a state the host tier keeps
        stays there; otherwise an internal node becomes a tombstone (KV kept) and a leaf is
        deleted with its KV, then any tombstone parents left as leaves.
        Returns slots freed. Which states go is the eviction policy's choice: ``"sglang"``
        takes them in state-LRU order (``below`` is ignored); ``"value"`` takes the state
        worth least, one at a time (each eviction changes what the others are worth), and
        with ``below`` only states worth less than it (possibly none)."""
        if num_slots < 0:
            raise ValueError(f"cannot evict {num_slots!r} slots")
        if self.eviction == "value":
            return self._evict_by_value(num_slots, below)
        freed = 0
        for node in list(self._state_lru.values()):
            if freed >= num_slots:
                break
            # a host eviction for an earlier one may have deleted it
            if node.state_lock > 0 or node.node_id not in self._state_lru:
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
        assert node.state_lock == 0 and node.state_slot is not None, node.node_id
        if self._keeps(node) or not node.is_leaf:
            self.slot_allocator.free([node.state_slot])
            self._drop_state(node)
            self._prune_tombstones(node)
            return
        parent = node.parent
        self._delete_node(node)
        self._prune_tombstones(parent)

    def _delete_subtree(self, node: TreeNode) -> int:
        """Delete unlocked ``node`` and every node below it; returns device tokens freed."""
        freed = 0
        for child in list(node.children.values()):
            freed += self._delete_subtree(child)
        return freed + self._delete_node(node)

    def _delete_node(self, node: TreeNode) -> int:
        """Free an unlocked leaf's device and host copies and unlink it; returns its device
        tokens."""
        assert node.is_leaf and not node.is_root and node.kv_lock == 0, node.node_id
        freed = 0
        if node.on_device:
            self.kv_allocator.free_token_indices(node.value)
            del self._kv_lru[node.node_id]
            self._num_cached_tokens -= len(node.key)
            freed = len(node.key)
            node.value = None  # a deleted node is on no tier (a stale reference sees it)
        if node.state_slot is not None:
            self.slot_allocator.free([node.state_slot])
            self._drop_state(node)
        if node.on_host or node.host_slot is not None:
            self.host.release(node)
        del node.parent.children[self._page_at(node.key, 0)]
        return freed

    def _prune_tombstones(
        self, node: TreeNode, keep: TreeNode | None = None
    ) -> tuple[int, TreeNode]:
        """Delete ``node`` and its ancestors while they are tombstone leaves (but ``keep``);
        returns (device tokens freed, first surviving node)."""
        freed = 0
        while not node.is_root and node.is_leaf and not node.has_state and node is not keep:
            parent = node.parent
            freed += self._delete_node(node)
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
        """Free every cached page and slot (on both tiers) and empty the tree; ValueError if
        a lock is held. Host ids with a copy in flight are freed when it completes."""
        locked = [c.node_id for c in self.root.children.values() if c.kv_lock > 0]
        if locked:
            raise ValueError(f"cannot flush: nodes {locked} are locked")
        self.kv_allocator.free_pages(self.cached_pages())
        self.slot_allocator.free(self.cached_slot_ids())
        if self.host is not None:
            for node in list(self.iter_nodes()):
                if node.on_host or node.host_slot is not None:
                    self.host.release(node)
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
        """The device slots the tree holds."""
        return [node.state_slot for node in self.iter_nodes() if node.state_slot is not None]

    def cached_pages(self) -> np.ndarray:
        """The device pages the tree holds."""
        rows = [self.root.value] + [n.value for n in self.iter_nodes() if n.on_device]
        return self.kv_allocator.token_indices_to_pages(np.concatenate(rows))

    def cached_host_slot_ids(self) -> list[int]:
        return [node.host_slot for node in self.iter_nodes() if node.host_slot is not None]

    def cached_host_pages(self) -> np.ndarray:
        rows = [self.root.value] + [n.host_value for n in self.iter_nodes() if n.on_host]
        return self.host.kv.token_indices_to_pages(np.concatenate(rows))

    def check_integrity(self) -> None:
        """AssertionError with detail if a rule is broken (``tree_check.check_tree``)."""
        check_tree(self)

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
