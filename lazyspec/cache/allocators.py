"""Free lists for the two device pools: recurrent-state slots and KV pages.

Both are plain Python + numpy (no jax): the scheduler calls them between device steps. Id 0
is the null slot / null page in both pools; padded batch lanes point at it, so it is never
handed out. Neither allocator evicts anything by itself: a caller that gets ``None`` decides
whether to evict from the radix cache and retry.

KV rows are addressed at token level: row ``page * page_size + offset`` of the flat KV pool.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import numpy as np


def _as_id_array(ids: Iterable[int] | np.ndarray) -> np.ndarray:
    """``ids`` as a 1-D int64 array (from any iterable of ints or an array)."""
    array = (ids if isinstance(ids, np.ndarray) else np.asarray(list(ids))).reshape(-1)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.dtype.kind not in "iu":  # np.issubdtype costs microseconds per call
        raise ValueError(f"ids must be integers, got {array[:4].tolist()} ({array.dtype})")
    return array.astype(np.int64, copy=False)


class _IdFreeList:
    """A free list over ids ``1..capacity``; the shared core of both allocators.

    ``_free_stack`` holds the free ids (popped from the end, so fresh pools hand out 1, 2, ...)
    and ``_is_free[i]`` mirrors membership for O(1) double-free checks.
    """

    def __init__(self, capacity: int, what: str) -> None:
        if not isinstance(capacity, (int, np.integer)) or capacity < 1:
            raise ValueError(f"number of {what}s must be a positive integer, got {capacity!r}")
        self._capacity = int(capacity)
        self._what = what
        self._free_stack: list[int] = list(range(self._capacity, 0, -1))
        self._is_free = np.ones(self._capacity + 1, dtype=bool)
        self._is_free[0] = False  # the null id is never free and never allocated

    def take(self, n: int) -> list[int] | None:
        """Pop ``n`` free ids, or return None (and change nothing) if fewer are free."""
        if not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"cannot allocate {n!r} {self._what}s")
        stack, n = self._free_stack, int(n)
        if n > len(stack):
            return None
        if n == 0:
            return []
        ids = stack[-n:][::-1]  # the order n pops would give, in one slice
        del stack[-n:]
        self._is_free[ids] = False
        return ids

    def give_back(self, ids: np.ndarray) -> None:
        """Return ``ids`` to the free list; validates all of them before changing anything."""
        if ids.size == 0:
            return
        bad = ids[(ids < 1) | (ids > self._capacity)]
        if bad.size:
            raise ValueError(f"{self._what} id {int(bad[0])} is out of range 1..{self._capacity}")
        unique, counts = np.unique(ids, return_counts=True)
        if (counts > 1).any():
            repeated = int(unique[counts > 1][0])
            raise ValueError(f"{self._what} id {repeated} freed twice in one call")
        already = ids[self._is_free[ids]]
        if already.size:
            raise ValueError(f"{self._what} id {int(already[0])} is already free (double free)")
        self._is_free[ids] = True
        self._free_stack.extend(int(i) for i in ids[::-1])

    @property
    def num_free(self) -> int:
        return len(self._free_stack)

    def is_allocated(self, ids: Iterable[int] | np.ndarray) -> np.ndarray:
        """Boolean mask: which of ``ids`` are currently handed out (False for out-of-range)."""
        array = _as_id_array(ids)
        in_range = (array >= 1) & (array <= self._capacity)
        result = np.zeros(array.shape, dtype=bool)
        result[in_range] = ~self._is_free[array[in_range]]
        return result

    def allocated_ids(self) -> np.ndarray:
        """All ids currently handed out, ascending (int64)."""
        mask = ~self._is_free
        mask[0] = False
        return np.flatnonzero(mask).astype(np.int64)

    def check_integrity(self) -> None:
        """AssertionError with detail if the stack and the mask disagree."""
        what, stack = self._what, np.asarray(self._free_stack, dtype=np.int64)
        assert len(set(self._free_stack)) == len(stack), f"{what} free list holds duplicates"
        outside = stack[(stack < 1) | (stack > self._capacity)]
        assert outside.size == 0, f"{what} free list holds out-of-range ids {outside.tolist()}"
        assert not self._is_free[0], f"null {what} 0 is marked free"
        mask_ids = np.flatnonzero(self._is_free)
        assert np.array_equal(np.sort(stack), mask_ids), (
            f"{what} free list {sorted(self._free_stack)} != free mask {mask_ids.tolist()}"
        )


class SlotAllocator:
    """Recurrent-state slots ``1..num_slots``; slot 0 is the null slot."""

    def __init__(self, num_slots: int) -> None:
        self._ids = _IdFreeList(num_slots, "slot")
        self.num_slots = int(num_slots)

    @property
    def num_free(self) -> int:
        return self._ids.num_free

    @property
    def num_used(self) -> int:
        return self.num_slots - self._ids.num_free

    def alloc(self, n: int = 1) -> list[int] | None:
        """``n`` free slot ids, or None (nothing allocated) if fewer than ``n`` are free."""
        return self._ids.take(n)

    def free(self, slot_ids: Iterable[int]) -> None:
        """Return slots; ValueError (and nothing freed) on 0, out-of-range or double free."""
        self._ids.give_back(_as_id_array(slot_ids))

    def is_allocated(self, slot_ids: Iterable[int]) -> np.ndarray:
        return self._ids.is_allocated(slot_ids)

    def allocated_ids(self) -> np.ndarray:
        return self._ids.allocated_ids()

    def check_integrity(self) -> None:
        self._ids.check_integrity()


class KVAllocator:
    """KV pages ``1..num_pages`` of ``page_size`` token rows each; page 0 is the null page."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if not isinstance(page_size, (int, np.integer)) or page_size < 1:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        self._pages = _IdFreeList(num_pages, "page")
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)

    @property
    def num_free_pages(self) -> int:
        return self._pages.num_free

    @property
    def num_free_tokens(self) -> int:
        return self._pages.num_free * self.page_size

    def alloc_pages(self, n: int) -> np.ndarray | None:
        """``n`` free page ids (int32), or None (nothing allocated) if fewer are free."""
        pages = self._pages.take(n)
        return None if pages is None else np.asarray(pages, dtype=np.int32)

    def free_pages(self, pages: Iterable[int] | np.ndarray) -> None:
        """Return pages; ValueError (and nothing freed) on 0, out-of-range or double free."""
        self._pages.give_back(_as_id_array(pages))

    def free_token_indices(self, kv_indices: np.ndarray) -> None:
        """Free the whole pages covered by token-level rows ``kv_indices``.

        ``kv_indices`` must be a concatenation of whole pages, each ``page * page_size +
        arange(page_size)``; anything else is a ValueError and frees nothing.
        """
        self.free_pages(self.token_indices_to_pages(kv_indices))

    def token_indices_to_pages(self, kv_indices: np.ndarray) -> np.ndarray:
        """Page ids (int64) of whole-page token rows; ValueError if not whole, aligned pages."""
        rows = _as_id_array(kv_indices)
        if rows.size % self.page_size:
            raise ValueError(
                f"{rows.size} KV indices do not cover whole pages of size {self.page_size}"
            )
        per_page = rows.reshape(-1, self.page_size)
        pages = per_page[:, 0] // self.page_size
        expected = pages[:, None] * self.page_size + np.arange(self.page_size)
        broken = np.flatnonzero((per_page != expected).any(axis=1))
        if broken.size:
            raise ValueError(
                f"KV indices {per_page[broken[0]].tolist()} are not one page-aligned page"
            )
        return pages

    def pages_to_token_indices(self, pages: Iterable[int] | np.ndarray) -> np.ndarray:
        """Token-level rows (int32) of ``pages``, in order."""
        page_ids = _as_id_array(pages)
        if self.page_size == 1:
            return page_ids.astype(np.int32)
        rows = page_ids[:, None] * self.page_size + np.arange(self.page_size)
        return rows.reshape(-1).astype(np.int32)

    def is_allocated(self, pages: Iterable[int] | np.ndarray) -> np.ndarray:
        return self._pages.is_allocated(pages)

    def allocated_pages(self) -> np.ndarray:
        return self._pages.allocated_ids()

    def check_integrity(self) -> None:
        self._pages.check_integrity()


class CacheHolder(Protocol):
    """What ``check_all`` needs from the prefix cache."""

    def cached_slot_ids(self) -> list[int]: ...

    def cached_pages(self) -> np.ndarray: ...

    def check_integrity(self) -> None: ...

    # with a host tier (``host`` not None): the host ids the tree holds, and ``host``'s
    # allocators (``kv``, ``slots``) and ids held for copies in flight (``orphaned_*``)
    host: Any

    def cached_host_slot_ids(self) -> list[int]: ...

    def cached_host_pages(self) -> np.ndarray: ...


def check_all(
    kv_allocator: KVAllocator,
    slot_allocator: SlotAllocator,
    tree: CacheHolder,
    in_use_slots: Iterable[int],
    in_use_pages: Iterable[int],
) -> None:
    """AssertionError unless every slot and page is exactly one of free / cached / in use.

    ``in_use_*`` are the ids owned by running requests and *not* by the tree (pages a request
    shares with the tree through a match are the tree's). With a host tier, every host slot
    and page is exactly one of free / cached / held for a copy in flight. Also runs every
    integrity check.
    """
    kv_allocator.check_integrity()
    slot_allocator.check_integrity()
    tree.check_integrity()
    _check_partition(
        "slot",
        slot_allocator.allocated_ids(),
        slot_allocator.num_free,
        slot_allocator.num_slots,
        tree.cached_slot_ids(),
        in_use_slots,
    )
    _check_partition(
        "page",
        kv_allocator.allocated_pages(),
        kv_allocator.num_free_pages,
        kv_allocator.num_pages,
        tree.cached_pages(),
        in_use_pages,
    )
    host = getattr(tree, "host", None)
    if host is None:
        return
    host.kv.check_integrity()
    host.slots.check_integrity()
    slots, kv = host.slots, host.kv
    cached, orphaned = tree.cached_host_slot_ids(), host.orphaned_slot_ids()
    _check_partition(
        "host slot", slots.allocated_ids(), slots.num_free, slots.num_slots, cached, orphaned
    )
    cached_pages, orphaned_pages = tree.cached_host_pages(), host.orphaned_pages()
    _check_partition(
        "host page",
        kv.allocated_pages(),
        kv.num_free_pages,
        kv.num_pages,
        cached_pages,
        orphaned_pages,
    )


def _check_partition(
    what: str,
    allocated: np.ndarray,
    num_free: int,
    total: int,
    cached: Iterable[int],
    in_use: Iterable[int],
) -> None:
    cached_ids = _as_id_array(cached)
    in_use_ids = _as_id_array(in_use)
    held = np.concatenate([cached_ids, in_use_ids])
    unique, counts = np.unique(held, return_counts=True)
    assert (counts == 1).all(), (
        f"{what}s {unique[counts > 1].tolist()} are held twice (cached and/or in use)"
    )
    leaked = np.setdiff1d(allocated, unique)
    assert leaked.size == 0, f"{what}s {leaked.tolist()} are allocated but not cached or in use"
    loose = np.setdiff1d(unique, allocated)
    assert loose.size == 0, f"{what}s {loose.tolist()} are held but free in the allocator"
    assert num_free + len(cached_ids) + len(in_use_ids) == total, (
        f"{what}s: free {num_free} + cached {len(cached_ids)} + in use {len(in_use_ids)} != {total}"
    )
