"""The host tier of the radix cache: host pools' free lists, write policy, copies, host LRU.

Host-only (no jax). With the tier on, a radix node's KV pages and its recurrent checkpoint are
on the device, on the host, or both (``TreeNode.value`` / ``state_slot`` on the device,
``host_value`` / ``host_slot`` on the host). The tree decides what moves (``RadixCache``'s
``_back_up``, ``load``, ``evict_host``); this class keeps the host side's books:

* the host pools' free lists: a ``SlotAllocator`` and a ``KVAllocator`` of the device pools'
  kinds, sized by the engine (``hicache_ratio`` / ``hicache_size``); id 0 is null as on the
  device, so a host id is never 0;
* the write policy (SGLang's names): ``write_through`` copies a node to the host when the
  tree receives it, ``write_through_selective`` once it was hit ``SELECTIVE_HITS`` times,
  ``write_back`` only when the device evicts it (nodes not on the host are then lost);
* the copies as ``Transfer`` records, queued in the order the tree decided them and taken
  by the engine (``take``), which runs them on the device before the next step's launch
  and reports them done (``complete``) once that step's results are read back;
* a node with a copy not yet completed is *busy*: the host LRU never evicts it, and if the
  tree deletes it anyway (a device eviction that may not keep it), its host ids stay
  allocated (*orphaned*) until the copy completes, so a late copy never lands in an id
  handed out again;
* the host LRU (every node with a host copy, least recent first) and the counters.

| host ids are exactly one of | held by                                    |
|-----------------------------|--------------------------------------------|
| free                        | the host allocators                        |
| cached                      | a tree node's ``host_value`` / ``host_slot`` |
| orphaned                    | a deleted node whose copy is in flight     |
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from lazyspec.cache.allocators import KVAllocator, SlotAllocator

if TYPE_CHECKING:
    from lazyspec.cache.radix_cache import TreeNode

WRITE_THROUGH, WRITE_BACK, WRITE_THROUGH_SELECTIVE = (
    "write_through",
    "write_back",
    "write_through_selective",
)
WRITE_POLICIES = (WRITE_THROUGH, WRITE_BACK, WRITE_THROUGH_SELECTIVE)
SELECTIVE_HITS = 2  # write_through_selective copies a node hit (inserted or matched) this often
STORE, LOAD = "store", "load"  # device -> host, host -> device


@dataclass(frozen=True)
class Transfer:
    """One copy of a node's checkpoint and/or KV pages between the tiers. A side with slot 0
    and no pages moves nothing of that kind."""

    kind: str  # STORE or LOAD
    node_id: int
    device_slot: int  # 0: no state moves
    host_slot: int
    device_pages: np.ndarray  # int64 page ids, in the node's token order
    host_pages: np.ndarray  # the same number, paired with device_pages

    @property
    def num_pages(self) -> int:
        return len(self.device_pages)


@dataclass
class TierStats:
    """Cumulative counts for server info; they survive ``flush``."""

    num_host_hits: int = 0  # admissions that loaded (part of) their match from the host
    num_loaded_tokens: int = 0
    num_loaded_states: int = 0
    num_stored_tokens: int = 0
    num_stored_states: int = 0
    num_host_evictions: int = 0  # host copies dropped to make room on the host


class HostTier:
    def __init__(
        self, kv: KVAllocator, slots: SlotAllocator, write_policy: str = WRITE_THROUGH
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy={write_policy!r} must be one of {WRITE_POLICIES}")
        self.kv = kv
        self.slots = slots
        self.write_policy = write_policy
        self.stats = TierStats()
        self.lru: OrderedDict[int, TreeNode] = OrderedDict()  # nodes with a host copy
        self._queue: list[Transfer] = []
        self._busy: dict[int, int] = {}  # node id -> its copies not completed
        self._orphans: dict[int, list[tuple[int | None, np.ndarray | None]]] = {}

    @property
    def write_hits(self) -> int | None:
        """Hits (the insert counts as one) after which a node is copied to the host; None
        under write_back (copied only when evicted from the device)."""
        return {WRITE_THROUGH: 1, WRITE_THROUGH_SELECTIVE: SELECTIVE_HITS}.get(self.write_policy)

    # ------------------------------------------------------------------ copies

    def queue(self, transfer: Transfer) -> None:
        """Mutates: record a copy the tree decided; its node is busy until ``complete``."""
        self._queue.append(transfer)
        self._busy[transfer.node_id] = self._busy.get(transfer.node_id, 0) + 1
        moved = self.kv.page_size * transfer.num_pages
        if transfer.kind == STORE:
            self.stats.num_stored_tokens += moved
            self.stats.num_stored_states += transfer.device_slot != 0
        else:
            self.stats.num_loaded_tokens += moved
            self.stats.num_loaded_states += transfer.device_slot != 0

    def take(self) -> list[Transfer]:
        """Mutates: the queued copies, in the order they were decided (run them in it)."""
        taken, self._queue = self._queue, []
        return taken

    def complete(self, transfers: list[Transfer]) -> None:
        """Mutates: ``transfers`` (taken earlier) have run; their nodes are no longer busy
        for them, and the host ids of deleted nodes with no copy left are freed."""
        for transfer in transfers:
            node_id = transfer.node_id
            self._busy[node_id] -= 1
            if self._busy[node_id]:
                continue
            del self._busy[node_id]
            for slot, rows in self._orphans.pop(node_id, ()):
                self._free(slot, rows)

    def is_busy(self, node: TreeNode) -> bool:
        return node.node_id in self._busy

    @property
    def has_pending(self) -> bool:
        """Whether a copy is queued or not completed."""
        return bool(self._busy)

    # ------------------------------------------------------------------ host ids

    def touch(self, node: TreeNode) -> None:
        """Mutates: ``node`` (with a host copy) becomes the most recent in the host LRU."""
        self.lru[node.node_id] = node
        self.lru.move_to_end(node.node_id)

    def release(self, node: TreeNode) -> None:
        """Mutates: take ``node``'s host copy off it and free its ids, now or (busy) once
        its copies complete."""
        slot, rows = node.host_slot, node.host_value
        node.host_slot = node.host_value = None
        self.lru.pop(node.node_id, None)
        if node.node_id in self._busy:
            self._orphans.setdefault(node.node_id, []).append((slot, rows))
        else:
            self._free(slot, rows)

    def _free(self, slot: int | None, rows: np.ndarray | None) -> None:
        if slot is not None:
            self.slots.free([slot])
        if rows is not None:
            self.kv.free_token_indices(rows)

    def orphaned_slot_ids(self) -> list[int]:
        held = [slot for held in self._orphans.values() for slot, _ in held]
        return [slot for slot in held if slot is not None]

    def orphaned_pages(self) -> np.ndarray:
        rows = [r for held in self._orphans.values() for _, r in held if r is not None]
        return self.kv.token_indices_to_pages(np.concatenate([np.zeros(0, np.int32), *rows]))
