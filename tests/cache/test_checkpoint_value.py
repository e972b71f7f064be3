"""The value policy's ranking (cache/checkpoint_value.py) and its eviction in the tree:
superseded checkpoints first, a branch point is not superseded, tokens saved are counted
from the nearest cached ancestor, locked states are never taken, and a fresh checkpoint
evicts only a state worth less than itself."""

from __future__ import annotations

import pytest

from lazyspec.cache.checkpoint_value import Worth, rank_states
from lazyspec.cache.radix_cache import RadixCache
from tests.cache.test_radix_cache import Setup


def _value_setup(page_size: int = 1, num_slots: int = 16) -> Setup:
    s = Setup(page_size, num_pages=512, num_slots=num_slots)
    s.tree = RadixCache(page_size, s.kv, s.slots, eviction="value")
    return s


def _ranked(s: Setup) -> list[tuple[int, int, float]]:
    """(prefix length, class, value) of every ranked state, least worth first."""
    out = []
    for worth, node in rank_states(s.tree.root, s.tree._state_lru):
        length, walk = 0, node
        while not walk.is_root:
            length, walk = length + len(walk.key), walk.parent
        out.append((length, worth.kept, worth.value))
    return out


def test_a_state_with_a_deeper_state_on_its_only_way_on_is_superseded():
    s = _value_setup()
    base = s.tokens(32)
    s.insert(base)
    s.insert(base + s.tokens(32))  # the same path, 64 tokens deep
    # 32 is superseded (class 0); 64 saves 64 - 32 tokens and is the most recent
    assert _ranked(s) == [(32, 0, 32 * 0.5), (64, 1, 32 * 1.0)]


def test_a_branch_point_is_not_superseded():
    s = _value_setup()
    base = s.tokens(32)
    shared = base + s.tokens(16)
    s.insert(base)
    s.insert(shared + s.tokens(16))
    s.insert(shared + s.tokens(16))  # splits at 48: two continuations share 32
    ranked = _ranked(s)
    assert sorted(length for length, _, _ in ranked) == [32, 64, 64]
    # the way on from 32 branches (at 48) before it reaches a state: no state is superseded
    assert {kept for _, kept, _ in ranked} == {1}


@pytest.mark.parametrize("policy,evicted", [("value", 32), ("sglang", 100)])
def test_eviction_takes_the_superseded_state_before_an_older_leaf(policy, evicted):
    s = Setup(1, num_pages=512)
    s.tree = RadixCache(1, s.kv, s.slots, eviction=policy)
    other, _ = s.insert(s.tokens(100))  # the least recent: another conversation's
    base = s.tokens(32)
    upper, _ = s.insert(base)
    s.insert(base + s.tokens(32))
    assert s.tree.evict_state(1) == 1
    gone, kept = (upper, other) if evicted == 32 else (other, upper)
    assert gone.node.state_slot is None and kept.node.state_slot is not None
    s.check()


def test_locked_states_are_never_ranked_and_a_fresh_checkpoint_evicts_only_less():
    s = _value_setup()
    base = s.tokens(32)
    upper, _ = s.insert(base)
    lower, _ = s.insert(base + s.tokens(32))
    s.tree.inc_lock(lower.node)
    assert [length for length, _, _ in _ranked(s)] == [32]
    # a fresh checkpoint saving 8 tokens (worth 8) is worth less than the superseded 32
    # (worth 32 * 0.5): declined; one saving 64 evicts it
    assert s.tree.fresh_worth(8) == Worth(0, 8.0)
    assert s.tree.evict_state(1, below=s.tree.fresh_worth(8)) == 0
    assert upper.node.state_slot is not None
    assert s.tree.evict_state(1, below=s.tree.fresh_worth(64)) == 1
    assert upper.node.state_slot is None  # tombstoned, its KV kept
    # nothing superseded is left: the locked leaf is not a candidate
    assert s.tree.evict_state(1, below=s.tree.fresh_worth(10**6)) == 0
    s.tree.dec_lock(lower.node)
    # a fresh checkpoint never evicts a leaf that may be a path's deepest hit
    assert s.tree.evict_state(1, below=s.tree.fresh_worth(10**6)) == 0
    assert s.tree.evict_state(1) == 1  # admission may (its request must run)
    s.check()


def test_sglang_policy_has_no_fresh_worth_and_rejects_unknown_policies():
    s = Setup(1)
    assert s.tree.eviction == "sglang" and s.tree.fresh_worth(64) is None
    with pytest.raises(ValueError, match="eviction"):
        RadixCache(1, s.kv, s.slots, eviction="lfu")
