"""SlotAllocator / KVAllocator free lists and the free + cached + in-use accounting check."""

from __future__ import annotations

import numpy as np
import pytest

from lazyspec.cache.allocators import KVAllocator, SlotAllocator, check_all


class _FakeTree:
    """Minimal cache holder for ``check_all``: fixed cached slots and pages."""

    def __init__(self, slots: list[int], pages: list[int]) -> None:
        self.slots, self.pages = slots, np.asarray(pages, dtype=np.int64)

    def cached_slot_ids(self) -> list[int]:
        return self.slots

    def cached_pages(self) -> np.ndarray:
        return self.pages

    def check_integrity(self) -> None:
        pass


def test_slot_alloc_hands_out_distinct_nonzero_ids_until_empty() -> None:
    slots = SlotAllocator(5)
    first = slots.alloc(3)
    second = slots.alloc(2)
    assert sorted(first + second) == [1, 2, 3, 4, 5]
    assert slots.num_free == 0 and slots.num_used == 5
    assert slots.alloc(1) is None
    assert slots.alloc(0) == []
    slots.check_integrity()


def test_slot_alloc_failure_changes_nothing() -> None:
    slots = SlotAllocator(4)
    held = slots.alloc(3)
    assert slots.alloc(2) is None
    assert slots.num_free == 1
    assert slots.alloc(1) == [next(i for i in range(1, 5) if i not in held)]


@pytest.mark.parametrize("bad", [[0], [7], [-1], [2.5], [None]])
def test_slot_free_rejects_null_and_out_of_range(bad: list[int]) -> None:
    slots = SlotAllocator(6)
    slots.alloc(6)
    with pytest.raises(ValueError, match=str(bad[0])):
        slots.free(bad)
    assert slots.num_free == 0


def test_slot_double_free_is_rejected_atomically() -> None:
    slots = SlotAllocator(6)
    ids = slots.alloc(4)
    slots.free([ids[0]])
    with pytest.raises(ValueError, match="double free"):
        slots.free([ids[1], ids[0]])  # ids[1] must not be freed either
    assert slots.num_free == 3
    assert slots.is_allocated([ids[1]]).tolist() == [True]
    with pytest.raises(ValueError, match="twice"):
        slots.free([ids[2], ids[2]])
    assert slots.num_free == 3
    slots.check_integrity()


def test_slot_allocator_against_a_set_model() -> None:
    rng = np.random.default_rng(7)
    slots = SlotAllocator(12)
    held: set[int] = set()
    for _ in range(300):
        if rng.random() < 0.55:
            n = int(rng.integers(0, 5))
            got = slots.alloc(n)
            if n > 12 - len(held):
                assert got is None
            else:
                assert len(got) == n and not (set(got) & held) and all(1 <= s <= 12 for s in got)
                held |= set(got)
        elif held:
            size = int(rng.integers(1, len(held) + 1))
            chosen = rng.choice(sorted(held), size=size, replace=False)
            slots.free(chosen.tolist())
            held -= set(chosen.tolist())
        assert slots.num_free == 12 - len(held)
        assert slots.allocated_ids().tolist() == sorted(held)
        slots.check_integrity()


def test_slot_check_integrity_detects_corruption() -> None:
    slots = SlotAllocator(4)
    slots.alloc(2)
    slots._ids._free_stack.append(slots._ids._free_stack[0])  # a duplicate free entry
    with pytest.raises(AssertionError, match="duplicates"):
        slots.check_integrity()


@pytest.mark.parametrize("bad", [0, -3, 2.5])
def test_constructors_reject_bad_sizes(bad: object) -> None:
    with pytest.raises(ValueError):
        SlotAllocator(bad)
    with pytest.raises(ValueError):
        KVAllocator(bad, 4)
    with pytest.raises(ValueError):
        KVAllocator(4, bad)


@pytest.mark.parametrize("page_size", [1, 4])
def test_kv_alloc_pages_and_free_token_indices(page_size: int) -> None:
    kv = KVAllocator(10, page_size)
    pages = kv.alloc_pages(4)
    assert pages.dtype == np.int32 and len(set(pages.tolist())) == 4
    assert ((pages >= 1) & (pages <= 10)).all()
    assert kv.num_free_pages == 6 and kv.num_free_tokens == 6 * page_size
    assert kv.alloc_pages(7) is None and kv.num_free_pages == 6
    rows = kv.pages_to_token_indices(pages[[1, 3]])
    expected = [p * page_size + o for p in pages[[1, 3]].tolist() for o in range(page_size)]
    assert rows.tolist() == expected
    kv.free_token_indices(rows)
    assert kv.num_free_pages == 8
    assert kv.is_allocated(pages).tolist() == [True, False, True, False]
    with pytest.raises(ValueError, match="double free"):
        kv.free_token_indices(rows)
    kv.check_integrity()


def test_kv_free_token_indices_rejects_partial_or_misaligned_pages() -> None:
    kv = KVAllocator(8, 4)
    page = int(kv.alloc_pages(1)[0])
    with pytest.raises(ValueError, match="whole pages"):
        kv.free_token_indices(np.arange(3) + page * 4)
    with pytest.raises(ValueError, match="page-aligned"):
        kv.free_token_indices(np.arange(4) + page * 4 + 1)
    with pytest.raises(ValueError, match="page-aligned"):
        kv.free_token_indices(np.array([page * 4, page * 4 + 2, page * 4 + 1, page * 4 + 3]))
    assert kv.num_free_pages == 7  # nothing was freed by the rejected calls
    with pytest.raises(ValueError, match="out of range"):
        kv.free_token_indices(np.arange(4))  # the null page
    kv.free_token_indices(np.arange(4) + page * 4)
    assert kv.num_free_pages == 8


def test_check_all_accepts_an_exact_partition() -> None:
    kv, slots = KVAllocator(6, 2), SlotAllocator(5)
    pages, slot_ids = kv.alloc_pages(4).tolist(), slots.alloc(3)
    check_all(kv, slots, _FakeTree(slot_ids[:1], pages[:2]), slot_ids[1:], pages[2:])


def test_check_all_detects_leaks_double_holds_and_loose_ids() -> None:
    kv, slots = KVAllocator(6, 2), SlotAllocator(5)
    pages, slot_ids = kv.alloc_pages(4).tolist(), slots.alloc(3)
    with pytest.raises(AssertionError, match=f"slots \\[{slot_ids[2]}\\] are allocated"):
        check_all(kv, slots, _FakeTree(slot_ids[:1], pages[:2]), slot_ids[1:2], pages[2:])
    with pytest.raises(AssertionError, match="held twice"):
        check_all(kv, slots, _FakeTree(slot_ids[:2], pages[:3]), slot_ids[1:], pages[2:])
    free_page = next(p for p in range(1, 7) if p not in pages)
    with pytest.raises(AssertionError, match="free in the allocator"):
        check_all(
            kv, slots, _FakeTree(slot_ids[:1], pages[:2]), slot_ids[1:], pages[2:] + [free_page]
        )
