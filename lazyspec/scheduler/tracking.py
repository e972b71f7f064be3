"""Checkpoint strategies: which slot each step may write, and what settles after it.

Host-only (no jax). One mechanism serves decode with and without speculation: a decode
step advances 1..D tokens, so a crossing of a multiple of I is known only after the step.
Before each step (``plan_*``) the target slot is chosen and recorded with the step; after
its results (``settle_*``) the crossing is confirmed and the slots are relabelled. Under
the overlapped loop the in-flight step's records decide what is safe to donate at finish.

Strategies (DESIGN §6-§7):
* ``no_buffer``: no checkpoints while running; the working slot is donated at finish.
* ``extra_buffer``: keep + spare (ping-pong); a crossing writes the spare, then they swap.
* ``extra_buffer_lazy``: keep only; a spare is borrowed (never by eviction) when the next
  boundary is within 2*D tokens of the committed length; a crossing into the spare promotes
  it and frees the old keep; with no spare the keep slot is written in place.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from lazyspec.cache.allocators import SlotAllocator
from lazyspec.scheduler.request import NO_SLOT, Req

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowRecord:
    """What one step may write for one request, fixed when the step is planned."""

    req: Req
    target_slot: int  # checkpoint slot this step writes on a crossing (NO_SLOT = none)
    in_place: bool  # target is the keep slot (lazy fallback, or a prefill checkpoint)
    track_len: int | None = None  # extend: the checkpoint length written (known at plan)
    num_new: int = 0  # extend: tokens in this chunk
    is_last_chunk: bool = False


class CheckpointTracker:
    def __init__(
        self,
        strategy: str,
        interval: int,
        num_verify: int,
        slots: SlotAllocator,
        tree=None,
        fail_spare_alloc: bool = False,
        evict_on_failure: bool = False,
    ) -> None:
        self.strategy = strategy
        self.interval = interval
        self.num_verify = num_verify
        self.slots = slots
        self.tree = tree
        self.fail_spare_alloc = fail_spare_alloc
        self.evict_on_failure = evict_on_failure
        self.num_spare_failures = 0

    @property
    def tracking(self) -> bool:
        return self.strategy in ("extra_buffer", "extra_buffer_lazy")

    @property
    def checkpoint_slots(self) -> int:
        return {"extra_buffer": 2, "extra_buffer_lazy": 1}.get(self.strategy, 0)

    # ------------------------------------------------------------------ admission

    def assign_admission_slots(self, req: Req, slot_ids: list[int]) -> None:
        """Give a newly admitted request its working (+ checkpoint) slots."""
        req.working_slot = slot_ids[0]
        if self.checkpoint_slots >= 1:
            req.keep_slot = slot_ids[1]
        if self.checkpoint_slots == 2:
            req.spare_slot = slot_ids[2]
        req.last_track_len = None

    # ------------------------------------------------------------------ plan

    def plan_extend(
        self, req: Req, start: int, num_new: int, chunk: int, is_last_chunk: bool
    ) -> tuple[RowRecord, int]:
        """In-prompt checkpoint: the last multiple of I in (start, start+num_new].

        Written in place into the keep slot (it is relabelled when the result is
        processed). Returns (record, chunk index of the checkpoint state or -1).
        """
        track_len = None
        if self.tracking:
            end = start + num_new
            ckpt = (end // self.interval) * self.interval
            if ckpt > start and (ckpt - start) % chunk == 0:
                track_len = ckpt
        if track_len is None:
            return RowRecord(req, NO_SLOT, False, None, num_new, is_last_chunk), -1
        record = RowRecord(req, req.keep_slot, True, track_len, num_new, is_last_chunk)
        return record, (track_len - start) // chunk - 1

    def plan_decode(self, req: Req) -> RowRecord:
        """Choose this decode step's checkpoint target (DESIGN §7 'plan')."""
        if not self.tracking:
            return RowRecord(req, NO_SLOT, False)
        if self.strategy == "extra_buffer":
            return RowRecord(req, req.spare_slot, False)
        next_boundary = (req.seq_len // self.interval + 1) * self.interval
        if next_boundary - req.seq_len > 2 * self.num_verify:
            return RowRecord(req, NO_SLOT, False)  # no crossing is possible this step
        if req.spare_slot == NO_SLOT:
            req.spare_slot = self._borrow_spare()
        if req.spare_slot != NO_SLOT:
            return RowRecord(req, req.spare_slot, False)
        return RowRecord(req, req.keep_slot, True)

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
        if record.track_len is not None:
            record.req.last_track_len = record.track_len

    def settle_decode(
        self, record: RowRecord, crossed: bool, boundary: int, finishing: bool
    ) -> None:
        """Apply a decode step's confirmed crossing (DESIGN §7 'update')."""
        req = record.req
        if not crossed or record.target_slot == NO_SLOT:
            return
        if record.in_place:
            if finishing:
                req.keep_clobbered = True  # holds a state past last_track_len
            else:
                req.last_track_len = boundary
            return
        if finishing:
            return  # never promote for a finishing request
        if self.strategy == "extra_buffer":
            req.keep_slot, req.spare_slot = req.spare_slot, req.keep_slot
        else:
            if req.keep_slot != NO_SLOT:
                self.slots.free([req.keep_slot])
            req.keep_slot, req.spare_slot = req.spare_slot, NO_SLOT
        req.last_track_len = boundary

    def keep_is_donatable(self, req: Req, inflight: list[RowRecord]) -> bool:
        """True iff the keep slot provably holds the state at ``last_track_len`` and no
        in-flight step may still write it."""
        if not self.tracking or req.last_track_len is None or req.keep_slot == NO_SLOT:
            return False
        if req.keep_clobbered:
            return False
        return not any(r.req is req and r.target_slot == req.keep_slot for r in inflight)
