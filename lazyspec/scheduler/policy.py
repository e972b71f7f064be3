"""SlotPolicy: the one owner of a request's recurrent-state slots and of what it donates.

Host-only (no jax). One mechanism serves decode with and without speculation: a decode
step advances 1..D tokens, so a crossing of a multiple of I is known only after the step.
Before each step (``plan_*``) the target slot is chosen and recorded with the step; after
its results (``settle_*``) the crossing is confirmed and the slots are relabelled. Under
the overlapped loop the in-flight step's records decide what is safe to donate.

Strategies (``strategy.py``; DESIGN §6-§7):
* ``no_buffer``: no checkpoints while decoding; the prompt's last chunk also writes its final
  state into a fresh slot (held as ``spare`` until inserted at prefill end), and the working
  slot is donated at finish.
* ``extra_buffer``: keep + spare (ping-pong); a crossing writes the spare, then they swap.
* ``extra_buffer_lazy``: keep only; a spare is borrowed (never by eviction) when the next
  boundary is within 2*D tokens of the committed length; a crossing into the spare promotes
  it and frees the old keep; with no spare the keep slot is written in place.

``SlotPolicy`` is the only writer of ``Req.slots`` and the only code that allocates or frees
a request's slots. The scheduler calls, in a request's life:

| call                              | when                        | mutates                        |
|-----------------------------------|-----------------------------|--------------------------------|
| ``slots_needed()``                | admission query             | nothing                        |
| ``admit(req, source_slot)``       | admission (slots checked)   | allocates the pinned slots     |
| ``chunk_donation(req)``           | before the next chunk's plan | nothing                       |
| ``plan_extend`` / ``plan_decode`` | before each step            | may allocate / borrow a slot   |
| ``settle_extend`` / ``settle_decode`` | after the step's results | relabels / frees slots        |
| ``donation(req, inflight, ...)``  | before a tree insert        | nothing                        |
| ``take_keep(req, length)``        | prefill checkpoint insert   | swaps in a fresh keep slot     |
|                                   |                             | (no_buffer: hands over spare)  |
| ``give_back(slot)``               | the tree refused a donation | frees it                       |
| ``release(req, kept)``            | finish                      | frees all but ``kept``         |
| ``retract(req, inflight)``        | retraction                  | frees all but in-flight targets|
| ``free_retired(record)``          | that in-flight step settled | frees its target               |
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace

from lazyspec.cache.allocators import SlotAllocator
from lazyspec.cache.checkpoint_value import Worth
from lazyspec.scheduler.request import NO_SLOT, Phase, Req, ReqSlots
from lazyspec.scheduler.strategy import Strategy

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowRecord:
    """What one step may write for one request, fixed when the step is planned."""

    req: Req
    target_slot: int  # checkpoint slot this step writes on a crossing (NO_SLOT = none)
    in_place: bool  # target is the keep slot (lazy fallback, or a prefill checkpoint)
    track_len: int | None = None  # extend: the checkpoint length written (known at plan)
    start: int = 0  # extend: position of the chunk's first token
    num_new: int = 0  # extend: tokens in this chunk
    is_last_chunk: bool = False
    source_slot: int = NO_SLOT  # extend: where this chunk reads its initial state
    track_chunk: int = -1  # extend: chunk index of the checkpoint state (-1 = none)
    copy_slot: int = NO_SLOT  # extend: also receives the final state (no_buffer's last chunk)


@dataclass(frozen=True)
class Donation:
    """A slot the tree may take: it holds the state after exactly ``length`` tokens."""

    length: int
    slot: int


class SlotPolicy:
    def __init__(
        self,
        strategy: Strategy,
        interval: int,
        num_verify: int,
        slots: SlotAllocator,
        tree=None,
        grid: int | None = None,
        fail_spare_alloc: bool = False,
        evict_on_failure: bool = False,
    ) -> None:
        self.strategy = strategy
        self.interval = interval
        self.grid = grid  # prefill checkpoint grid; None = the scan chunk
        self.num_verify = num_verify
        self.slots = slots
        self.tree = tree
        self.fail_spare_alloc = fail_spare_alloc
        self.evict_on_failure = evict_on_failure
        self.num_spare_failures = 0
        self.num_declined_inserts = 0  # running requests' checkpoints the tree had no slot for

    # ------------------------------------------------------------------ admission

    def slots_needed(self) -> int:
        """Slots admission must find for a new request (query)."""
        return self.strategy.pinned_slots

    def admit(self, req: Req, source_slot: int) -> None:
        """Allocate a newly admitted request's pinned slots; the next extend reads its state
        from ``source_slot`` (a cached node's slot, or NO_SLOT = zeros). The caller has made
        sure ``slots_needed()`` slots are free."""
        assert not req.slots.retired, "admit() before the retracted slots were freed"
        slot_ids = self.slots.alloc(self.slots_needed())
        assert slot_ids is not None, "admit() without the free slots it needs"
        checkpoints = self.strategy.checkpoint_slots
        req.slots = ReqSlots(
            working=slot_ids[0],
            keep=slot_ids[1] if checkpoints >= 1 else NO_SLOT,
            spare=slot_ids[2] if checkpoints >= 2 else NO_SLOT,
            source=source_slot,
        )

    # ------------------------------------------------------------------ plan

    def plan_extend(
        self, req: Req, start: int, num_new: int, chunk: int, is_last_chunk: bool
    ) -> RowRecord:
        """An extend chunk's record. Its checkpoint sits on the prefill grid G (a multiple of
        the scan chunk and the page): at ``start + (num_new // G) * G`` when that is past
        ``start``, written in place into the keep slot (relabelled when the result is
        processed; a chunk before the last one is donated when the next chunk is planned,
        ``chunk_donation``). no_buffer's last chunk ALLOCATES a slot (evicting a state worth
        less, as ``take_keep``; without one the prompt is not inserted) that also receives
        the final state, held as ``spare`` until the prefill-end insert.
        Later chunks read their state from the working slot."""
        slots = req.slots
        record = RowRecord(
            req, NO_SLOT, False, None, start, num_new, is_last_chunk, source_slot=slots.source
        )
        slots.source = slots.working
        slots.chunk_track_len = None
        if self.strategy.donates_working and is_last_chunk:
            copy = self._alloc_evicting(self._fresh_worth(req, start + num_new))
            if copy is None:
                return record
            slots.spare = copy
            return replace(record, copy_slot=copy)
        if not self.strategy.tracks:
            return record
        grid = self.grid or chunk
        assert grid % chunk == 0, (grid, chunk)  # checkpoints are chunk states
        checkpoint = start + (num_new // grid) * grid
        if checkpoint <= start:
            return record
        slots.chunk_track_len = None if is_last_chunk else checkpoint
        return replace(
            record,
            target_slot=slots.keep,
            in_place=True,
            track_len=checkpoint,
            track_chunk=(checkpoint - start) // chunk - 1,
        )

    def plan_decode(self, req: Req) -> RowRecord:
        """Choose this decode step's checkpoint target (DESIGN §7 'plan'). For lazy, may
        ALLOCATE a spare slot (never by eviction) when a boundary is near."""
        slots = req.slots
        if not self.strategy.tracks:
            return RowRecord(req, NO_SLOT, False)
        if not self.strategy.borrows_spare:
            return RowRecord(req, slots.spare, False)
        next_boundary = (req.seq_len // self.interval + 1) * self.interval
        if next_boundary - req.seq_len > 2 * self.num_verify:
            return RowRecord(req, NO_SLOT, False)  # no crossing is possible this step
        if slots.spare == NO_SLOT:
            slots.spare = self._borrow_spare()
        if slots.spare != NO_SLOT:
            return RowRecord(req, slots.spare, False)
        return RowRecord(req, slots.keep, True)

    def _borrow_spare(self) -> int:
        if self.fail_spare_alloc:
            self.num_spare_failures += 1
            return NO_SLOT
        got = self.slots.alloc(1)
        if got is None and self.evict_on_failure and self.tree is not None:
            self.tree.evict_state(1)
            got = self.slots.alloc(1)
        if got is None:
            self.num_spare_failures += 1
            return NO_SLOT
        return got[0]

    # ------------------------------------------------------------------ settle

    def settle_extend(self, record: RowRecord) -> None:
        """Relabel the keep slot with the chunk's checkpoint, unless the checkpoint already
        went to the tree (``chunk_donation``: the keep slot was swapped since)."""
        slots = record.req.slots
        if record.track_len is not None and record.target_slot == slots.keep:
            slots.last_track_len = record.track_len

    def settle_decode(
        self, record: RowRecord, crossed: bool, boundary: int, finishing: bool
    ) -> None:
        """Apply a decode step's confirmed crossing (DESIGN §7 'update')."""
        slots = record.req.slots
        if not crossed or record.target_slot == NO_SLOT:
            return
        if record.in_place:
            if finishing:
                slots.keep_clobbered = True  # holds a state past last_track_len
            else:
                slots.last_track_len = boundary
            return
        if finishing:
            return  # never promote for a finishing request
        if self.strategy.borrows_spare:
            if slots.keep != NO_SLOT:
                self.slots.free([slots.keep])
            slots.keep, slots.spare = slots.spare, NO_SLOT
        else:
            slots.keep, slots.spare = slots.spare, slots.keep
        slots.last_track_len = boundary

    # ------------------------------------------------------------------ donation

    def donation(self, req: Req, inflight: Iterable[RowRecord], finished: bool) -> Donation | None:
        """The slot the tree may take from ``req`` now, with the length its state covers, or
        None (a query). A finishing ``donates_working`` request donates its working slot,
        a running one its prefill-end copy (the whole prompt); otherwise the keep slot, only
        if it provably holds the state at ``last_track_len`` and no in-flight step may still
        write it."""
        slots = req.slots
        if self.strategy.donates_working:
            if finished and req.phase is Phase.DECODE:
                if req.seq_len > len(req.all_ids):
                    return None  # a K-step program ran past the end: no prefix's state
                return Donation(req.seq_len, slots.working)
            if not finished and slots.spare != NO_SLOT:
                return Donation(len(req.fill_ids), slots.spare)
            return None
        if not self.strategy.tracks or slots.last_track_len is None or slots.keep == NO_SLOT:
            return None
        if slots.keep_clobbered:
            return None
        if any(r.req is req and r.target_slot == slots.keep for r in inflight):
            return None
        return Donation(slots.last_track_len, slots.keep)

    def chunk_donation(self, req: Req) -> Donation | None:
        """The checkpoint of ``req``'s previous prefill chunk, to insert before its next chunk
        is planned (a query). The step writing it may still run: that is safe, as every
        later step runs after it and the next chunk writes a fresh keep slot
        (``take_keep``)."""
        slots = req.slots
        if slots.chunk_track_len is None or slots.keep == NO_SLOT:
            return None
        return Donation(slots.chunk_track_len, slots.keep)

    def take_keep(self, req: Req, length: int) -> int | None:
        """Hand the keep slot (the state after ``length`` tokens) to the caller (for the tree)
        and give the still-running request a fresh one: a free slot, else one the tree
        evicts for it. Under the ``"value"`` eviction policy the tree evicts only a state
        worth less than this checkpoint, which the same request supersedes as it goes on
        (``RadixCache.fresh_worth``): the insert is declined rather than evicting another
        conversation's checkpoint for it. None (nothing changed) when no slot can be had.
        no_buffer hands over its prefill-end copy (``spare``) instead."""
        slots = req.slots
        slots.chunk_track_len = None
        if self.strategy.donates_working:
            taken, slots.spare = slots.spare, NO_SLOT
            return taken if taken != NO_SLOT else None
        fresh = self._alloc_evicting(self._fresh_worth(req, length))
        if fresh is None:
            self.num_declined_inserts += 1
            return None
        taken, slots.keep, slots.last_track_len = slots.keep, fresh, None
        return taken

    def _fresh_worth(self, req: Req, length: int) -> Worth | None:
        """What ``req``'s checkpoint at ``length`` is worth to the tree (None: no limit)."""
        return None if self.tree is None else self.tree.fresh_worth(length - req.prefix_len)

    def _alloc_evicting(self, below: Worth | None = None) -> int | None:
        """One slot, evicting a cached state (worth less than ``below``, if given) if none is
        free; None when none can be had."""
        fresh = self.slots.alloc(1)
        if fresh is None and self.tree is not None:
            self.tree.evict_state(1, below=below)
            fresh = self.slots.alloc(1)
        return None if fresh is None else fresh[0]

    def give_back(self, slot: int) -> None:
        """Free a slot handed out by ``take_keep`` that the tree did not take."""
        self.slots.free([slot])

    def release(self, req: Req, kept: int = NO_SLOT) -> None:
        """Free every slot ``req`` holds except ``kept`` (now the tree's)."""
        slots = req.slots
        self.slots.free([s for s in slots.owned() if s != kept])
        slots.working = slots.keep = slots.spare = NO_SLOT

    def retract(self, req: Req, inflight: Iterable[RowRecord]) -> None:
        """Mutates: free every slot of retracted ``req`` but the checkpoint targets of its
        in-flight steps (``inflight``), which move to ``slots.retired`` until
        ``free_retired``: a checkpoint target of a launched step is never handed out again
        before that step is processed (its working slot is: no later step runs before
        it on the device). Nothing is donated."""
        writing = {r.target_slot for r in inflight if r.req is req}
        owned = req.slots.owned()
        self.slots.free([s for s in owned if s not in writing])
        req.slots = ReqSlots(retired=tuple(s for s in owned if s in writing))

    def free_retired(self, record: RowRecord) -> None:
        """Mutates: the step of ``record`` is processed; free its target if ``record.req``
        was retracted while it was in flight."""
        slots = record.req.slots
        if record.target_slot in slots.retired:
            self.slots.free([record.target_slot])
            slots.retired = tuple(s for s in slots.retired if s != record.target_slot)
