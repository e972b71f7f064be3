"""``check_tree``: every rule of the radix tree, on both tiers (host-only, no jax).

Tests call it (through ``RadixCache.check_integrity`` and ``allocators.check_all``) after
every step; it reads only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from lazyspec.cache.radix_cache import RadixCache
    from lazyspec.cache.tree_node import TreeNode


def check_tree(tree: RadixCache) -> None:
    """AssertionError with detail if a rule is broken: node shapes, tiers (device KV
    prefix-closed; a state on a tier only with the node's KV there), no tombstone leaves,
    ``kv_lock == state_lock + sum(children's kv_lock)``, LRUs hold exactly the right nodes,
    counters match a full walk, cached pages / slots of each tier are allocated and
    unique."""
    nodes = list(tree.iter_nodes())
    root = tree.root
    assert root.kv_lock == root.state_lock == 0 and not root.has_state, "root holds locks"
    for node in [root] + nodes:
        _check_node(tree, node)
    device = [n for n in nodes if n.on_device]
    assert tree._kv_lru == {n.node_id: n for n in device}, "KV LRU != the nodes on the device"
    assert tree._state_lru == {n.node_id: n for n in nodes if n.state_slot is not None}, (
        "state LRU != the nodes holding a device state"
    )
    counted = (
        sum(len(n.key) for n in device),
        sum(len(n.key) for n in device if n.kv_lock),
        sum(1 for n in nodes if n.state_slot is not None and n.state_lock),
    )
    kept = (tree._num_cached_tokens, tree._num_locked_tokens, tree._num_locked_slots)
    assert kept == counted, f"(cached, locked) tokens / locked slots: {kept} != {counted}"
    _check_ids(
        "", tree.cached_slot_ids(), tree.cached_pages, tree.slot_allocator, tree.kv_allocator
    )
    if tree.host is not None:
        host = tree.host
        assert host.lru == {n.node_id: n for n in nodes if n.on_host}, (
            "host LRU != the nodes with a host copy"
        )
        _check_ids(
            "host ", tree.cached_host_slot_ids(), tree.cached_host_pages, host.slots, host.kv
        )


def _check_ids(tier: str, slot_ids: list[int], pages_of, slot_allocator, kv_allocator) -> None:
    try:
        pages = pages_of()
    except ValueError as error:
        raise AssertionError(f"cached {tier}KV rows are not whole pages: {error}") from error
    slots = np.asarray(slot_ids, dtype=np.int64)
    for what, ids, allocator in (("slot", slots, slot_allocator), ("page", pages, kv_allocator)):
        unique, counts = np.unique(ids, return_counts=True)
        assert (counts == 1).all(), f"{tier}{what}s {unique[counts > 1].tolist()} cached twice"
        loose = ids[~allocator.is_allocated(ids)]
        assert loose.size == 0, f"cached {tier}{what}s {loose.tolist()} are free in the allocator"


def _check_node(tree: RadixCache, node: TreeNode) -> None:
    """Shape, tier and lock rules of one node and its child links."""
    name = f"node {node.node_id}"
    child_locks = 0
    for first_page, child in node.children.items():
        assert child.parent is node, f"node {child.node_id} does not point back to {name}"
        assert first_page == tree._page_at(child.key, 0), (
            f"node {child.node_id} filed under {first_page}"
        )
        assert node.on_device or not child.on_device, f"{name} is off the device, a child is on"
        child_locks += child.kv_lock
    if node.is_root:
        return
    assert len(node.key) > 0 and len(node.key) % tree.page_size == 0, f"{name}: key {node.key}"
    assert node.on_device or node.on_host, f"{name} is on neither tier"
    for rows in (node.value, node.host_value):
        assert rows is None or len(rows) == len(node.key), f"{name}: {len(rows)} rows"
    assert node.state_slot is None or node.on_device, f"{name}: device state, no device KV"
    assert node.host_slot is None or node.on_host, f"{name}: host state, no host KV"
    assert tree.host is not None or not node.on_host, f"{name}: a host copy with no tier"
    assert node.has_state or not node.is_leaf, f"{name} is a tombstone leaf"
    assert node.has_state or node.state_lock == 0, f"{name}: state_lock on a tombstone"
    assert node.kv_lock >= node.state_lock >= 0, f"{name}: locks {node.kv_lock}, {node.state_lock}"
    assert node.kv_lock == node.state_lock + child_locks, (
        f"{name}: kv_lock {node.kv_lock} != state_lock {node.state_lock} + children {child_locks}"
    )
