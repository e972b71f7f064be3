"""The scheduler: admission, chunked prefill, decode batches, finishing, and the result pass.

Host-only (no jax). ``schedule()`` returns the next ``StepPlan`` (a typed host batch + the
per-row records) or None; ``process(plan, results, inflight)`` applies a step's read-back
results. Under the overlapped loop ``process`` for step n runs after step n+1 was planned
and launched: ``inflight`` is step n+1's records, which decide what may be donated; and
``schedule(inflight)`` plans step n+1 while step n (``inflight``) is unprocessed, which
decides what a retraction may free.

KV is not reserved up front: admission counts each request's prompt plus an estimate of
the tokens it will still produce (``NewTokenRatio``), and a decode step allocates the
pages it reaches. When a decode step cannot get its pages, the requests with the least
progress are retracted (``_retract``): pages, row and slots given back with nothing
inserted into the tree, re-queued at the front to resume by recompute from their tokens.

Who owns what: ``SlotPolicy`` the requests' state slots (policy.py), ``RequestCache`` their
KV rows, pages and tree insertion (cache.py); the scheduler owns the queues, the request
phases and progress, and the order of calls.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from lazyspec.cache.radix_cache import MatchResult
from lazyspec.scheduler.batch import (
    CountSeed,
    SamplingMemo,
    StepPlan,
    build_decode,
    build_extend,
    count_seeds,
    sampling_row,
    split_table_updates,
)
from lazyspec.scheduler.cache import RequestCache
from lazyspec.scheduler.layout import Layout
from lazyspec.scheduler.logprobs import take_prompt_logprobs, top_pairs
from lazyspec.scheduler.policy import RowRecord, SlotPolicy
from lazyspec.scheduler.request import NO_SLOT, Phase, Req
from lazyspec.scheduler.token_ratio import NewTokenRatio

logger = logging.getLogger(__name__)

# lpm sorts a waiting queue up to this long (one tree walk per request per step); a longer
# one is taken in arrival order (SGLang's cut-off)
LPM_MAX_WAITING = 128


@dataclass(frozen=True)
class Admission:
    """What admitting a request takes (the answer of the admission query)."""

    fill_ids: list[int]
    match: MatchResult
    num_slots: int  # the request's and its match's load (``RequestCache.load_cost``)
    num_pages: int


class Scheduler:
    def __init__(
        self,
        layout: Layout,
        policy: SlotPolicy,
        cache: RequestCache,
        eos_ids: tuple[int, ...],
        token_ratio: NewTokenRatio | None = None,
        schedule_policy: str = "fcfs",
    ) -> None:
        self.layout = layout
        self.policy = policy
        self.cache = cache
        self.tree = cache.tree
        self.eos_ids = eos_ids
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        # accept-length statistics (bounded: counters, not request lists)
        self.num_verify_steps = 0
        self.accept_counts = np.zeros(layout.num_verify + 1, np.int64)  # [k] = steps accepting k
        # decode steps a speculative engine ran without speculation (``spec_max_batch``)
        self.num_spec_off_steps = 0
        # prefix-cache statistics, counted once per admitted request
        self.num_admitted_tokens = 0  # prompt tokens of admitted requests
        self.num_cached_tokens = 0  # of those, tokens served from the prefix cache
        self.token_ratio = token_ratio or NewTokenRatio()
        self.schedule_policy = schedule_policy  # "fcfs" or "lpm" (_order_by_prefix)
        self.num_retractions = 0  # requests retracted to free KV for a decode step
        self._count_seeds: list[CountSeed] = []  # admitted rows' histories, for the next plan
        self._sampling_memo = SamplingMemo()  # the decode batches' sampling arrays

    # ------------------------------------------------------------------ queries

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    # ------------------------------------------------------------------ admission

    def can_admit(self, req: Req, running_tokens: int | None = None) -> Admission | None:
        """What admitting ``req`` takes, or None if it does not fit now (evictable cache
        entries counted). A query: only the match's LRU touch and statistics change.
        ``running_tokens``: the running requests' estimated tokens to come, where the
        caller keeps their sum (``schedule`` does, over a burst's admissions).

        Pages are taken for the prompt and the run-past headroom; beyond them, while other
        requests run, the pool must keep the tokens every running request and ``req`` are
        estimated to still produce (``NewTokenRatio``). A request admitted alone needs
        only its own pages: nothing else could be retracted for it."""
        if len(self.running) >= self.layout.max_running:
            return None
        fill_ids = req.all_ids
        key = fill_ids[:-1]
        if req.next_prompt_logprob is not None:  # its logits come from the position before
            key = key[: req.next_prompt_logprob - 1]
        match = self.tree.match_prefix(key)
        load_slots, load_pages = self.cache.load_cost(match)  # a match ending on the host
        num_slots = self.policy.slots_needed() + load_slots
        num_pages = self.cache.pages_needed(req, len(fill_ids), match.prefix_len) + load_pages
        reserved = 0
        if self.running:
            if running_tokens is None:
                running_tokens = sum(self._estimated_new_tokens(r) for r in self.running)
            reserved = running_tokens + self._estimated_new_tokens(req)
        if not self.cache.fits(match, num_slots, num_pages, reserved):
            return None
        return Admission(fill_ids, match, num_slots, num_pages)

    def _next_chunk(self, fill_len: int, done: int) -> int:
        """Tokens the next prefill chunk of a request takes: what is left of its ``fill_len``
        after ``done``, at most a chunk."""
        return min(fill_len - done, self.layout.chunked_prefill)

    def _estimated_new_tokens(self, req: Req) -> int:
        remaining = req.sampling.max_new_tokens - len(req.output_ids)
        return self.token_ratio.estimate(remaining)

    def _prepare(self, req: Req) -> bool:
        """Convert the head waiting request's per-step values (``sampling_row``) before it
        takes anything. Whatever fails there fails ``req`` alone: it finishes with an error
        reason (``status_code`` 500) and False is returned; the other requests never see
        it."""
        if req.sampling_row is not None:
            return True
        try:
            req.sampling_row = sampling_row(req, self.eos_ids)
        except Exception as exc:  # any failure is this request's: isolate it
            logger.warning("request %s failed before admission: %r", req.rid, exc)
            self.waiting.popleft()
            reason = {
                "type": "abort",
                "message": f"the request could not be prepared for a step: {exc!r}",
                "status_code": 500,
            }
            self._finish(req, reason, inflight=())
            return False
        return True

    def admit(self, req: Req, admission: Admission) -> None:
        """Admit ``req`` with what ``can_admit`` found: evict what must go, allocate its
        slots, row and pages, and start its prefill."""
        match = self.cache.reserve(admission.match, admission.num_slots, admission.num_pages)
        self.policy.admit(req, match.state_slot)
        self.cache.admit(req, match, admission.num_pages - self.cache.load_cost(admission.match)[1])
        req.fill_ids = admission.fill_ids
        req.fill_len = req.seq_len = match.prefix_len
        req.phase = Phase.PREFILL
        self.running.append(req)
        if req.sampling.has_penalties:  # the row's previous owner left its counts there
            self._count_seeds += count_seeds(req)
        if not req.num_retractions:  # a resumed request is counted once, when first admitted
            self.num_admitted_tokens += len(admission.fill_ids)
            self.num_cached_tokens += match.prefix_len

    # ------------------------------------------------------------------ schedule

    def schedule(self, inflight: Iterable[RowRecord] = ()) -> StepPlan | None:
        """The next step's plan, or None. Mutates: admits, plans slots and pages; may
        retract or fail requests when a decode step cannot get its pages. ``inflight``:
        the records of the launched step not yet processed (empty without overlap).

        Waiting requests are admitted while the next extend step can take their first
        chunk (SGLang's prefill adder): a burst is admitted a step at a time, the later
        admissions overlapping the earlier steps' device time."""
        if self.schedule_policy == "lpm":
            self._order_by_prefix()
        prefilling = [r for r in self.running if r.phase is Phase.PREFILL]
        chunks = [self._next_chunk(len(r.fill_ids), r.fill_len) for r in prefilling]
        taken = self.layout.extend_count(chunks)  # by the next extend step
        longest = max(chunks[:taken], default=0)
        running_tokens = sum(self._estimated_new_tokens(r) for r in self.running)
        while self.waiting and taken == len(prefilling):
            if not self._prepare(self.waiting[0]):
                continue  # it failed and left the queue; the next one is the head now
            admission = self.can_admit(self.waiting[0], running_tokens)
            if admission is None:
                break
            chunk = self._next_chunk(len(admission.fill_ids), admission.match.prefix_len)
            if not self.layout.extend_takes(taken, max(longest, chunk)):
                break  # the next extend step is full: admitted once one can take it
            req = self.waiting.popleft()
            self.admit(req, admission)
            running_tokens += self._estimated_new_tokens(req)
            prefilling.append(req)
            chunk = self._next_chunk(len(req.fill_ids), req.fill_len)
            if self.layout.extend_takes(taken, max(longest, chunk)):
                taken, longest = taken + 1, max(longest, chunk)
        if prefilling:
            return self._plan_extend(prefilling[:taken])
        decoding = [r for r in self.running if r.phase is Phase.DECODE]
        if decoding:
            decoding = self._make_room(decoding, list(inflight))
            # all retracted or failed: the next call admits again with what they freed
            return self._plan_decode(decoding) if decoding else None
        self.token_ratio.reset()  # nothing runs
        if self.waiting:
            req = self.waiting.popleft()
            reason = {
                "type": "abort",
                "message": "the request does not fit in the KV / state pools",
                "status_code": 400,
            }
            self._finish(req, reason, inflight=())
        return None

    def _order_by_prefix(self) -> None:
        """lpm (SGLang's rule): the waiting requests by their cached prefix (with a state),
        longest first; ties keep queue order, so a retracted request stays ahead of its
        equals. A queue longer than LPM_MAX_WAITING keeps arrival order, as SGLang's does.
        Mutates the queue and, through the matches, the tree's LRU orders and stats."""
        if not 1 < len(self.waiting) <= LPM_MAX_WAITING:
            return
        cached = {id(r): self.tree.match_prefix(r.all_ids[:-1]).prefix_len for r in self.waiting}
        self.waiting = deque(sorted(self.waiting, key=lambda r: -cached[id(r)]))

    def _plan_extend(self, reqs: list[Req]) -> StepPlan:
        records = []
        for req in reqs:
            self._cache_chunk_checkpoint(req)
            start = req.fill_len
            num_new = min(len(req.fill_ids) - start, self.layout.chunked_prefill)
            is_last = start + num_new == len(req.fill_ids)
            records.append(
                self.policy.plan_extend(req, start, num_new, self.layout.chunk_size, is_last)
            )
            req.fill_len = start + num_new
            if is_last:
                req.phase = Phase.DECODE
                req.seq_len = len(req.fill_ids)
        updates, chunks = self._table_updates(records)
        batch = build_extend(self.layout, records, updates)
        seeds, self._count_seeds = self._count_seeds, []
        wants = any(r.req.next_prompt_logprob is not None for r in records)
        sampled = [r.req for r in records if r.is_last_chunk and r.req.grammar is not None]
        return StepPlan(
            "extend",
            records,
            batch,
            chunks,
            count_seeds=seeds,
            prompt_logprobs=wants,
            grammar_reqs=sampled,
        )

    def _make_room(self, reqs: list[Req], inflight: list[RowRecord]) -> list[Req]:
        """Mutates: give every request of the next decode step the pages its writes may
        reach (the run-past headroom past its committed length), retracting the requests
        with the least progress (fewest outputs, then longest prompt) until the rest fit.
        A request that does not fit with every other one retracted fails alone. Returns
        the requests left to decode."""
        reqs = list(reqs)
        retracted = False
        reach, counts = [], []
        while reqs:
            reach = [self._decode_reach(r) for r in reqs]
            counts = [self.cache.pages_to_cover(r, n) for r, n in zip(reqs, reach)]
            need = sum(counts)
            if need <= self.cache.num_available_pages:
                break
            if len(reqs) == 1:
                self._fail_alone(reqs.pop(), need, inflight)
                break
            victim = min(reqs, key=lambda r: (len(r.output_ids), -len(r.input_ids)))
            reqs.remove(victim)
            self._retract(victim, inflight)
            retracted = True
        if reqs:
            self.cache.grow(reqs, reach, counts)
        if retracted and reqs:
            self.token_ratio.after_retraction(
                sum(len(r.output_ids) for r in reqs),
                sum(r.sampling.max_new_tokens for r in reqs),
                len(reqs),
            )
        elif reqs:
            self.token_ratio.step()
        return reqs

    def _decode_reach(self, req: Req) -> int:
        """Positions a decode step planned now may write up to (exclusive): the committed
        length, the in-flight steps' and this step's tokens, and one step of slack."""
        return req.seq_len + self.layout.run_past_headroom

    def _retract(self, req: Req, inflight: list[RowRecord]) -> None:
        """Mutates: take a decoding request out of the running batch to resume later by
        recompute. Its pages and row go back with nothing inserted into the tree; its slots
        too, except the targets of its in-flight steps (freed when those are processed).
        Its outputs stay: on resume it prefills prompt + outputs and continues."""
        self.running.remove(req)
        self.cache.drop(req)
        self.policy.retract(req, inflight)
        req.phase = Phase.WAITING
        req.fill_ids, req.fill_len, req.seq_len = [], 0, 0
        self.waiting.appendleft(req)
        req.num_retractions += 1
        self.num_retractions += 1
        logger.info(
            "retracted request %s (%d prompt + %d output tokens) to free KV; %d running",
            req.rid,
            len(req.input_ids),
            len(req.output_ids),
            len(self.running),
        )

    def _fail_alone(self, req: Req, need: int, inflight: list[RowRecord]) -> None:
        """Mutates: ``req`` needs more pages than the pool can give it with every other
        request retracted: it ends with an error, freeing as a retraction does."""
        self.running.remove(req)
        self.cache.drop(req)
        self.policy.retract(req, inflight)
        req.phase = Phase.FINISHED
        req.finish_reason = {
            "type": "abort",
            "message": (
                f"the request does not fit in the KV pool: its next decode step needs {need} "
                f"more pages, {self.cache.num_available_pages} can be had with every other "
                f"request retracted ({len(req.input_ids)} prompt + {len(req.output_ids)} "
                "output tokens so far)"
            ),
            "status_code": 400,
        }
        logger.warning("request %s failed: %s", req.rid, req.finish_reason["message"])

    def _plan_decode(self, reqs: list[Req]) -> StepPlan:
        records = [self.policy.plan_decode(req) for req in reqs]
        for req in reqs:
            req.inflight_decode += 1
        updates, chunks = self._table_updates(records)
        constrained = [req for req in reqs if req.grammar is not None]
        # a grammar row's mask follows each token on the host: no K-step program
        num_verify = 1 if constrained and self.layout.num_verify == 1 else None
        batch = build_decode(
            self.layout, records, updates, num_verify=num_verify, sampling_memo=self._sampling_memo
        )
        return StepPlan("decode", records, batch, chunks, grammar_reqs=constrained)

    def grammar_masks(self, plan: StepPlan) -> tuple[np.ndarray, np.ndarray]:
        """The request rows [n] and bitmasks [n, D, W] of ``plan.grammar_reqs``: position j's
        mask is the matcher state after the request's first j drafts (``Req.next_drafts``:
        the previous step's, read back). For a decode plan, call it once every step
        launched before it is processed (its masks follow their tokens and drafts); a
        prefill plan's at once (its first token has no step before it that samples, so the
        matchers are where the plan found them). A request that ended
        since ``plan`` was planned (its outputs of ``plan`` are dropped; a finished request
        keeps its row number) gets every token allowed. Reads only: each matcher ends where
        it started."""
        reqs = plan.grammar_reqs
        # a step without speculation samples one position (the rest stay zero)
        num_pos = plan.batch.num_verify if plan.kind == "decode" else self.layout.num_verify
        width = reqs[0].grammar.width if reqs else 0
        words = np.zeros((len(reqs), self.layout.num_verify, width), np.int32)
        for i, req in enumerate(reqs):
            if req.finished:
                words[i] = -1
            else:
                req.grammar.fill_masks(words[i, :num_pos], req.next_drafts[: num_pos - 1])
        # a retraction comes only from planning, before the plan: its requests hold rows
        assert all(req.phase is not Phase.WAITING for req in reqs), "retracted after its plan"
        return np.array([req.req_row for req in reqs], np.int32), words

    def _table_updates(self, records: list[RowRecord]) -> tuple[np.ndarray, list[np.ndarray]]:
        """The pending request-table updates of the rows a step reads: the batch's part and
        the chunks applied before it."""
        updates = self.cache.take_updates([record.req.req_row for record in records])
        return split_table_updates(self.layout, updates)

    # ------------------------------------------------------------------ results

    def process(
        self, plan: StepPlan, results: dict[str, np.ndarray], inflight: Iterable[RowRecord]
    ) -> None:
        """Apply step results; ``inflight`` holds the records of the step launched after it
        (empty without overlap)."""
        inflight = list(inflight)
        if plan.kind == "extend":
            self._process_extend(plan, results, inflight)
        else:
            self._process_decode(plan, results, inflight)

    def _process_extend(self, plan: StepPlan, results, inflight: list[RowRecord]) -> None:
        for b, record in enumerate(plan.records):
            req = record.req
            self.policy.free_retired(record)
            if req.finished or req.phase is Phase.WAITING:
                continue  # finished, or retracted since this step was planned
            self.policy.settle_extend(record)
            if req.next_prompt_logprob is not None:
                take_prompt_logprobs(req, record.start, record.num_new, results, b)
            if record.is_last_chunk:
                self._cache_prefill_checkpoint(req, inflight)
                if req.sampling.max_new_tokens == 0:
                    self._finish(req, {"type": "length", "length": 0}, inflight)
                    continue
                self._read_drafts(req, results, b)
                self._append(
                    req,
                    [int(results["token"][b])],
                    [float(results["logprob"][b])],
                    [top_pairs(results, b, None)] if req.return_logprob else None,
                    inflight,
                )

    def _process_decode(self, plan: StepPlan, results, inflight: list[RowRecord]) -> None:
        interval = self.layout.track_interval
        # a step that verified the engine's D (every step of an engine without speculation,
        # whose K-step programs count as K one-token steps)
        speculative = self.layout.num_verify > 1
        verified = plan.batch.num_verify == self.layout.num_verify or not speculative
        self.num_spec_off_steps += not verified
        # Python values, converted once for the whole step (indexing the arrays row by row
        # is a numpy scalar per read)
        accept_lens, pres = results["accept_len"].tolist(), results["pre"].tolist()
        crossed, all_tokens = results["crossed"].tolist(), results["tokens"].tolist()
        all_logprobs = results["logprobs"].tolist()
        for b, record in enumerate(plan.records):
            req = record.req
            req.inflight_decode -= 1
            self.policy.free_retired(record)
            if req.finished or req.phase is Phase.WAITING:
                continue  # finished, or retracted since this step was planned
            self._read_drafts(req, results, b)
            n, pre = accept_lens[b], pres[b]
            req.seq_len = pre + n
            tokens = all_tokens[b][:n]
            finishing = self._would_finish(req, tokens)
            boundary = ((pre + n) // interval) * interval
            self.policy.settle_decode(record, bool(crossed[b]), boundary, finishing)
            before = len(req.output_ids)
            self._append(
                req,
                tokens,
                all_logprobs[b][:n],
                [top_pairs(results, b, i) for i in range(n)] if req.return_logprob else None,
                inflight,
            )
            if verified:
                # a K-step program counts the tokens the request kept as one-token steps
                kept = len(req.output_ids) - before
                steps, accepted = (1, n) if speculative else (kept, 1)
                req.spec_verify_ct += steps
                req.accept_hist.extend([accepted] * steps)
                self.num_verify_steps += steps
                self.accept_counts[accepted] += steps

    @staticmethod
    def _read_drafts(req: Req, results: dict[str, np.ndarray], b: int) -> None:
        """A grammar row keeps the drafts its next verify reads (its masks follow them)."""
        if req.grammar is not None and "drafts" in results:
            req.next_drafts = [int(t) for t in results["drafts"][b]]

    def _would_finish(self, req: Req, tokens: list[int]) -> bool:
        remaining = req.sampling.max_new_tokens - len(req.output_ids)
        if len(tokens) >= remaining:
            return True
        if len(req.input_ids) + len(req.output_ids) + len(tokens) >= self.layout.max_request_len:
            return True
        return any(self._is_stop(req, t) for t in tokens)

    def _is_stop(self, req: Req, token: int) -> bool:
        if token in req.sampling.stop_token_ids:
            return True
        if req.grammar is not None and token in self.eos_ids:
            return True  # the grammar's stop tokens are the EOS ids: it terminates
        return not req.sampling.ignore_eos and token in self.eos_ids

    def _append(
        self,
        req: Req,
        tokens: list[int],
        logprobs: list[float],
        tops: list[list[tuple[float, int]]] | None,
        inflight: list[RowRecord],
    ) -> None:
        """``tops``: each token's top logprobs, None when ``req`` does not return them."""
        limit = self.layout.max_request_len
        for i, (token, logprob) in enumerate(zip(tokens, logprobs)):
            req.output_ids.append(token)
            req.output_logprobs.append(logprob)
            if tops is not None:
                req.output_top_logprobs.append(tops[i])
            if req.grammar is not None and not req.grammar.accept(token):
                reason = {
                    "type": "abort",
                    "message": f"token {token} is outside the request's grammar",
                    "status_code": 500,
                }
                self._finish(req, reason, inflight)
                return
            if self._is_stop(req, token):
                self._finish(req, {"type": "stop", "matched": token}, inflight)
                return
            if len(req.output_ids) >= req.sampling.max_new_tokens:
                reason = {"type": "length", "length": req.sampling.max_new_tokens}
                self._finish(req, reason, inflight)
                return
            if len(req.input_ids) + len(req.output_ids) >= limit:
                self._finish(req, {"type": "length", "length": len(req.output_ids)}, inflight)
                return

    def _cache_chunk_checkpoint(self, req: Req) -> None:
        """Insert the checkpoint of ``req``'s previous prefill chunk before its next chunk is
        planned (the step writing it may still run; the next chunk writes a fresh keep)."""
        donation = self.policy.chunk_donation(req)
        if donation is None or donation.length <= req.prefix_len:
            return
        self._insert_running(req, donation.length)

    def _cache_prefill_checkpoint(self, req: Req, inflight: list[RowRecord]) -> None:
        """Insert the prompt up to its last checkpoint while the request keeps running (the
        keep slot's, or no_buffer's copy of the final state).

        The slot goes to the tree and the request continues with a fresh one, but only if
        no in-flight step may still write it (the first decode after a prefill is launched
        before the prefill result is processed).
        """
        donation = self.policy.donation(req, inflight, finished=False)
        if donation is None or donation.length <= req.prefix_len:
            return
        self._insert_running(req, donation.length)

    def _insert_running(self, req: Req, length: int) -> None:
        slot = self.policy.take_keep(req, length)
        if slot is None:
            return
        if not self.cache.cache_req(req, length, slot, finished=False):
            self.policy.give_back(slot)

    # ------------------------------------------------------------------ finishing

    def abort(self, rid: str) -> bool:
        """Drop a request; nothing of it enters the cache. False if it is unknown."""
        return self._end(rid, {"type": "abort"}, inflight=())

    def stop(
        self, rid: str, inflight: Iterable[RowRecord], reason: dict[str, Any] | None = None
    ) -> bool:
        """Finish a request early (e.g. a stop string matched on the text side); its safe
        checkpoint is cached as for any finish (``inflight``: the launched, unprocessed
        step's records). False if it is unknown."""
        return self._end(rid, reason or {"type": "stop"}, list(inflight))

    def _end(self, rid: str, reason: dict[str, Any], inflight: Iterable[RowRecord]) -> bool:
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                req.phase = Phase.FINISHED
                req.finish_reason = reason
                return True
        for req in self.running:
            if req.rid == rid:
                self._finish(req, reason, inflight)
                return True
        return False

    def _finish(self, req: Req, reason: dict[str, Any], inflight: Iterable[RowRecord]) -> None:
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
            self._release(req, reason.get("type") != "abort", inflight)
        req.phase = Phase.FINISHED

    def _release(self, req: Req, insert: bool, inflight: Iterable[RowRecord]) -> None:
        """Donate the request's safe checkpoint to the tree, then return its slots, pages
        and row."""
        donation = self.policy.donation(req, inflight, finished=True) if insert else None
        length, slot = (donation.length, donation.slot) if donation else (0, NO_SLOT)
        taken = self.cache.cache_req(req, length, slot, finished=True)
        self.policy.release(req, kept=slot if taken else NO_SLOT)
