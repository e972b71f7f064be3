"""The scheduler: admission, chunked prefill, decode batches, finishing, and the result pass.

Host-only (no jax). ``schedule()`` returns the next ``StepPlan`` (host arrays + per-row
records) or None; ``process(plan, results)`` applies a step's read-back results. Under the
overlapped loop, ``process`` for step n runs after step n+1 was planned and launched, so it
consults the in-flight plan before donating anything to the tree.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lazyspec.cache.allocators import KVAllocator, SlotAllocator
from lazyspec.scheduler.batch import decode_arrays, extend_arrays, fill_sampling
from lazyspec.scheduler.request import NO_SLOT, Phase, Req
from lazyspec.scheduler.tracking import CheckpointTracker, RowRecord

logger = logging.getLogger(__name__)


@dataclass
class StepPlan:
    kind: str  # "extend" | "decode"
    records: list[RowRecord]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class SchedulerLimits:
    max_running: int
    max_reqs: int  # request rows in the device tables
    context_len: int
    chunked_prefill: int
    chunk: int
    max_extend_rows: int
    num_verify: int
    eos_ids: tuple[int, ...]


def bucket(n: int, options: tuple[int, ...]) -> int:
    for option in options:
        if option >= n:
            return option
    raise ValueError(f"{n} exceeds the largest bucket {options[-1]}")


class Scheduler:
    def __init__(
        self,
        limits: SchedulerLimits,
        kv: KVAllocator,
        slots: SlotAllocator,
        tree,
        tracker: CheckpointTracker,
        page_size: int,
        extend_buckets: tuple[tuple[int, ...], tuple[int, ...]],
        decode_buckets: tuple[int, ...],
    ) -> None:
        self.limits = limits
        self.kv = kv
        self.slots = slots
        self.tree = tree
        self.tracker = tracker
        self.page_size = page_size
        self.extend_row_buckets, self.extend_len_buckets = extend_buckets
        self.decode_buckets = decode_buckets
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        # accept-length statistics (bounded: counters, not request lists)
        self.num_verify_steps = 0
        self.accept_counts = np.zeros(limits.num_verify + 1, np.int64)  # [k] = steps accepting k
        self.req_to_token = np.zeros((limits.max_reqs + 1, limits.context_len), np.int32)
        self.free_rows = list(range(limits.max_reqs, 0, -1))
        self.inflight: list[RowRecord] = []  # records of the launched, unprocessed step

    # ------------------------------------------------------------------ queries

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    # ------------------------------------------------------------------ admission

    def _kv_budget_tokens(self, req: Req, prefix_len: int) -> int:
        """KV rows reserved at admission: the whole prompt, every output token, and room
        for the decode steps that may run past the end (overlap + speculation)."""
        need = len(req.fill_ids) + req.sampling.max_new_tokens + 3 * self.limits.num_verify
        need = min(need, self.limits.context_len)
        pages = -(-(need - prefix_len) // self.page_size)
        return max(pages, 0)

    def _try_admit(self, req: Req) -> bool:
        """Query, then mutate: admit ``req`` if a row, slots and KV pages are available."""
        if len(self.running) >= self.limits.max_running or not self.free_rows:
            return False
        req.fill_ids = req.all_ids
        match = self.tree.match_prefix(req.fill_ids[:-1])
        num_slots = 1 + self.tracker.checkpoint_slots
        pages = self._kv_budget_tokens(req, match.prefix_len)
        self.tree.inc_lock(match.node)
        if self.slots.num_free < num_slots:
            self.tree.evict_state(num_slots - self.slots.num_free)
        if self.kv.num_free_pages < pages:
            self.tree.evict_kv((pages - self.kv.num_free_pages) * self.page_size)
        if self.slots.num_free < num_slots or self.kv.num_free_pages < pages:
            self.tree.dec_lock(match.node)
            return False
        slot_ids = self.slots.alloc(num_slots)
        page_ids = self.kv.alloc_pages(pages)
        req.req_row = self.free_rows.pop()
        self.tracker.assign_admission_slots(req, slot_ids)
        req.prefix_node = match.node
        req.prefix_len = req.cached_tokens = match.prefix_len
        req.state_src_slot = match.state_slot
        row = self.req_to_token[req.req_row]
        row[:] = 0
        row[: match.prefix_len] = match.kv_indices
        offsets = np.arange(self.page_size, dtype=np.int32)
        own = (page_ids[:, None] * self.page_size + offsets[None, :]).reshape(-1)
        end = min(match.prefix_len + len(own), self.limits.context_len)
        row[match.prefix_len : end] = own[: end - match.prefix_len]
        req.own_pages = page_ids
        req.fill_len = match.prefix_len
        req.seq_len = match.prefix_len
        req.phase = Phase.PREFILL
        self.running.append(req)
        return True

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> StepPlan | None:
        while self.waiting and self._try_admit(self.waiting[0]):
            self.waiting.popleft()
        prefilling = [r for r in self.running if r.phase is Phase.PREFILL]
        if prefilling:
            return self._plan_extend(prefilling[: self.limits.max_extend_rows])
        decoding = [r for r in self.running if r.phase is Phase.DECODE]
        if decoding:
            return self._plan_decode(decoding)
        if self.waiting and not self.running:
            req = self.waiting.popleft()
            self._finish(
                req, {"type": "abort", "message": "request does not fit in the KV/state pools"}
            )
        return None

    def _plan_extend(self, reqs: list[Req]) -> StepPlan:
        chunk = self.limits.chunk
        pieces = []
        for req in reqs:
            num_new = min(len(req.fill_ids) - req.fill_len, self.limits.chunked_prefill)
            pieces.append((req, req.fill_len, num_new))
        rows = bucket(len(pieces), self.extend_row_buckets)
        length = bucket(max(n for _, _, n in pieces), self.extend_len_buckets)
        a = extend_arrays(
            rows,
            length,
            self.limits.context_len,
            self.tracker.slots.num_slots,
            self.limits.max_reqs,
        )
        records = []
        for b, (req, start, num_new) in enumerate(pieces):
            is_last = start + num_new == len(req.fill_ids)
            record, track_chunk = self.tracker.plan_extend(req, start, num_new, chunk, is_last)
            records.append(record)
            a["req_row"][b] = req.req_row
            a["tokens"][b, :num_new] = req.fill_ids[start : start + num_new]
            a["start_pos"][b] = start
            a["num_new"][b] = num_new
            a["kv_read_idx"][b] = self.req_to_token[req.req_row]
            a["state_src_slot"][b] = req.state_src_slot
            a["working_slot"][b] = req.working_slot
            if record.target_slot != NO_SLOT:
                a["track_slot"][b] = record.target_slot
                a["track_chunk"][b] = track_chunk
            a["is_last_chunk"][b] = is_last
            if not is_last:
                a["next_token"][b] = req.fill_ids[start + num_new]
            fill_sampling(a, b, req)
            req.fill_len = start + num_new
            req.state_src_slot = req.working_slot  # later chunks continue from it
            if is_last:
                req.phase = Phase.DECODE
                req.seq_len = len(req.fill_ids)
        return StepPlan("extend", records, a)

    def _plan_decode(self, reqs: list[Req]) -> StepPlan:
        rows = bucket(len(reqs), self.decode_buckets)
        a = decode_arrays(
            rows,
            self.limits.context_len,
            self.tracker.slots.num_slots,
            self.limits.max_reqs,
            self.tracker.interval,
        )
        records = []
        for b, req in enumerate(reqs):
            record = self.tracker.plan_decode(req)
            records.append(record)
            a["req_row"][b] = req.req_row
            a["kv_read_idx"][b] = self.req_to_token[req.req_row]
            a["working_slot"][b] = req.working_slot
            if record.target_slot != NO_SLOT:
                a["track_slot"][b] = record.target_slot
            fill_sampling(a, b, req)
            req.inflight_decode += 1
        return StepPlan("decode", records, a)

    # ------------------------------------------------------------------ results

    def process(self, plan: StepPlan, results: dict[str, np.ndarray]) -> None:
        """Apply step results; ``self.inflight`` holds the records of the next step."""
        if plan.kind == "extend":
            self._process_extend(plan, results)
        else:
            self._process_decode(plan, results)

    def _process_extend(self, plan: StepPlan, results) -> None:
        for b, record in enumerate(plan.records):
            req = record.req
            if req.finished:
                continue
            self.tracker.settle_extend(record)
            if record.is_last_chunk:
                self._cache_prefill_checkpoint(req)
                if req.sampling.max_new_tokens == 0:
                    self._finish(req, {"type": "length", "length": 0})
                    continue
                self._append(
                    req,
                    [int(results["token"][b])],
                    [float(results["logprob"][b])],
                    [_top(results, b, None)],
                )

    def _process_decode(self, plan: StepPlan, results) -> None:
        interval = self.tracker.interval
        for b, record in enumerate(plan.records):
            req = record.req
            req.inflight_decode -= 1
            if req.finished:
                continue
            n = int(results["accept_len"][b])
            pre = int(results["pre"][b])
            req.seq_len = pre + n
            req.spec_verify_ct += 1
            req.accept_hist.append(n)
            self.num_verify_steps += 1
            self.accept_counts[n] += 1
            tokens = [int(t) for t in results["tokens"][b, :n]]
            finishing = self._would_finish(req, tokens)
            boundary = ((pre + n) // interval) * interval
            self.tracker.settle_decode(record, bool(results["crossed"][b]), boundary, finishing)
            self._append(
                req,
                tokens,
                [float(x) for x in results["logprobs"][b, :n]],
                [_top(results, b, i) for i in range(n)],
            )

    def _would_finish(self, req: Req, tokens: list[int]) -> bool:
        remaining = req.sampling.max_new_tokens - len(req.output_ids)
        if len(tokens) >= remaining:
            return True
        return any(self._is_stop(req, t) for t in tokens)

    def _is_stop(self, req: Req, token: int) -> bool:
        if token in req.sampling.stop_token_ids:
            return True
        return not req.sampling.ignore_eos and token in self.limits.eos_ids

    def _append(
        self,
        req: Req,
        tokens: list[int],
        logprobs: list[float],
        tops: list[list[tuple[float, int]]],
    ) -> None:
        for token, logprob, top in zip(tokens, logprobs, tops):
            req.output_ids.append(token)
            req.output_logprobs.append(logprob)
            if req.return_logprob:
                req.output_top_logprobs.append(top)
            if self._is_stop(req, token):
                kind = "stop"
                self._finish(req, {"type": kind, "matched": token})
                return
            if len(req.output_ids) >= req.sampling.max_new_tokens:
                self._finish(req, {"type": "length", "length": req.sampling.max_new_tokens})
                return
            if (
                len(req.fill_ids) + len(req.output_ids)
                >= self.limits.context_len - 3 * self.limits.num_verify
            ):
                self._finish(req, {"type": "length", "length": len(req.output_ids)})
                return

    def _cache_prefill_checkpoint(self, req: Req) -> None:
        """Insert the prompt up to its in-prompt checkpoint while the request keeps running.

        The keep slot goes to the tree and the request continues with a fresh one, but only
        if no in-flight step may still write the keep slot (the first decode after a prefill
        is launched before the prefill result is processed).
        """
        length = req.last_track_len
        if length is None or length <= req.prefix_len:
            return
        if not self.tracker.keep_is_donatable(req, self.inflight):
            return
        fresh = self.slots.alloc(1)
        if fresh is None:
            self.tree.evict_state(1)
            fresh = self.slots.alloc(1)
        if fresh is None:
            return
        row = self.req_to_token[req.req_row]
        result = self.tree.insert(req.fill_ids[:length], row[:length].copy(), req.keep_slot)
        if not result.state_taken:
            self.slots.free([req.keep_slot])
        match = self.tree.match_prefix(req.fill_ids[:length])
        assert match.prefix_len == length, (match.prefix_len, length)
        row[:length] = match.kv_indices  # our duplicate pages may have been freed
        self.tree.inc_lock(match.node)
        self.tree.dec_lock(req.prefix_node)
        req.own_pages = req.own_pages[(length - req.prefix_len) // self.page_size :]
        req.prefix_node, req.prefix_len = match.node, length
        req.keep_slot = fresh[0]
        req.last_track_len = None

    # ------------------------------------------------------------------ finishing

    def abort(self, rid: str) -> bool:
        """Drop a request; nothing of it enters the cache. False if it is unknown."""
        return self._end(rid, {"type": "abort"})

    def stop(self, rid: str, reason: dict[str, Any] | None = None) -> bool:
        """Finish a request early (e.g. a stop string matched on the text side); its safe
        checkpoint is cached as for any finish. False if it is unknown."""
        return self._end(rid, reason or {"type": "stop"})

    def _end(self, rid: str, reason: dict[str, Any]) -> bool:
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                req.phase = Phase.FINISHED
                req.finish_reason = reason
                return True
        for req in self.running:
            if req.rid == rid:
                self._finish(req, reason)
                return True
        return False

    def _finish(self, req: Req, reason: dict[str, Any]) -> None:
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
            self._release(req, insert=reason.get("type") != "abort")
        req.phase = Phase.FINISHED

    def _release(self, req: Req, insert: bool) -> None:
        """Return the request's slots and pages; donate its safe checkpoint to the tree."""
        row = self.req_to_token[req.req_row]
        owned_start = req.prefix_len
        insert_len = 0
        donated = NO_SLOT
        seq_len = min(req.seq_len, len(req.all_ids))
        if insert and self.tracker.strategy == "no_buffer" and req.phase is Phase.DECODE:
            insert_len, donated = seq_len, req.working_slot
        elif insert and self.tracker.keep_is_donatable(req, self.inflight):
            insert_len, donated = req.last_track_len, req.keep_slot
        own_slots = {req.working_slot, req.keep_slot, req.spare_slot} - {NO_SLOT}
        if insert_len > req.prefix_len:
            result = self.tree.insert(req.all_ids[:insert_len], row[:insert_len].copy(), donated)
            if result.state_taken:
                own_slots.discard(donated)
            owned_start = insert_len
        self.slots.free(sorted(own_slots))
        total = req.prefix_len + len(req.own_pages) * self.page_size
        if total > owned_start:
            first_page = (owned_start - req.prefix_len) // self.page_size
            self.kv.free_pages(req.own_pages[first_page:])
        self.tree.dec_lock(req.prefix_node)
        self.free_rows.append(req.req_row)
        req.working_slot = req.keep_slot = req.spare_slot = NO_SLOT


def _top(results: dict[str, np.ndarray], b: int, i: int | None) -> list[tuple[float, int]]:
    """The step's top-k (logprob, token id) pairs of row b (position i of a decode step)."""
    values = results["top_logprobs"][b] if i is None else results["top_logprobs"][b, i]
    ids = results["top_ids"][b] if i is None else results["top_ids"][b, i]
    return [(float(v), int(t)) for v, t in zip(values, ids)]
