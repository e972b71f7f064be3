"""The scheduler on the host alone (no jax, no device): admission against rows, slots and
pages; a request that can never fit is aborted; abort of waiting and running requests frees
everything; chunked prefill pieces and the batch a step is given.

Device results are faked with numpy arrays shaped like the steps' outputs (extend: token,
logprob, top_logprobs, top_ids per row; decode: tokens, accept_len, logprobs, top_logprobs,
top_ids, crossed, pre). The tests drive only ``add`` / ``schedule`` / ``process`` /
``abort`` / ``stop`` and read ``running`` / ``waiting``, the allocators and the tree."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np

from lazyspec.cache.allocators import KVAllocator, SlotAllocator, check_all
from lazyspec.config import EngineConfig
from lazyspec.scheduler.layout import plan_memory
from lazyspec.scheduler.request import Req, SamplingParams
from lazyspec.testing.no_jax import BLOCK_JAX
from tests.scheduler.wiring import (
    CHUNK,
    CHUNKED_PREFILL,
    INTERVAL,
    MODEL,
    PAGE,
    small_config,
    wired_scheduler,
)

ROOT = Path(__file__).resolve().parents[2]
TOP = 5  # top logprobs per position in the step outputs


class Pools:
    """A scheduler wired as the engine wires it, with its allocators and tree at hand. The
    layout is the engine's memory plan with the running cap and buckets set as given (the
    plan would lower the cap when the slots cannot serve it; these tests want the slot limit
    itself to stop admission)."""

    def __init__(
        self,
        strategy: str = "extra_buffer",
        num_slots: int = 12,
        num_pages: int = 128,
        max_running: int = 2,
        num_verify: int = 1,
        prefill_tokens: int | None = None,
    ) -> None:
        config = small_config(num_pages, num_slots, max_running, strategy, num_verify)
        rows = tuple(n for n in (1, 2, 4) if n <= max(max_running, 1))
        layout = dataclasses.replace(
            plan_memory(config, MODEL),
            max_running=max_running,
            extend_lengths=(16, 32, 64),
            prefill_tokens=prefill_tokens or rows[-1] * 64,
            decode_buckets=rows,
        )
        self.kv = KVAllocator(num_pages, PAGE)
        self.slots = SlotAllocator(num_slots)
        self.num_verify = num_verify
        self.tree, self.sched = wired_scheduler(
            layout, self.kv, self.slots, grid=layout.prefill_track_grid
        )

    def step(self, token: int = 5, accept_len: int = 1):
        """schedule(), then process() the plan with fake results (no overlap)."""
        plan = self.sched.schedule()
        if plan is not None:
            self.sched.process(
                plan, fake_results(plan, self.num_verify, token, accept_len), inflight=()
            )
        return plan

    def check_idle(self) -> None:
        """Nothing running: every slot and page is free or cached in the tree."""
        assert not self.sched.running
        check_all(self.kv, self.slots, self.tree, [], [])
        assert self.slots.num_free + self.tree.num_cached_slots == self.slots.num_slots
        cached_pages = self.tree.num_cached_tokens // PAGE
        assert self.kv.num_free_pages + cached_pages == self.kv.num_pages


def fake_results(plan, num_verify: int, token: int, accept_len: int) -> dict[str, np.ndarray]:
    rows = len(plan.batch.req_row)
    if plan.kind == "extend":
        return {
            "token": np.full(rows, token, np.int32),
            "logprob": np.full(rows, -0.25, np.float32),
            "top_logprobs": np.full((rows, TOP), -1.0, np.float32),
            "top_ids": np.tile(np.arange(TOP, dtype=np.int32), (rows, 1)),
        }
    pre = np.zeros(rows, np.int32)
    pre[: len(plan.records)] = [r.req.seq_len for r in plan.records]
    post = pre + accept_len
    return {
        "tokens": np.full((rows, num_verify), token, np.int32),
        "accept_len": np.full(rows, accept_len, np.int32),
        "logprobs": np.full((rows, num_verify), -0.5, np.float32),
        "top_logprobs": np.full((rows, num_verify, TOP), -1.0, np.float32),
        "top_ids": np.zeros((rows, num_verify, TOP), np.int32),
        "crossed": pre // INTERVAL != post // INTERVAL,
        "pre": pre,
    }


def _req(rid: str, prompt_len: int, max_new: int = 4, seed: int = 0) -> Req:
    rng = np.random.default_rng(seed)
    prompt = [int(t) for t in rng.integers(3, 100, size=prompt_len)]
    return Req(rid=rid, input_ids=prompt, sampling=SamplingParams(max_new, ignore_eos=True))


def _run_until_finished(pools: Pools, reqs: list[Req], limit: int = 200) -> None:
    for _ in range(limit):
        if all(r.finished for r in reqs):
            return
        pools.step()
    raise AssertionError("requests did not finish")


def _one_of_two_admitted(pools: Pools):
    """Two 20-token requests queued and one step run: only the first is admitted. (first,
    second, the step's plan)."""
    first, second = _req("a", 20), _req("b", 20, seed=1)
    pools.sched.add(first)
    pools.sched.add(second)
    plan = pools.step()
    assert pools.sched.running == [first] and list(pools.sched.waiting) == [second]
    return first, second, plan


def _served_in_turn(pools: Pools, first: Req, second: Req) -> None:
    """``first`` served to its end, then ``second`` admitted alone and served to its end;
    the pools idle after."""
    _run_until_finished(pools, [first])
    pools.step()
    assert pools.sched.running == [second] and not pools.sched.waiting
    _run_until_finished(pools, [second])
    pools.check_idle()


def test_admission_limited_by_running_rows():
    pools = Pools(max_running=1)
    first, second, plan = _one_of_two_admitted(pools)
    assert plan.kind == "extend" and [r.req for r in plan.records] == [first]
    _run_until_finished(pools, [first])
    assert first.output_ids == [5] * 4 and first.finish_reason["type"] == "length"
    plan = pools.step()
    assert [r.req for r in plan.records] == [second] and not pools.sched.waiting
    _run_until_finished(pools, [second])
    pools.check_idle()


def test_admission_limited_by_state_slots():
    # extra_buffer pins 3 slots per running request: 5 slots admit one request
    pools = Pools(num_slots=5, max_running=2)
    first, second, _ = _one_of_two_admitted(pools)
    # 3 pinned, and the prompt's checkpoint at 16 (G = 16) went to the tree with the keep
    # slot, the request continuing on a fresh one
    assert pools.slots.num_free == 1 and pools.tree.num_cached_slots == 1
    _served_in_turn(pools, first, second)


def test_admission_limited_by_kv_pages():
    # 20 prompt + 3 headroom rows take 12 pages; the second then finds 8 pages, short of
    # its own 12
    pools = Pools(num_pages=20)
    first, second, _ = _one_of_two_admitted(pools)
    assert pools.kv.num_free_pages == 20 - 12
    _served_in_turn(pools, first, second)


def test_admission_stops_where_the_next_extend_step_is_full():
    """A burst is admitted a prefill step at a time, as SGLang's prefill adder admits: the
    requests the next extend step cannot take stay queued (nothing allocated for them),
    so that step launches without the others' admission work before it."""
    pools = Pools(num_slots=48, num_pages=256, max_running=4, prefill_tokens=128)
    reqs = [_req(str(i), 40, seed=i) for i in range(4)]  # a step holds two 64-token rows
    for req in reqs:
        pools.sched.add(req)
    plan = pools.step()
    assert [r.req for r in plan.records] == reqs[:2]
    assert pools.sched.running == reqs[:2] and list(pools.sched.waiting) == reqs[2:]
    free_pages = pools.kv.num_free_pages
    plan = pools.step()  # the first two decode once the others have prefilled
    assert plan.kind == "extend" and [r.req for r in plan.records] == reqs[2:]
    assert pools.sched.running == reqs and not pools.sched.waiting
    assert pools.kv.num_free_pages < free_pages  # their pages taken only now
    _run_until_finished(pools, reqs)
    pools.check_idle()


def test_request_that_can_never_fit_is_aborted():
    pools = Pools(num_pages=10)  # 20 tokens of KV: a 30-token prompt never fits
    too_big, small = _req("big", 30), _req("small", 6, seed=1)
    pools.sched.add(too_big)
    pools.sched.add(small)
    assert pools.sched.schedule() is None
    assert too_big.finished and too_big.finish_reason["type"] == "abort"
    assert not too_big.output_ids and list(pools.sched.waiting) == [small]
    pools.check_idle()
    assert pools.kv.num_free_pages == 10 and pools.slots.num_free == 12
    _run_until_finished(pools, [small])  # the queue moves on
    assert small.output_ids == [5] * 4
    pools.check_idle()


def test_abort_waiting_request():
    pools = Pools(max_running=1)
    first, second, _ = _one_of_two_admitted(pools)
    free = (pools.slots.num_free, pools.kv.num_free_pages)
    assert pools.sched.abort("b") and not pools.sched.abort("nobody")
    assert second.finished and second.finish_reason == {"type": "abort"}
    assert not pools.sched.waiting and pools.sched.running == [first]
    assert (pools.slots.num_free, pools.kv.num_free_pages) == free
    _run_until_finished(pools, [first])
    assert pools.step() is None and not second.output_ids
    pools.check_idle()


def test_abort_running_request_mid_prefill_frees_everything():
    pools = Pools()
    req = _req("a", 150, max_new=8)
    pools.sched.add(req)
    pools.step()  # first chunk processed: its checkpoint (64) is settled, not cached
    assert pools.tree.num_cached_tokens == 0
    plan = pools.sched.schedule()  # second chunk planned (the first's checkpoint cached)
    assert plan.kind == "extend" and req.fill_len == 128
    assert pools.tree.num_cached_tokens == 64 and req.prefix_len == 64
    assert pools.slots.num_free == 12 - 3 - 1 and pools.kv.num_free_pages < 128
    assert pools.sched.abort("a")
    assert req.finished and not pools.sched.running and not pools.sched.waiting
    assert pools.slots.num_free == 12 - 1 and pools.kv.num_free_pages == 128 - 64 // PAGE
    assert pools.tree.num_cached_tokens == 64  # the abort itself caches nothing
    # results of a dropped request
    pools.sched.process(plan, fake_results(plan, 1, 5, 1), inflight=())
    assert not req.output_ids
    pools.check_idle()
    # the freed request row is reusable
    again = _req("b", 150, max_new=8, seed=1)
    pools.sched.add(again)
    _run_until_finished(pools, [again])
    pools.check_idle()


def test_abort_and_stop_while_decoding():
    pools = Pools()
    aborted, stopped = _req("a", 70, max_new=30), _req("s", 70, max_new=30, seed=1)
    pools.sched.add(aborted)
    pools.sched.add(stopped)
    for _ in range(8):
        pools.step()
    assert all(len(r.output_ids) > 2 and not r.finished for r in (aborted, stopped))
    running_slots = [s for r in pools.sched.running for s in r.slots.owned()]
    running_pages = np.concatenate([r.own_pages for r in pools.sched.running])
    check_all(pools.kv, pools.slots, pools.tree, running_slots, running_pages)
    cached = pools.tree.num_cached_tokens
    assert cached == 2 * 64  # each prompt's in-prompt checkpoint at 64
    assert pools.sched.abort("a") and pools.sched.stop("s", inflight=())
    assert aborted.finish_reason == {"type": "abort"}
    assert stopped.finish_reason == {"type": "stop"}
    assert not pools.sched.running
    pools.check_idle()
    assert pools.tree.num_cached_tokens == cached  # no checkpoint settled since prefill


def _sampled_req(rid: str, max_new: int, temperature: float, top_k: int, seed: int) -> Req:
    req = _req(rid, 20, max_new=max_new, seed=seed)
    req.sampling = dataclasses.replace(req.sampling, temperature=temperature, top_k=top_k)
    return req


def test_decode_batches_carry_their_requests_sampling_values():
    """Each decode batch row holds its request's sampling values, while the requests stay
    (the arrays are then the previous batch's, kept read-only), after one ends and after
    another joins in its place with other values."""
    pools = Pools(max_running=2)
    first = _sampled_req("a", 12, 0.5, 3, seed=0)
    short = _sampled_req("b", 3, 0.9, 7, seed=1)
    pools.sched.add(first)
    pools.sched.add(short)
    joining = _sampled_req("c", 4, 0.7, 2, seed=2)
    previous, seen, joined = None, set(), False
    for _ in range(40):
        if short.finished and not joined:
            pools.sched.add(joining)
            joined = True
        plan = pools.step()
        if plan is None or first.finished:
            break
        if plan.kind != "decode":
            previous = None
            continue
        reqs = [record.req for record in plan.records]
        seen.add(tuple(req.rid for req in reqs))
        sampling = plan.batch.sampling
        for row, req in enumerate(reqs):
            for name, values in vars(sampling).items():
                assert np.array_equal(values[row], getattr(req.sampling_row, name)), name
        for values in vars(sampling).values():
            assert not values.flags.writeable
        if previous is not None and [r.req for r in previous.records] == reqs:
            assert sampling is previous.batch.sampling
        previous = plan
    assert {("a", "b"), ("a",), ("a", "c")} <= seen


def _apply_updates(table: np.ndarray, plan) -> None:
    """What the device does with a plan's request-table updates (chunks, then the batch's);
    writes to rows past the table (the drop sentinel) are dropped."""
    for updates in [*plan.table_chunks, plan.batch.table_updates]:
        keep = updates[0] < len(table)
        positions = list(zip(updates[0, keep], updates[1, keep]))
        assert len(set(positions)) == len(positions)  # each entry once: order is free
        table[updates[0, keep], updates[1, keep]] = updates[2, keep]


def test_chunked_prefill_pieces_and_batches():
    pools = Pools(max_running=4)
    device_table = np.zeros_like(pools.sched.cache.req_to_token)
    req = _req("a", 150, max_new=3)
    others = [_req("b", 40, max_new=3, seed=1), _req("c", 9, max_new=3, seed=2)]
    for r in [req, *others]:
        pools.sched.add(r)
    sentinel_slot, sentinel_row = 12 + 1, 4 + 1
    own_rows = None
    pieces = []
    for _ in range(3):
        plan = pools.sched.schedule()
        assert plan.kind == "extend"
        _apply_updates(device_table, plan)
        a = plan.batch
        b = [r.req for r in plan.records].index(req)
        if own_rows is None:
            own_rows = pools.kv.pages_to_token_indices(req.own_pages)
            # the prompt and the run-past headroom (3), in pages: decode steps add theirs
            assert len(own_rows) == 154 and pools.kv.is_allocated(req.own_pages).all()
        start, num_new = int(a.start_pos[b]), int(a.num_new[b])
        pieces.append((start, num_new, a.tokens.shape, bool(a.is_last_chunk[b])))
        assert a.tokens[b, :num_new].tolist() == req.input_ids[start : start + num_new]
        assert not a.tokens[b, num_new:].any()
        assert a.req_row[b] == req.req_row
        assert a.working_slot[b] == req.slots.working
        assert a.state_src_slot[b] == (0 if start == 0 else req.slots.working)
        np.testing.assert_array_equal(device_table[req.req_row, :150], own_rows[:150])
        if num_new == CHUNKED_PREFILL:  # checkpoint at the chunk's end (on the grid G = 16)
            assert a.next_token[b] == req.input_ids[start + num_new]
            assert a.track_slot[b] == req.slots.keep
            assert a.track_chunk[b] == CHUNKED_PREFILL // CHUNK - 1
            # the previous chunk's checkpoint went to the tree before this chunk was planned
            assert req.prefix_len == start
        else:  # 128..150: checkpoint at 128 + (22 // 16) * 16 = 144, after one scan chunk
            assert a.track_slot[b] == req.slots.keep and a.track_chunk[b] == 0
        if start == 0:  # the short requests ride along in the first extend step
            assert [r.req for r in plan.records] == [req, *others]
            assert a.num_new.tolist() == [64, 40, 9, 0]
            assert a.is_last_chunk.tolist() == [False, True, True, False]
            # row 3 pads the bucket of 4: it points at no request, slot or checkpoint
            assert a.req_row[3] == sentinel_row and a.working_slot[3] == sentinel_slot
            assert a.track_slot[3] == sentinel_slot and a.state_src_slot[3] == 0
            assert not a.tokens[3].any()
            # the first step carries its three rows' whole table rows, nothing else
            updated_rows = np.concatenate([u[0] for u in [*plan.table_chunks, a.table_updates]])
            assert set(updated_rows.tolist()) == {*a.req_row[:3].tolist(), sentinel_row}
        else:
            assert [r.req for r in plan.records] == [req]
        pools.sched.process(plan, fake_results(plan, 1, 5, 1), inflight=())
    assert pieces == [(0, 64, (4, 64), False), (64, 64, (1, 64), False), (128, 22, (1, 32), True)]
    # the prefill ended: its last in-prompt checkpoint (144) went to the tree
    assert req.output_ids == [5] and pools.tree.num_cached_tokens >= 144
    assert pools.tree.match_prefix(req.input_ids).prefix_len == 144
    assert pools.tree.match_prefix(req.input_ids[:143]).prefix_len == 128
    plan = pools.sched.schedule()
    assert plan.kind == "decode" and [r.req for r in plan.records] == [req, *others]
    a = plan.batch
    b = [r.req for r in plan.records].index(req)
    assert a.working_slot[b] == req.slots.working and a.track_slot[b] == req.slots.spare
    _apply_updates(device_table, plan)
    np.testing.assert_array_equal(device_table, pools.sched.cache.req_to_token)
    pools.sched.process(plan, fake_results(plan, 1, 7, 1), inflight=())
    assert req.output_ids == [5, 7]
    _run_until_finished(pools, [req, *others])
    assert req.output_ids == [5, 7, 5] and [r.output_ids for r in others] == [[5, 7, 5]] * 2
    pools.check_idle()


def test_speculative_decode_appends_accepted_tokens():
    pools = Pools(num_verify=4)
    req = _req("a", 20, max_new=9)
    pools.sched.add(req)
    pools.step()  # prefill: one token
    plan = pools.step(token=8, accept_len=3)
    assert plan.kind == "decode" and req.seq_len == 23 and req.accept_hist == [3]
    assert req.output_ids == [5, 8, 8, 8]
    pools.step(token=9, accept_len=4)
    assert req.output_ids == [5, 8, 8, 8] + [9] * 4 and not req.finished
    pools.step(token=6, accept_len=4)  # only one more token is wanted
    assert req.output_ids == [5] + [8] * 3 + [9] * 4 + [6] and req.finished
    pools.check_idle()


RUN_WITHOUT_JAX = (
    BLOCK_JAX
    + """
import pytest
code = pytest.main(["-q", "-p", "no:cacheprovider", "-k", "not without_jax", sys.argv[1]])
loaded = sorted(m for m in sys.modules if m == "jax" or m.startswith(("jax.", "jaxlib")))
print("jax modules loaded:", loaded)
sys.exit(int(code) or bool(loaded))
"""
)


def test_scheduler_tests_pass_without_jax():
    result = subprocess.run(
        [sys.executable, "-c", RUN_WITHOUT_JAX, __file__],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert " passed" in result.stdout and "jax modules loaded: []" in result.stdout


def test_the_host_pools_follow_the_ratio_or_the_gigabytes():
    config = EngineConfig(
        max_mamba_cache_size=10, max_total_tokens=1000, enable_hierarchical_cache=True
    )
    layout = plan_memory(config, MODEL)
    assert layout.host_tier and not plan_memory(EngineConfig(), MODEL).host_tier
    assert layout.host_pools(2.0, 0.0, slot_bytes=100, token_bytes=10) == (20, 2000)
    # 1.1e-5 GB = 11,000 bytes: once the device pools (10 x 100 + 1000 x 10 bytes)
    slots, pages = layout.host_pools(2.0, 1.1e-5, slot_bytes=100, token_bytes=10)
    assert (slots, pages) == (10, 1000)
    assert layout.host_pools(0.001, 0.0, 100, 10) == (1, 1)  # never an empty pool


def test_an_extend_step_takes_chunks_up_to_its_token_budget():
    """Rows per extend length are powers of two up to the budget's (one at least, no more
    than the running requests); chunks join a step in queue order while they fit it."""
    config = small_config(128, 48, 8, "extra_buffer", 1)
    layout = dataclasses.replace(
        plan_memory(config, MODEL), extend_lengths=(16, 32, 64), prefill_tokens=128
    )
    assert [layout.extend_rows(n) for n in (16, 32, 64)] == [(1, 2, 4, 8), (1, 2, 4), (1, 2)]
    assert layout.extend_count([10] * 9) == 8  # the running requests cap it
    assert layout.extend_count([30] * 5) == 4
    assert layout.extend_count([10, 10, 10, 60, 10]) == 3  # a 64-token step holds two rows
    assert layout.extend_count([60, 10, 10]) == 2
    assert dataclasses.replace(layout, prefill_tokens=32).extend_count([64, 64]) == 1
    # unset, the budget is the platform's: four longest chunks on CPU
    assert plan_memory(config, MODEL).prefill_tokens == 4 * CHUNKED_PREFILL
