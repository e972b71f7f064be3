"""The radix tree's records: ``TreeNode`` (one edge) and the results of its operations.

Host-only (no jax). ``radix_cache.py`` holds the tree that links them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(eq=False)
class TreeNode:
    """One edge of the tree: ``key`` tokens, their KV rows ``value``, an optional state slot."""

    node_id: int
    key: np.ndarray  # int64 token ids of this edge (a whole number of pages)
    value: np.ndarray | None  # int32 token-level device KV rows, as key; None: host only
    parent: TreeNode | None
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    state_slot: int | None = None  # the device state; None on both tiers = tombstone
    kv_lock: int = 0
    state_lock: int = 0
    host_value: np.ndarray | None = None  # int32 host KV rows (host tier), as key
    host_slot: int | None = None  # the state's host copy
    hit_count: int = 0  # inserts and admissions through it (write_through_selective)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def has_state(self) -> bool:
        """A state for this prefix exists, on the device or the host (else a tombstone)."""
        return self.state_slot is not None or self.host_slot is not None

    @property
    def on_device(self) -> bool:
        return self.value is not None

    @property
    def on_host(self) -> bool:
        return self.host_value is not None


@dataclass(frozen=True)
class MatchResult:
    kv_indices: np.ndarray  # int32 KV rows of the matched prefix (len == prefix_len)
    node: TreeNode  # deepest node on the path holding a state (root if none)
    state_slot: int  # that node's slot, 0 for the root
    prefix_len: int  # tokens covered by kv_indices and by the state
    kv_match_len: int = 0  # whole-page tokens whose KV is cached (>= prefix_len): branch point
    # the part only on the host (``RadixCache.load`` brings it to the device; until then
    # ``kv_indices`` holds the device part only and ``state_slot`` is 0)
    load_tokens: int = 0
    load_state: bool = False

    @property
    def needs_load(self) -> bool:
        return self.load_tokens > 0 or self.load_state


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
