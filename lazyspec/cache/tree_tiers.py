"""The radix tree's host-tier operations, mixed into ``RadixCache`` (host-only, no jax).

``load`` brings a match's host-only part back to the device; ``_back_up`` copies a node to
the host (the write policy decides when: ``_write_if_due`` at inserts and hits, ``_keeps``
at a device eviction); ``evict_host`` makes room on the host. Every copy is queued on the
``HostTier`` as a ``Transfer``, in the order decided; the engine runs them before the next
step. The tree's own structure (links, device LRUs and counts) stays ``RadixCache``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from lazyspec.cache.checkpoint_value import rank_states
from lazyspec.cache.host_tier import LOAD, STORE, Transfer
from lazyspec.cache.tree_node import MatchResult, TreeNode

if TYPE_CHECKING:
    from lazyspec.cache.host_tier import HostTier


class HostTierOps:
    """What ``RadixCache`` does with its ``host`` tier (None: the tier is off)."""

    host: HostTier | None
    eviction: str  # the checkpoint eviction policy; the host follows it (``_host_order``)

    # ---- load ---------------------------------------------------------------------------

    def load(self, match: MatchResult) -> MatchResult:
        """Mutates: bring the host-only part of ``match`` (from ``match_prefix``, its node
        locked) to the device: fresh device pages for each node of its path that is only on
        the host, a fresh device slot for its state if only the host has it, each queued as
        a ``LOAD`` copy; counts a hit on each node of the path (the write policy may copy
        them to the host).
        The free slots and pages must be there (``match.load_tokens`` / ``load_state`` said
        how many). Returns the match as it is now on the device."""
        node = match.node
        if node.is_root:
            return match
        path = self._path_to(node)
        if match.needs_load:
            self.host.stats.num_host_hits += 1
        for walk in path:
            if not walk.on_device or (walk is node and walk.state_slot is None):
                self._load_node(walk, with_state=walk is node)
        for walk in path:  # a prefix every turn of a conversation passes is hit each time
            self._note_hit(walk)
        kv_indices = np.concatenate([self.root.value] + [n.value for n in path])
        return MatchResult(kv_indices, node, node.state_slot, len(kv_indices), match.kv_match_len)

    def _load_node(self, node: TreeNode, with_state: bool) -> None:
        pages = np.zeros(0, np.int64)
        if not node.on_device:
            pages = self.kv_allocator.alloc_pages(len(node.key) // self.page_size)
            assert pages is not None, "load() without the free pages it needs"
            self._set_device_kv(node, self.kv_allocator.pages_to_token_indices(pages))
        slot = 0
        if with_state and node.state_slot is None:
            got = self.slot_allocator.alloc(1)
            assert got is not None, "load() without the free slot it needs"
            slot = got[0]
            self._set_state(node, slot)
            self._num_locked_slots += node.state_lock > 0
        host_pages = np.zeros(0, np.int64)
        if len(pages):
            host_pages = self.host.kv.token_indices_to_pages(node.host_value)
        host_slot = node.host_slot if slot else 0
        pages = np.asarray(pages, np.int64)
        self.host.queue(Transfer(LOAD, node.node_id, slot, host_slot, pages, host_pages))
        self.host.touch(node)

    def _set_device_kv(self, node: TreeNode, rows: np.ndarray) -> None:
        """Mutates: ``node`` (host only) gets device KV ``rows``; counts follow."""
        node.value = rows.astype(np.int32)
        self._kv_lru[node.node_id] = node
        self._num_cached_tokens += len(node.key)
        self._num_locked_tokens += len(node.key) if node.kv_lock else 0

    def _path_to(self, node: TreeNode) -> list[TreeNode]:
        path = []
        while not node.is_root:
            path.append(node)
            node = node.parent
        return path[::-1]

    def _note_hit(self, node: TreeNode) -> None:
        """A request was admitted through ``node`` (or ``node`` was inserted): copy it to the
        host once it was hit as often as the write policy asks."""
        node.hit_count += 1
        self._write_if_due(node)

    def _write_if_due(self, node: TreeNode) -> None:
        """Copy ``node`` to the host if the write policy asks for it at its hit count."""
        hits = self.host.write_hits if self.host else None
        if hits is not None and node.hit_count >= hits and node.on_device:
            self._back_up(node)

    def _keeps(self, node: TreeNode) -> bool:
        """Whether the host holds (or now copies, under write_back) all ``node`` has on the
        device, so that the device may drop it. Without a host tier, never."""
        if self.host is None:
            return False
        if node.on_host and (node.state_slot is None or node.host_slot is not None):
            return True
        return self.host.write_hits is None and self._back_up(node)

    def _drop_device(self, node: TreeNode) -> int:
        """Mutates: free ``node``'s device KV and state (the host keeps them); returns the
        device tokens freed."""
        assert node.kv_lock == 0 and node.on_host, node.node_id
        if node.state_slot is not None:
            self.slot_allocator.free([node.state_slot])
            self._drop_state(node)
        self.kv_allocator.free_token_indices(node.value)
        node.value = None
        del self._kv_lru[node.node_id]
        self._num_cached_tokens -= len(node.key)
        return len(node.key)

    # ---- copies and host eviction ----------------------------------------------------

    def _back_up(self, node: TreeNode) -> bool:
        """Copy what ``node`` has on the device and not on the host (its KV, its state) to
        fresh host ids, queued as a ``STORE``, evicting on the host to make room; False
        (nothing changed) when the host cannot make room."""
        host = self.host
        num_pages = 0 if node.on_host else len(node.key) // self.page_size
        num_slots = int(node.state_slot is not None and node.host_slot is None)
        if not num_pages and not num_slots:
            return True
        if not self.evict_host(num_slots, num_pages, keep=node):
            return False
        host_pages = np.asarray(host.kv.alloc_pages(num_pages), np.int64)
        host_slot = host.slots.alloc(1)[0] if num_slots else 0
        device_pages = np.zeros(0, np.int64)
        if num_pages:
            node.host_value = host.kv.pages_to_token_indices(host_pages)
            device_pages = self.kv_allocator.token_indices_to_pages(node.value)
        if num_slots:
            node.host_slot = host_slot
        device_slot = node.state_slot if num_slots else 0
        host.queue(Transfer(STORE, node.node_id, device_slot, host_slot, device_pages, host_pages))
        host.touch(node)
        return True

    def evict_host(self, num_slots: int, num_pages: int, keep: TreeNode | None = None) -> bool:
        """Mutates: drop host copies in ``_host_order`` until ``num_slots`` host slots and
        ``num_pages`` host pages are free; returns whether they are. Never takes ``keep``,
        a busy node (a copy in flight), or the only copy of what a locked node needs; a
        node only on the host goes with its copy once it is a leaf (then tombstone parents
        left as leaves)."""
        host = self.host
        progress = True
        while progress and (host.slots.num_free < num_slots or host.kv.num_free_pages < num_pages):
            progress = False
            for node in self._host_order():
                if host.slots.num_free >= num_slots and host.kv.num_free_pages >= num_pages:
                    break
                if node.node_id not in host.lru or node is keep or host.is_busy(node):
                    continue  # gone with a node pruned before it, or kept
                if not self._host_evictable(node):
                    continue
                host.release(node)
                host.stats.num_host_evictions += 1
                progress = True
                if not node.on_device:
                    parent = node.parent
                    self._delete_node(node)
                    node = parent
                self._prune_tombstones(node, keep=keep)
                if self.eviction == "value":
                    break  # each eviction changes what the others are worth: rank again
        return host.slots.num_free >= num_slots and host.kv.num_free_pages >= num_pages

    def _host_order(self) -> list[TreeNode]:
        """The host copies in the order the host evicts them (reads only): host-LRU order
        under ``"sglang"``; under ``"value"`` the copies holding a state by that state's
        worth as the device ranks its own (``rank_states``, recency in the host LRU), then
        the copies of KV alone in host-LRU order (a host path's KV carries every host state
        below it)."""
        lru = self.host.lru
        if self.eviction != "value":
            return list(lru.values())
        ranked = [node for _, node in rank_states(self.root, lru, host=True)]
        return ranked + [node for node in lru.values() if node.host_slot is None]

    @staticmethod
    def _host_evictable(node: TreeNode) -> bool:
        if not node.on_device:
            return node.is_leaf and node.kv_lock == 0
        # the device has the KV; the host copy is the only state of a node without one there
        return node.state_lock == 0 or node.state_slot is not None or node.host_slot is None
