"""RequestCache: running requests' KV rows and pages, and their one way into the radix tree.

Host-only (no jax). It owns the request-to-token table (one row of KV indices per running
request), the free request rows, the requests' own KV pages and their locks on the tree;
``SlotPolicy`` owns the state slots. ``cache_req`` is the only code that inserts a request
into the tree.

The table has a device copy (the runner's ``Pools.req_to_token``), kept equal by deltas:
every write goes through ``_write``, which records the entries it changed; ``take_updates``
hands a step the changed entries of the rows it reads, with their current values. An entry
changed twice is sent once, so the order in which a step applies its updates is free.

A request's token positions, who owns each range's KV, and what ``cache_req`` does with it
(running: ``finished=False``, at finish: ``finished=True``):

| positions            | KV owner                               | running         | at finish     |
|----------------------|----------------------------------------|-----------------|---------------|
| [0, prefix_len)      | the tree (matched, prefix_node locked) | lock moves on   | lock dropped  |
| [prefix_len, length) | the request (own_pages)                | to the tree     | to the tree   |
| [length, end)        | the request (own_pages)                | kept            | freed         |

``length`` is the donated checkpoint's length (the state slot holds the state after
exactly ``length`` tokens; whole pages by construction); without a donation nothing is
inserted and ``length`` = ``prefix_len``.

``end`` grows: admission gives the prompt's pages and the run-past headroom
(``pages_needed``), each decode step the
pages up to its committed length plus the run-past headroom (``pages_to_cover`` /
``grow``). A retracted request ends with ``drop``: everything it owns goes back, nothing
enters the tree.
"""

from __future__ import annotations

import numpy as np

from lazyspec.cache.allocators import KVAllocator, SlotAllocator
from lazyspec.cache.radix_cache import MatchResult, RadixCache
from lazyspec.scheduler.layout import Layout
from lazyspec.scheduler.request import NO_SLOT, Req


class RequestCache:
    def __init__(
        self, layout: Layout, tree: RadixCache, kv: KVAllocator, slots: SlotAllocator
    ) -> None:
        self.layout = layout
        self.tree = tree
        self.kv = kv
        self.slots = slots
        self.page_size = layout.page_size
        self.req_to_token = np.zeros((layout.num_req_rows, layout.context_len), np.int32)
        # the entries changed since the device copy last received them, as flat indices
        # (row * context_len + position) of the table, each listed once (``_is_pending``)
        self._pending: list[np.ndarray] = []
        self._is_pending = np.zeros(self.req_to_token.size, bool)
        # per row: entries past this are zero (what the next admission must clear)
        self._row_extent = np.zeros(layout.num_req_rows, np.int64)
        self.free_rows = list(range(layout.max_running, 0, -1))

    # ------------------------------------------------------------------ queries

    def pages_needed(self, req: Req, fill_len: int, prefix_len: int) -> int:
        """KV pages allocated at admission: the prompt past the matched prefix and the
        run-past headroom (the last prefill step drafts past the prompt). Decode steps
        add pages as they reach them (``pages_to_cover`` / ``grow``)."""
        need = min(fill_len + self.layout.run_past_headroom, self.layout.context_len)
        return max(-(-(need - prefix_len) // self.page_size), 0)

    def covered_len(self, req: Req) -> int:
        """Token positions of ``req``'s row that have KV rows: the prefix, then its pages."""
        return req.prefix_len + len(req.own_pages) * self.page_size

    def pages_to_cover(self, req: Req, length: int) -> int:
        """Pages ``grow`` must add so that positions [0, length) have KV rows (a query)."""
        length = min(length, self.layout.context_len)
        return max(-(-(length - self.covered_len(req)) // self.page_size), 0)

    @property
    def num_available_pages(self) -> int:
        """Free pages plus those eviction could free now (a query)."""
        return self.kv.num_free_pages + self.tree.num_evictable_kv_tokens // self.page_size

    def fits(
        self, match: MatchResult, num_slots: int, num_pages: int, reserved_tokens: int = 0
    ) -> bool:
        """Whether a free row, ``num_slots`` slots and ``num_pages`` pages can be had with
        ``reserved_tokens`` more KV tokens still to spare, counting what eviction could
        free once ``match.node`` is locked. Changes nothing."""
        if not self.free_rows:
            return False
        lock_slots, lock_tokens = self.tree.lock_cost(match.node)
        slots = self.slots.num_free + self.tree.num_evictable_slots - lock_slots
        tokens = self.tree.num_evictable_kv_tokens - lock_tokens
        pages = self.kv.num_free_pages + tokens // self.page_size
        spare_tokens = (pages - num_pages) * self.page_size
        return slots >= num_slots and pages >= num_pages and spare_tokens >= reserved_tokens

    # ------------------------------------------------------------------ admission

    def load_cost(self, match: MatchResult) -> tuple[int, int]:
        """(slots, pages) that loading ``match``'s host-only part takes on the device
        (``RadixCache.load``); a query."""
        return int(match.load_state), match.load_tokens // self.page_size

    def reserve(self, match: MatchResult, num_slots: int, num_pages: int) -> MatchResult:
        """Lock the matched node, evict until the slots and pages are free (``fits`` said
        they can be), then bring the match's host-only part to the device (its load takes
        ``load_cost(match)`` of them, counted in ``num_slots`` / ``num_pages``). Returns the
        match as it is now on the device."""
        self.tree.inc_lock(match.node)
        if self.slots.num_free < num_slots:
            self.tree.evict_state(num_slots - self.slots.num_free)
        if self.kv.num_free_pages < num_pages:
            self.tree.evict_kv((num_pages - self.kv.num_free_pages) * self.page_size)
        assert self.slots.num_free >= num_slots and self.kv.num_free_pages >= num_pages
        return self.tree.load(match) if self.tree.host is not None else match

    def admit(self, req: Req, match: MatchResult, num_pages: int) -> None:
        """Give ``req`` a row, its pages after the matched prefix, and the prefix fields."""
        page_ids = self.kv.alloc_pages(num_pages)
        req.req_row = self.free_rows.pop()
        req.prefix_node = match.node
        req.prefix_len = match.prefix_len
        if not req.num_retractions:  # a resumed request reports its first admission's hit
            req.cached_tokens = match.prefix_len
        offsets = np.arange(self.page_size, dtype=np.int32)
        own = (page_ids[:, None] * self.page_size + offsets[None, :]).reshape(-1)
        end = min(match.prefix_len + len(own), self.layout.context_len)
        row = req.req_row
        stale = max(int(self._row_extent[row]) - end, 0)  # the previous holder's entries
        values = [match.kv_indices, own[: end - match.prefix_len], np.zeros(stale, np.int32)]
        self._write(row, 0, np.concatenate(values))
        self._row_extent[row] = end
        req.own_pages = page_ids

    # ------------------------------------------------------------------ decode growth

    def grow(self, reqs: list[Req], lengths: list[int], counts: list[int] | None = None) -> None:
        """Mutates: give each request the pages ``pages_to_cover(req, length)`` says (its
        ``counts`` entry, if the caller has them), in one allocation and one table write,
        evicting cached KV if needed (``num_available_pages`` said there are enough)."""
        if counts is None:
            counts = [self.pages_to_cover(req, n) for req, n in zip(reqs, lengths)]
        total = sum(counts)
        if total == 0:
            return
        if self.kv.num_free_pages < total:
            self.tree.evict_kv((total - self.kv.num_free_pages) * self.page_size)
        page_ids = self.kv.alloc_pages(total)
        assert page_ids is not None, "grow() without the pages it needs"
        tokens = self.kv.pages_to_token_indices(page_ids)
        growing = [(req, count) for req, count in zip(reqs, counts) if count]
        req_rows = np.array([req.req_row for req, _ in growing], np.int64)
        starts = np.array([self.covered_len(req) for req, _ in growing], np.int64)
        if self.page_size == 1 and total == len(growing):
            # a decode step's usual growth: one token's page per row, entry (row, start)
            for i, (req, _) in enumerate(growing):
                _append_pages(req, page_ids[i : i + 1])
            self._row_extent[req_rows] = np.maximum(self._row_extent[req_rows], starts + 1)
            self._write_entries(req_rows, starts, tokens)
            return
        pages = np.array([count for _, count in growing], np.int64)
        first = np.cumsum(pages) - pages  # each request's first page in ``page_ids``
        for (req, count), at in zip(growing, first):
            _append_pages(req, page_ids[at : at + count])
        ends = np.minimum(starts + pages * self.page_size, self.layout.context_len)
        lengths = ends - starts
        # entry i of request r: position starts[r] + j and token row first[r] * page + j,
        # with j = i - (entries before r)
        before = np.cumsum(lengths) - lengths
        j = np.arange(int(lengths.sum())) - np.repeat(before, lengths)
        positions = np.repeat(starts, lengths) + j
        values = tokens[np.repeat(first * self.page_size, lengths) + j]
        self._row_extent[req_rows] = np.maximum(self._row_extent[req_rows], ends)
        self._write_entries(np.repeat(req_rows, lengths), positions, values)

    def drop(self, req: Req) -> None:
        """Mutates: give back ``req``'s pages, prefix lock and row with nothing inserted into
        the tree (a retracted request: its KV past the prefix is recomputed on resume)."""
        self.cache_req(req, 0, NO_SLOT, finished=True)
        req.own_pages = None
        req.prefix_node = None
        req.req_row = 0

    # ------------------------------------------------------------------ insertion

    def cache_req(self, req: Req, length: int, slot: int, finished: bool) -> bool:
        """Insert ``req``'s first ``length`` tokens with ``slot`` (the state after them; NO_SLOT
        = none) into the tree, then keep running on the tree's copy (``finished=False``) or
        give everything else back (``finished=True``). Returns whether the tree took the
        slot (if not, the caller still owns it)."""
        row = self.req_to_token[req.req_row]
        taken = False
        inserted = length > req.prefix_len
        if inserted:
            result = self.tree.insert(req.all_ids[:length], row[:length].copy(), slot)
            taken = result.state_taken and slot != NO_SLOT
        if not finished:
            if inserted:
                self._continue_from_tree(req, length)
            return taken
        owned_start = length if inserted else req.prefix_len
        total = req.prefix_len + len(req.own_pages) * self.page_size
        if total > owned_start:
            first_page = (owned_start - req.prefix_len) // self.page_size
            self.kv.free_pages(req.own_pages[first_page:])
        self.tree.dec_lock(req.prefix_node)
        self.free_rows.append(req.req_row)
        return taken

    def _continue_from_tree(self, req: Req, length: int) -> None:
        """After a running request's insert: its first ``length`` tokens are the tree's."""
        match = self.tree.match_prefix(req.all_ids[:length])
        assert match.prefix_len == length, (match.prefix_len, length)
        self._write(req.req_row, 0, match.kv_indices)  # our duplicate pages may have been freed
        self.tree.inc_lock(match.node)
        self.tree.dec_lock(req.prefix_node)
        req.own_pages = req.own_pages[(length - req.prefix_len) // self.page_size :]
        req.prefix_node, req.prefix_len = match.node, length

    # ------------------------------------------------------------------ the table

    def _write(self, row: int, start: int, values: np.ndarray) -> None:
        """Mutates: ``req_to_token[row, start:start + len(values)] = values`` (see
        ``_write_entries``)."""
        positions = np.arange(start, start + len(values))
        self._write_entries(np.full(len(values), row, np.int64), positions, values)

    def _write_entries(self, rows: np.ndarray, positions: np.ndarray, values: np.ndarray) -> None:
        """Mutates: ``req_to_token[rows, positions] = values`` (distinct entries), recording
        the changed ones for the device copy. The only writer of the table."""
        # flat indices and no sort: in the engine's loop a 2-D fancy index or a sort of a
        # few entries costs tens of microseconds a step (their code runs cold), a flat take
        # or put a few
        table, keys = self.req_to_token.reshape(-1), rows * self.layout.context_len + positions
        changed = table.take(keys) != values
        if changed.any():
            keys = keys[changed]
            table.put(keys, values[changed])
            new = keys[~self._is_pending.take(keys)]
            if new.size:
                self._is_pending.put(new, True)
                self._pending.append(new)

    def take_updates(self, rows: list[int]) -> np.ndarray:
        """Mutates: the pending updates of ``rows`` (each row once), ``[3, n]`` int32 of
        (row, position, KV row) with the table's current values; they are no longer
        pending. A step takes those of the rows it reads before it reads them."""
        return self._updates(rows, consume=True)

    def pending_updates(self) -> np.ndarray:
        """Every pending update, as ``take_updates`` would give it; reads only."""
        return self._updates(None, consume=False)

    def _updates(self, rows: list[int] | None, consume: bool) -> np.ndarray:
        """The pending entries of ``rows`` (None: all), each once, in the order they were
        first changed, with the table's current values."""
        if not self._pending:
            return np.zeros((3, 0), np.int32)
        keys = self._pending[0] if len(self._pending) == 1 else np.concatenate(self._pending)
        width = self.layout.context_len
        if rows is not None:  # a lookup over the table's rows (np.isin sorts)
            asked = np.zeros(self.req_to_token.shape[0], bool)
            asked[rows] = True
            wanted = asked.take(keys // width)
            rest, keys = keys[~wanted], keys[wanted]
        else:
            rest = keys[:0]
        if consume:
            self._pending = [rest] if rest.size else []
            self._is_pending.put(keys, False)
        updates = np.empty((3, keys.size), np.int32)
        updates[0], updates[1] = keys // width, keys % width
        updates[2] = self.req_to_token.reshape(-1).take(keys)
        return updates


def _append_pages(req: Req, pages: np.ndarray) -> None:
    """Mutates: ``req.own_pages`` followed by ``pages``, amortised O(len(pages)): appended
    in place into ``req.page_buffer`` while ``own_pages`` is still its prefix and it has room
    (at page size 1 a decode step adds a page per row, and copying the whole list each time
    cost O(context) per row per step), else copied into a buffer of twice the length.
    ``req.page_buffer`` is (buffer, the view of it last given as ``own_pages``): ``own_pages``
    is still that view unless something else set it since."""
    own = req.own_pages
    buffer, view = req.page_buffer or (None, None)
    end = len(own) + len(pages)
    if own is not view or len(buffer) < end:
        buffer = np.empty(max(2 * end, 16), own.dtype)
        buffer[: len(own)] = own
    buffer[len(own) : end] = pages
    req.own_pages = buffer[:end]
    req.page_buffer = (buffer, req.own_pages)
