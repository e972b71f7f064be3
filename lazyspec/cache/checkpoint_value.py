"""What a cached recurrent-state checkpoint is worth: the ranking of the ``"value"`` policy.

Host-only (no jax). A checkpoint holds one state slot, and it pays only when a later request
matches it as its deepest cached state. Its worth is

    value = prefill tokens it saves  x  likelihood of a hit

* **tokens saved**: the node's prefix length minus that of its nearest ancestor holding a
  state: without it, a request matching through it falls back to that ancestor and
  recomputes the difference (the marginal saving, per slot held).
* **likelihood**: its place in the state LRU, from 1/n (least recent) to 1 (most recent).

Checkpoints are ranked in two classes, and every *superseded* checkpoint goes before any
other: a state whose only way on (a single child, then single children) reaches another
state before any branch. A request through it goes on to the deeper state unless it leaves
the path in between, and no cached request does: the checkpoints a request leaves behind
as it goes on (its earlier prefill chunks, its prompt once it crossed a decode boundary,
the previous turn of a conversation) are superseded, while a branch point (a prefix that
two cached continuations share) is not. A running request's new checkpoint counts as
superseded (the same request supersedes it as it goes on): it may evict only superseded
checkpoints worth less than itself, and is declined otherwise (``RadixCache.fresh_worth``).

The same ranking in the Marconi paper's terms: admission (a running request's checkpoint
is declined rather than evicting one worth more) and FLOP-aware eviction (recency weighted
by the prefill work a state saves), with the prefill work counted in tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lazyspec.cache.radix_cache import TreeNode


@dataclass(frozen=True, order=True)
class Worth:
    """Orders checkpoints for eviction: the smallest goes first."""

    kept: int  # 0: superseded on its own path (goes first); 1: may be a path's deepest hit
    value: float  # prefill tokens saved x likelihood of a hit

    @classmethod
    def of(cls, saved_tokens: int, recency: float, superseded: bool) -> Worth:
        return cls(0 if superseded else 1, float(saved_tokens) * recency)


def rank_states(
    root: TreeNode, state_lru: Mapping[int, TreeNode], host: bool = False
) -> list[tuple[Worth, TreeNode]]:
    """Every unlocked node below ``root`` with a device state, with its worth, the least
    worth first (``state_lru``: node id -> node, least recent first). A state only on the
    host still saves its tokens to the nodes below it. With ``host``, every node with a
    host state instead, locked or not, and ``state_lru`` the host LRU (the host tier's
    eviction order; ``evict_host`` decides what may go). Reads only."""
    recency = {node_id: (i + 1) / len(state_lru) for i, node_id in enumerate(state_lru)}
    ranked = []
    stack = [(child, 0, 0) for child in root.children.values()]
    while stack:
        node, start, state_len = stack.pop()  # start: the prefix length above the edge
        end = start + len(node.key)
        if _ranked(node, host):
            worth = Worth.of(end - state_len, recency[node.node_id], _superseded(node))
            ranked.append((worth, node.node_id, node))
        below = end if node.has_state else state_len
        stack.extend((child, end, below) for child in node.children.values())
    ranked.sort(key=lambda entry: entry[:2])  # node ids break ties: nodes never compare
    return [(worth, node) for worth, _, node in ranked]


def _ranked(node: TreeNode, host: bool) -> bool:
    if host:
        return node.host_slot is not None
    return node.state_slot is not None and node.state_lock == 0


def _superseded(node: TreeNode) -> bool:
    """Whether ``node``'s only way on reaches a state before any branch."""
    while len(node.children) == 1:
        (node,) = node.children.values()
        if node.has_state:
            return True
    return False
