"""Admission against estimated use and retraction, on the host alone (no jax, no device).

Fake results follow a positional oracle: the token at position p is ``_token(p)``, whatever
the step that produces it, so a retracted request that resumes by recompute must continue
exactly where it stopped. The loop is driven with and without the overlapped look-ahead:
``schedule(inflight)`` plans step n+1 while step n is unprocessed."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lazyspec.cache.allocators import KVAllocator, SlotAllocator, check_all
from lazyspec.config import EngineConfig
from lazyspec.scheduler.layout import plan_memory
from lazyspec.scheduler.request import Phase, Req, SamplingParams
from lazyspec.scheduler.scheduler import Scheduler
from lazyspec.scheduler.token_ratio import (
    INIT_NEW_TOKEN_RATIO,
    MIN_NEW_TOKEN_RATIO_FACTOR,
    NEW_TOKEN_RATIO_DECAY_STEPS,
    NewTokenRatio,
)
from tests.scheduler.wiring import INTERVAL, MODEL, PAGE, small_config, wired_scheduler

TOP = 5


def _token(position: int) -> int:
    return 3 + (position * 7) % 97  # never the eos id 2; distinct over 97 positions


def _scheduler(
    num_pages: int,
    strategy: str = "extra_buffer",
    num_verify: int = 1,
    conservativeness: float = 1.0,
    max_running: int = 4,
) -> Scheduler:
    config = small_config(
        num_pages,
        24,
        max_running,
        strategy,
        num_verify,
        schedule_conservativeness=conservativeness,
    )
    layout = dataclasses.replace(
        plan_memory(config, MODEL), extend_lengths=(16, 32, 64), prefill_tokens=4 * 64
    )
    kv, slots = KVAllocator(num_pages, PAGE), SlotAllocator(layout.num_slots)
    ratio = NewTokenRatio(conservativeness)
    return wired_scheduler(layout, kv, slots, token_ratio=ratio)[1]


class Device:
    """Runs plans in launch order the way the device would: per request the committed
    length, and the oracle's tokens for the positions a step produces."""

    def __init__(self, num_verify: int, accept_len: int) -> None:
        self.num_verify, self.accept_len = num_verify, accept_len
        self.seq_len: dict[str, int] = {}

    def run(self, plan) -> dict[str, np.ndarray]:
        rows, d = len(plan.batch.req_row), self.num_verify
        if plan.kind == "extend":
            token = np.zeros(rows, np.int32)
            for b, record in enumerate(plan.records):
                end = record.start + record.num_new
                self.seq_len[record.req.rid] = end
                token[b] = _token(end)
            return {
                "token": token,
                "logprob": np.full(rows, -0.25, np.float32),
                "top_logprobs": np.full((rows, TOP), -1.0, np.float32),
                "top_ids": np.zeros((rows, TOP), np.int32),
            }
        pre, tokens = np.zeros(rows, np.int32), np.zeros((rows, d), np.int32)
        for b, record in enumerate(plan.records):
            pre[b] = self.seq_len[record.req.rid]
            tokens[b] = [_token(pre[b] + 1 + k) for k in range(d)]
            self.seq_len[record.req.rid] = pre[b] + self.accept_len
        post = pre + self.accept_len
        return {
            "tokens": tokens,
            "accept_len": np.full(rows, self.accept_len, np.int32),
            "logprobs": np.full((rows, d), -0.5, np.float32),
            "top_logprobs": np.full((rows, d, TOP), -1.0, np.float32),
            "top_ids": np.zeros((rows, d, TOP), np.int32),
            "crossed": pre // INTERVAL != post // INTERVAL,
            "pre": pre,
        }


class Loop:
    """The engine's loop on the host: plan and launch step n+1, then process step n (with
    ``overlap``), else process each step right after launching it."""

    def __init__(self, sched: Scheduler, overlap: bool, num_verify: int = 1, accept_len: int = 1):
        self.sched, self.overlap = sched, overlap
        self.device = Device(num_verify, accept_len)
        self.inflight = None  # (plan, results) launched, not processed
        self.max_running = 0

    def step(self) -> None:
        sched = self.sched
        plan = sched.schedule(self.inflight[0].records if self.inflight else ())
        self.max_running = max(self.max_running, len(sched.running))
        launched = (plan, self.device.run(plan)) if plan else None
        if not self.overlap:
            if launched:
                sched.process(*launched, inflight=())
            return
        previous, self.inflight = self.inflight, launched
        if previous:
            sched.process(*previous, inflight=launched[0].records if launched else ())

    def run(self, reqs: list[Req], limit: int = 2000) -> None:
        for _ in range(limit):
            if all(r.finished for r in reqs) and self.inflight is None:
                return
            self.step()
            check(self.sched)
        raise AssertionError("requests did not finish")


def check(sched: Scheduler) -> None:
    """Every slot and page is free, cached, or held by one running request (or retired)."""
    cache = sched.cache
    held_slots = [s for r in sched.running for s in r.slots.owned()]
    held_slots += [s for r in sched.waiting for s in r.slots.retired]
    held_pages = [int(p) for r in sched.running for p in r.own_pages]
    check_all(cache.kv, cache.slots, sched.tree, held_slots, held_pages)


def _req(rid: str, prompt_len: int, max_new: int, seed: int, stop_after: int = 0) -> Req:
    rng = np.random.default_rng(seed)
    prompt = [int(t) for t in rng.integers(3, 100, size=prompt_len)]
    stop = (_token(prompt_len + stop_after - 1),) if stop_after else ()
    params = SamplingParams(max_new, ignore_eos=True, stop_token_ids=stop)
    return Req(rid=rid, input_ids=prompt, sampling=params)


def _want(req: Req, num: int) -> list[int]:
    return [_token(len(req.input_ids) + i) for i in range(num)]


def _idle(sched: Scheduler) -> None:
    cache = sched.cache
    assert not sched.running and not sched.waiting
    check(sched)
    assert cache.kv.num_free_pages + sched.tree.num_cached_tokens // PAGE == cache.kv.num_pages


# ---------------------------------------------------------------------- admission


@pytest.mark.parametrize("overlap", [True, False])
def test_short_outputs_run_at_full_concurrency_in_a_pool_short_of_max_tokens(overlap):
    # 4 x (20 prompt + 40 max new + 3 headroom) = 252 tokens would be reserved up front;
    # the pool has 220. Estimated (0.7 x 40 per request) they all fit; each stops after 6.
    sched = _scheduler(num_pages=110)
    reqs = [_req(f"r{i}", 20, 40, seed=i, stop_after=6) for i in range(4)]
    for req in reqs:
        sched.add(req)
    loop = Loop(sched, overlap)
    loop.step()
    assert len(sched.running) == 4 and not sched.waiting  # all admitted in the first step
    loop.run(reqs)
    assert loop.max_running == 4 and sched.num_retractions == 0
    for req in reqs:
        assert req.output_ids == _want(req, 6) and req.finish_reason["type"] == "stop"
    sched.tree.flush()
    _idle(sched)


def test_the_estimate_limits_admission_while_others_run():
    # the same pool and requests with max_new 100: 0.7 x 100 each no longer fits four
    sched = _scheduler(num_pages=110)
    for i in range(4):
        sched.add(_req(f"r{i}", 20, 100, seed=i))
    sched.schedule()
    assert len(sched.running) == 2 and len(sched.waiting) == 2


# ---------------------------------------------------------------------- retraction


def _retraction_case(overlap: bool, strategy: str = "extra_buffer", num_verify: int = 1):
    """A decodes alone for a while; then B (longest prompt) and C join. The pool holds the
    three prompts with little room to grow, and an optimistic estimate admits all three."""
    sched = _scheduler(
        num_pages=56, strategy=strategy, num_verify=num_verify, conservativeness=0.01
    )
    a = _req("a", 10, 30, seed=1)
    b, c = _req("b", 60, 30, seed=2), _req("c", 12, 30, seed=3)
    loop = Loop(sched, overlap, num_verify, accept_len=max(num_verify - 1, 1))
    sched.add(a)
    for _ in range(6):
        loop.step()
    sched.add(b)
    sched.add(c)
    return sched, loop, (a, b, c)


@pytest.mark.parametrize("overlap", [True, False])
def test_retraction_takes_least_progress_first_and_resumes_exactly(overlap):
    sched, loop, reqs = _retraction_case(overlap)
    a, b, c = reqs
    while not sched.num_retractions:
        before = {r.rid: sched.tree.match_prefix(r.all_ids).prefix_len for r in reqs}
        cached = (sched.tree.num_cached_tokens, sched.tree.num_cached_slots)
        ratio = sched.token_ratio.value
        loop.step()
        check(sched)
    # b and c have the fewest outputs; b has the longer prompt
    assert sched.waiting[0] is b and b.phase is Phase.WAITING and b.num_retractions == 1
    assert b.own_pages is None and b.req_row == 0 and not b.slots.owned()
    assert b.req_row not in [r.req_row for r in sched.running]
    assert a in sched.running and c in sched.running
    # nothing of the retracted request entered the tree: not its decode checkpoint at 64
    assert b.num_retractions == 1 and len(b.all_ids) > 64
    assert 0 < sched.tree.match_prefix(b.all_ids).prefix_len == before["b"] < 64
    assert (sched.tree.num_cached_tokens, sched.tree.num_cached_slots) <= cached
    assert sched.token_ratio.value > ratio  # the estimate jumps after a retraction
    loop.run(list(reqs))
    for req in reqs:
        assert req.output_ids == _want(req, 30), req.rid
        assert req.finish_reason == {"type": "length", "length": 30}
    assert sched.num_admitted_tokens == sum(len(r.input_ids) for r in reqs)  # once each
    sched.tree.flush()
    _idle(sched)


@pytest.mark.parametrize("strategy", ["extra_buffer", "extra_buffer_lazy"])
@pytest.mark.parametrize("num_verify", [1, 3])
def test_retraction_with_the_overlapped_loop_holds_in_flight_targets(strategy, num_verify):
    sched, loop, reqs = _retraction_case(True, strategy, num_verify)
    retired_seen = False
    while not all(r.finished for r in reqs) or loop.inflight is not None:
        owned_before = {r.rid: set(r.slots.owned()) for r in sched.running}
        inflight = loop.inflight[0].records if loop.inflight else []
        plan = sched.schedule(inflight)
        for req in (r for r in reqs if r.rid in owned_before and r.phase is Phase.WAITING):
            # retracted now: what the in-flight step may write stays allocated, as retired
            targets = {r.target_slot for r in inflight if r.req is req}
            retired = targets & owned_before[req.rid]
            assert set(req.slots.retired) == retired and not req.slots.owned()
            assert sched.cache.slots.is_allocated(sorted(retired)).all()
            retired_seen |= bool(retired)
        check(sched)
        launched = (plan, loop.device.run(plan)) if plan else None
        previous, loop.inflight = loop.inflight, launched
        if previous:
            sched.process(*previous, inflight=launched[0].records if launched else ())
        assert not any(r.slots.retired for r in sched.waiting)  # freed once processed
        check(sched)
    assert sched.num_retractions
    # extra_buffer's decode steps always target the spare; lazy's only near a boundary
    assert retired_seen or strategy == "extra_buffer_lazy"
    for req in reqs:
        assert req.output_ids == _want(req, 30), req.rid


@pytest.mark.parametrize("overlap", [True, False])
def test_a_request_too_big_for_the_pool_alone_fails_alone(overlap):
    # 40 tokens of KV: "big" (20 prompt, 100 new) outgrows it; "small" runs to its end
    sched = _scheduler(num_pages=20, conservativeness=0.01)
    big, small = _req("big", 20, 100, seed=1), _req("small", 6, 4, seed=2)
    sched.add(big)
    sched.add(small)
    loop = Loop(sched, overlap)
    loop.run([big, small])
    reason = big.finish_reason
    assert reason["type"] == "abort" and reason["status_code"] == 400
    assert "does not fit in the KV pool" in reason["message"]
    assert big.output_ids == _want(big, len(big.output_ids)) and 0 < len(big.output_ids) < 100
    assert small.output_ids == _want(small, 4)
    sched.tree.flush()
    _idle(sched)


# ---------------------------------------------------------------------- the ratio


def test_new_token_ratio_decays_jumps_and_resets():
    ratio = NewTokenRatio(schedule_conservativeness=1.0)
    assert ratio.value == ratio.init == INIT_NEW_TOKEN_RATIO
    assert ratio.estimate(100) == int(100 * INIT_NEW_TOKEN_RATIO)
    for _ in range(NEW_TOKEN_RATIO_DECAY_STEPS + 10):
        ratio.step()
    assert ratio.value == pytest.approx(INIT_NEW_TOKEN_RATIO * MIN_NEW_TOKEN_RATIO_FACTOR)
    ratio.after_retraction(num_output_tokens=100, num_max_new_tokens=400, num_reqs=5)
    assert ratio.value == pytest.approx((100 + 20 * 5) / 400)
    ratio.after_retraction(num_output_tokens=900, num_max_new_tokens=400, num_reqs=5)
    assert ratio.value == 1.0
    ratio.reset()
    assert ratio.value == ratio.init
    assert NewTokenRatio(schedule_conservativeness=3.0).init == 1.0
    assert NewTokenRatio(schedule_conservativeness=0.5).init == pytest.approx(0.35)


def test_schedule_conservativeness_is_validated():
    for bad in (0, -1.0, float("nan"), "1", True):
        with pytest.raises(ValueError, match="schedule_conservativeness"):
            EngineConfig(schedule_conservativeness=bad)
