"""Plan / settle decisions of the checkpoint tracker on scripted cases (DESIGN §6-§7)."""

from __future__ import annotations

import pytest

from lazyspec.cache.allocators import SlotAllocator
from lazyspec.scheduler.request import NO_SLOT, Req, SamplingParams
from lazyspec.scheduler.tracking import CheckpointTracker

INTERVAL, D = 16, 4


def _req(seq_len: int, keep: int, spare: int = NO_SLOT, last: int | None = 0) -> Req:
    req = Req(rid="r", input_ids=[1], sampling=SamplingParams())
    req.seq_len, req.keep_slot, req.spare_slot, req.last_track_len = seq_len, keep, spare, last
    return req


def _lazy(slots: SlotAllocator, fail: bool = False) -> CheckpointTracker:
    return CheckpointTracker("extra_buffer_lazy", INTERVAL, D, slots, fail_spare_alloc=fail)


@pytest.mark.parametrize(
    "seq_len,reachable", [(7, False), (8, True), (15, True), (16, False), (24, True)]
)
def test_lazy_window_is_2d_inclusive(seq_len, reachable):
    slots = SlotAllocator(8)
    keep = slots.alloc(1)[0]
    record = _lazy(slots).plan_decode(_req(seq_len, keep))
    assert (record.target_slot != NO_SLOT) == reachable
    assert slots.num_free == (6 if reachable else 7)  # a spare is borrowed only in the window
    if reachable:
        assert not record.in_place and record.target_slot not in (keep, NO_SLOT)


def test_existing_spare_is_reused():
    slots = SlotAllocator(8)
    keep, spare = slots.alloc(2)
    req = _req(12, keep, spare)
    record = _lazy(slots).plan_decode(req)
    assert record.target_slot == spare and slots.num_free == 6


def test_allocation_failure_targets_keep_in_place_without_eviction():
    slots = SlotAllocator(1)
    keep = slots.alloc(1)[0]
    tracker = _lazy(slots)
    record = tracker.plan_decode(_req(12, keep))
    assert record.in_place and record.target_slot == keep
    assert tracker.num_spare_failures == 1
    forced = _lazy(SlotAllocator(8), fail=True).plan_decode(_req(12, 3))
    assert forced.in_place and forced.target_slot == 3


def test_promote_frees_old_keep():
    slots = SlotAllocator(8)
    keep = slots.alloc(1)[0]
    tracker = _lazy(slots)
    req = _req(14, keep, last=0)
    record = tracker.plan_decode(req)
    spare = record.target_slot
    tracker.settle_decode(record, crossed=True, boundary=16, finishing=False)
    assert (req.keep_slot, req.spare_slot, req.last_track_len) == (spare, NO_SLOT, 16)
    assert slots.num_free == 7  # the old keep slot went back


def test_no_crossing_keeps_the_spare():
    slots = SlotAllocator(8)
    keep = slots.alloc(1)[0]
    tracker = _lazy(slots)
    req = _req(10, keep, last=0)
    record = tracker.plan_decode(req)
    tracker.settle_decode(record, crossed=False, boundary=0, finishing=False)
    assert (
        req.spare_slot == record.target_slot and req.keep_slot == keep and req.last_track_len == 0
    )


def test_in_place_crossing_relabels_while_running_and_blocks_donation_when_finishing():
    slots = SlotAllocator(1)
    keep = slots.alloc(1)[0]
    tracker = _lazy(slots)
    running = _req(14, keep, last=0)
    record = tracker.plan_decode(running)
    tracker.settle_decode(record, crossed=True, boundary=16, finishing=False)
    assert running.last_track_len == 16 and tracker.keep_is_donatable(running, [])
    finishing = _req(14, keep, last=0)
    record = tracker.plan_decode(finishing)
    tracker.settle_decode(record, crossed=True, boundary=16, finishing=True)
    assert finishing.last_track_len == 0 and not tracker.keep_is_donatable(finishing, [])


def test_finishing_never_promotes_and_inflight_in_place_blocks_insert():
    slots = SlotAllocator(8)
    keep = slots.alloc(1)[0]
    tracker = _lazy(slots)
    req = _req(14, keep, last=0)
    record = tracker.plan_decode(req)
    tracker.settle_decode(record, crossed=True, boundary=16, finishing=True)
    assert req.keep_slot == keep and req.last_track_len == 0
    assert tracker.keep_is_donatable(req, [])
    # finishing inside the window while the in-flight step may write keep in place
    exhausted = _lazy(SlotAllocator(8), fail=True)
    req2 = _req(12, 5, last=0)
    inflight = [exhausted.plan_decode(req2)]
    assert not exhausted.keep_is_donatable(req2, inflight)
    assert exhausted.keep_is_donatable(req2, [])


def test_extra_buffer_swaps_ping_pong():
    slots = SlotAllocator(8)
    keep, spare = slots.alloc(2)
    tracker = CheckpointTracker("extra_buffer", INTERVAL, D, slots)
    req = _req(30, keep, spare, last=16)
    record = tracker.plan_decode(req)
    assert record.target_slot == spare
    tracker.settle_decode(record, crossed=True, boundary=32, finishing=False)
    assert (req.keep_slot, req.spare_slot, req.last_track_len) == (spare, keep, 32)
    assert slots.num_free == 6
