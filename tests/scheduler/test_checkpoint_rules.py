"""Checkpoint rules of DESIGN §7 driven through the scheduler with fake step results (no
device): under the overlapped loop (each step's results processed after the next step
is planned) and with real, not forced, slot shortages."""

from __future__ import annotations

from lazyspec.scheduler.request import NO_SLOT
from tests.scheduler.test_scheduler import Pools, _req, fake_results


def _overlapped(pools: Pools, num_steps: int, on_step=None) -> None:
    """``num_steps`` iterations of the overlapped loop: plan and launch step n+1, then
    process step n with step n+1's records in flight. ``on_step(previous, plan)`` sees
    each pair after the processing."""
    previous = None
    for _ in range(num_steps):
        plan = pools.sched.schedule()
        if previous is not None:
            inflight = plan.records if plan is not None else []
            results = fake_results(previous, pools.num_verify, 5, 1)
            pools.sched.process(previous, results, inflight)
        if on_step is not None:
            on_step(previous, plan)
        previous = plan
        if plan is None:
            return


def test_spare_allocation_failure_never_evicts_a_cached_checkpoint():
    """Lazy near a boundary with no free slot and the tree full of evictable checkpoints:
    the spare allocation fails for real, nothing is evicted, the boundary is written in
    place (DESIGN §6: a transient slot is never worth a cached checkpoint)."""
    pools = Pools("extra_buffer_lazy", num_slots=4, max_running=1)
    policy, tree = pools.sched.policy, pools.tree
    first = _req("a", 40, max_new=2)
    pools.sched.add(first)
    while not first.finished:
        pools.step()
    second = _req("b", 40, max_new=30, seed=1)
    pools.sched.add(second)
    while not second.output_ids:
        pools.step()
    # every slot is pinned by the running request or holds a cached checkpoint (32 of each
    # prompt, on the prefill grid G = 16), and the tree could give them up
    assert pools.slots.num_free == 0 and tree.num_cached_slots == 2
    assert tree.num_evictable_slots == 1  # the other prompt's checkpoint (its own is locked)
    cached = sorted(tree.cached_slot_ids())
    in_place = []
    while not second.finished:
        plan = pools.sched.schedule()
        in_place += [r for r in plan.records if r.in_place]
        results = fake_results(plan, pools.num_verify, 5, 1)
        pools.sched.process(plan, results, inflight=())
        if not second.finished:
            assert sorted(tree.cached_slot_ids()) == cached  # nothing evicted while running
    assert policy.num_spare_failures > 0 and in_place  # the failure was real and hit
    assert not policy.fail_spare_alloc
    pools.check_idle()


def test_finish_after_in_place_write_is_not_donated_when_a_slot_came_free():
    """Request a's finishing verify writes its keep slot in place (no spare could be had),
    while b's finish frees slots, so the step in flight behind a's finish targets a fresh
    spare, not the keep slot: the in-flight guard does not apply, and only
    ``keep_clobbered`` keeps the overwritten keep slot out of the tree."""
    pools = Pools("extra_buffer_lazy", num_slots=4, max_running=2)
    tree = pools.tree
    # both prefill in one step; their in-prompt checkpoints (32) stay in the keep slots (no
    # slot for the tree's copy). a crosses 64 in the step that finishes it (committed
    # 40 + 24 tokens; 25 outputs); b finishes one step earlier.
    a, b = _req("a", 40, max_new=25), _req("b", 40, max_new=24, seed=1)
    pools.sched.add(a)
    pools.sched.add(b)
    seen = {}

    def on_step(previous, plan):
        if previous is None or previous.kind != "decode":
            return
        rows = {r.req.rid: r for r in previous.records}
        if a.finished and "a_finish" not in seen:
            inflight = {r.req.rid: r for r in plan.records} if plan else {}
            seen["a_finish"] = (rows["a"], inflight.get("a"))
        if b.finished and "b_finish" not in seen:
            seen["b_finish"] = previous

    _overlapped(pools, 200, on_step)
    assert a.finished and b.finished
    finishing, inflight = seen["a_finish"]
    # the finishing step wrote a's keep slot in place and crossed 64 ...
    assert finishing.in_place
    # ... while the step in flight behind it writes a spare borrowed from b's freed slots
    assert inflight is not None and not inflight.in_place and inflight.target_slot != NO_SLOT
    assert a.slots.keep_clobbered
    assert finishing.target_slot not in tree.cached_slot_ids()  # a's keep was not donated
    assert tree.match_prefix(a.all_ids).prefix_len == 0
    pools.check_idle()
