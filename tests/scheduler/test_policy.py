"""Slot policy decisions on scripted cases (DESIGN §6-§7): plan / settle, donation,
admission and release per strategy."""

from __future__ import annotations

import pytest

from lazyspec.cache.allocators import SlotAllocator
from lazyspec.scheduler.policy import Donation, SlotPolicy
from lazyspec.scheduler.request import NO_SLOT, Phase, Req, ReqSlots, SamplingParams
from lazyspec.scheduler.strategy import (
    EXTRA_BUFFER,
    EXTRA_BUFFER_LAZY,
    NO_BUFFER,
    NONE,
    STRATEGIES,
)

INTERVAL, D = 16, 4


def _req(seq_len: int, keep: int, spare: int = NO_SLOT, last: int | None = 0) -> Req:
    req = Req(rid="r", input_ids=[1], sampling=SamplingParams())
    req.seq_len = seq_len
    req.slots = ReqSlots(keep=keep, spare=spare, last_track_len=last)
    return req


def _lazy(slots: SlotAllocator, fail: bool = False) -> SlotPolicy:
    return SlotPolicy(EXTRA_BUFFER_LAZY, INTERVAL, D, slots, fail_spare_alloc=fail)


def _lazy_keeping(num_slots: int = 8) -> tuple[SlotAllocator, int, SlotPolicy]:
    """(slots, a keep slot taken from them, a lazy policy over them)."""
    slots = SlotAllocator(num_slots)
    keep = slots.alloc(1)[0]
    return slots, keep, _lazy(slots)


def _settled(policy: SlotPolicy, req: Req, **settle: bool | int):
    """``req``'s decode planned, then settled (``settle``: ``settle_decode``'s crossed,
    boundary and finishing); its record."""
    record = policy.plan_decode(req)
    policy.settle_decode(record, **settle)
    return record


def _donatable(policy: SlotPolicy, req: Req, inflight) -> bool:
    return policy.donation(req, inflight, finished=True) is not None


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
    slots, keep, tracker = _lazy_keeping(1)
    record = tracker.plan_decode(_req(12, keep))
    assert record.in_place and record.target_slot == keep
    assert tracker.num_spare_failures == 1
    forced = _lazy(SlotAllocator(8), fail=True).plan_decode(_req(12, 3))
    assert forced.in_place and forced.target_slot == 3


def test_promote_frees_old_keep():
    slots, keep, tracker = _lazy_keeping()
    req = _req(14, keep, last=0)
    record = tracker.plan_decode(req)
    spare = record.target_slot
    tracker.settle_decode(record, crossed=True, boundary=16, finishing=False)
    assert (req.slots.keep, req.slots.spare, req.slots.last_track_len) == (spare, NO_SLOT, 16)
    assert slots.num_free == 7  # the old keep slot went back


def test_no_crossing_keeps_the_spare():
    slots, keep, tracker = _lazy_keeping()
    req = _req(10, keep, last=0)
    record = _settled(tracker, req, crossed=False, boundary=0, finishing=False)
    assert (
        req.slots.spare == record.target_slot
        and req.slots.keep == keep
        and req.slots.last_track_len == 0
    )


def test_in_place_crossing_relabels_while_running_and_blocks_donation_when_finishing():
    slots, keep, tracker = _lazy_keeping(1)
    running = _req(14, keep, last=0)
    _settled(tracker, running, crossed=True, boundary=16, finishing=False)
    assert running.slots.last_track_len == 16 and _donatable(tracker, running, [])
    finishing = _req(14, keep, last=0)
    _settled(tracker, finishing, crossed=True, boundary=16, finishing=True)
    assert finishing.slots.last_track_len == 0 and not _donatable(tracker, finishing, [])


def test_finishing_never_promotes_and_inflight_in_place_blocks_insert():
    slots, keep, tracker = _lazy_keeping()
    req = _req(14, keep, last=0)
    _settled(tracker, req, crossed=True, boundary=16, finishing=True)
    assert req.slots.keep == keep and req.slots.last_track_len == 0
    assert _donatable(tracker, req, [])
    # finishing inside the window while the in-flight step may write keep in place
    exhausted = _lazy(SlotAllocator(8), fail=True)
    req2 = _req(12, 5, last=0)
    inflight = [exhausted.plan_decode(req2)]
    assert not _donatable(exhausted, req2, inflight)
    assert _donatable(exhausted, req2, [])


def test_extra_buffer_swaps_ping_pong():
    slots = SlotAllocator(8)
    keep, spare = slots.alloc(2)
    tracker = SlotPolicy(EXTRA_BUFFER, INTERVAL, D, slots)
    req = _req(30, keep, spare, last=16)
    record = tracker.plan_decode(req)
    assert record.target_slot == spare
    tracker.settle_decode(record, crossed=True, boundary=32, finishing=False)
    assert (req.slots.keep, req.slots.spare, req.slots.last_track_len) == (spare, keep, 32)
    assert slots.num_free == 6


def test_strategy_table_matches_the_design():
    # slots pinned per running request (working + checkpoints): no_buffer 1, extra_buffer 3,
    # lazy 2 (+1 transient spare); DESIGN §6
    assert [STRATEGIES[n].pinned_slots for n in ("none", "no_buffer", "extra_buffer")] == [1, 1, 3]
    assert (EXTRA_BUFFER_LAZY.pinned_slots, EXTRA_BUFFER_LAZY.peak_slots) == (2, 3)
    assert [s.tracks for s in (NONE, NO_BUFFER, EXTRA_BUFFER, EXTRA_BUFFER_LAZY)] == [
        False,
        False,
        True,
        True,
    ]


@pytest.mark.parametrize("strategy", [NONE, NO_BUFFER, EXTRA_BUFFER, EXTRA_BUFFER_LAZY])
def test_admit_pins_the_strategys_slots_and_release_frees_them(strategy):
    slots = SlotAllocator(8)
    policy = SlotPolicy(strategy, INTERVAL, D, slots)
    req = _req(0, NO_SLOT, last=None)
    policy.admit(req, source_slot=7)
    owned = req.slots.owned()
    assert len(owned) == policy.slots_needed() == strategy.pinned_slots
    assert req.slots.source == 7 and req.slots.working == owned[0]
    assert (req.slots.keep != NO_SLOT) == (strategy.checkpoint_slots >= 1)
    assert (req.slots.spare != NO_SLOT) == (strategy.checkpoint_slots == 2)
    assert slots.num_free == 8 - strategy.pinned_slots
    policy.release(req, kept=owned[-1])
    assert slots.num_free == 7 and req.slots.owned() == []


def test_no_buffer_donates_the_working_slot_only_at_finish_in_decode():
    slots = SlotAllocator(8)
    policy = SlotPolicy(NO_BUFFER, INTERVAL, D, slots)
    req = _req(0, NO_SLOT, last=None)
    policy.admit(req, source_slot=NO_SLOT)
    req.input_ids, req.output_ids, req.seq_len, req.phase = [1] * 10, [2, 3], 11, Phase.DECODE
    donation = policy.donation(req, [], finished=True)
    assert (donation.length, donation.slot) == (11, req.slots.working)
    req.seq_len = 12  # a K-step program's state ending on the last token: still a prefix's
    assert policy.donation(req, [], finished=True).length == 12
    req.seq_len = 13  # one past the request's 12 tokens: the state of no prefix
    assert policy.donation(req, [], finished=True) is None
    assert policy.donation(req, [], finished=False) is None
    req.phase = Phase.PREFILL
    assert policy.donation(req, [], finished=True) is None


def test_take_keep_hands_over_the_keep_slot_and_installs_a_fresh_one():
    slots = SlotAllocator(3)
    policy = SlotPolicy(EXTRA_BUFFER_LAZY, INTERVAL, D, slots)
    req = _req(0, NO_SLOT, last=None)
    policy.admit(req, source_slot=NO_SLOT)
    old_keep = req.slots.keep
    req.slots.last_track_len = 16
    assert policy.donation(req, [], finished=False).slot == old_keep
    assert policy.take_keep(req, 16) == old_keep
    assert req.slots.keep not in (old_keep, NO_SLOT) and req.slots.last_track_len is None
    policy.give_back(old_keep)  # the tree did not take it
    assert slots.num_free == 1
    assert policy.take_keep(req, 16) is not None and slots.num_free == 0
    assert policy.take_keep(req, 16) is None  # no slot and no tree to evict from: unchanged


def test_extend_checkpoint_is_on_the_prefill_grid():
    """A chunk's checkpoint is ``start + (num_new // G) * G`` (G = lcm(scan chunk, page)),
    whatever the track interval; a chunk shorter than G has none."""
    slots = SlotAllocator(8)
    policy = SlotPolicy(EXTRA_BUFFER, INTERVAL, D, slots, grid=16)
    req = _req(0, NO_SLOT, last=None)
    policy.admit(req, source_slot=5)
    first = policy.plan_extend(req, start=0, num_new=40, chunk=8, is_last_chunk=False)
    assert (first.track_len, first.track_chunk, first.target_slot) == (32, 3, req.slots.keep)
    assert first.in_place and first.source_slot == 5
    assert policy.chunk_donation(req) == Donation(32, req.slots.keep)  # before the next chunk
    second = policy.plan_extend(req, start=40, num_new=20, chunk=8, is_last_chunk=True)
    assert (second.track_len, second.track_chunk) == (56, 1)  # 40 + 16, not a multiple of G
    assert second.source_slot == req.slots.working  # later chunks continue from working
    assert policy.chunk_donation(req) is None  # the last chunk's goes in at prefill end
    third = policy.plan_extend(req, start=60, num_new=15, chunk=8, is_last_chunk=True)
    assert third.track_len is None and third.target_slot == NO_SLOT
    policy.settle_extend(first)
    assert req.slots.last_track_len == 32


def test_settled_chunk_checkpoint_taken_by_the_tree_is_not_relabelled():
    """Once the tree took the previous chunk's keep slot (``take_keep`` before the next
    chunk), that chunk's late result must not relabel the fresh keep slot."""
    slots = SlotAllocator(8)
    policy = SlotPolicy(EXTRA_BUFFER_LAZY, INTERVAL, D, slots, grid=8)
    req = _req(0, NO_SLOT, last=None)
    policy.admit(req, source_slot=NO_SLOT)
    first = policy.plan_extend(req, start=0, num_new=16, chunk=8, is_last_chunk=False)
    taken = policy.take_keep(req, 16)
    assert taken == first.target_slot != req.slots.keep
    policy.settle_extend(first)
    assert req.slots.last_track_len is None


def test_no_buffer_last_chunk_copies_its_final_state():
    slots = SlotAllocator(4)
    policy = SlotPolicy(NO_BUFFER, INTERVAL, D, slots)
    req = _req(0, NO_SLOT, last=None)
    req.fill_ids = list(range(30))
    policy.admit(req, source_slot=NO_SLOT)
    first = policy.plan_extend(req, start=0, num_new=16, chunk=8, is_last_chunk=False)
    assert first.copy_slot == NO_SLOT and first.target_slot == NO_SLOT
    last = policy.plan_extend(req, start=16, num_new=14, chunk=8, is_last_chunk=True)
    assert last.copy_slot == req.slots.spare != NO_SLOT
    assert policy.donation(req, [], finished=False) == Donation(30, last.copy_slot)
    assert policy.take_keep(req, 30) == last.copy_slot and req.slots.spare == NO_SLOT
