"""The offline engine, shaped like ``sglang.Engine``: generate / flush_cache / server info.

The loop is the overlapped one of DESIGN §5: plan step n+1, launch it, then read back and
process step n. ``disable_overlap_schedule`` processes each step right after launching it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from typing import Any

import numpy as np

from lazyspec.cache.allocators import KVAllocator, SlotAllocator, check_all
from lazyspec.cache.radix_cache import RadixCache
from lazyspec.config import EngineConfig
from lazyspec.engine.runner import PoolSizes, Runner
from lazyspec.engine.steps import StepStatic
from lazyspec.scheduler.request import NO_SLOT, TOP_LOGPROBS, Req, SamplingParams
from lazyspec.scheduler.scheduler import Scheduler, SchedulerLimits
from lazyspec.scheduler.tracking import CheckpointTracker

logger = logging.getLogger(__name__)

MAX_EXTEND_ROWS = 4


def _powers_of_two_up_to(limit: int) -> tuple[int, ...]:
    out, n = [], 1
    while n < limit:
        out.append(n)
        n *= 2
    out.append(limit)
    return tuple(sorted(set(out)))


class Engine:
    """``Engine(model_path=..., **EngineConfig fields)`` or ``Engine(model=Model, ...)``."""

    def __init__(self, model: Any = None, **kwargs: Any) -> None:
        self.config = EngineConfig(**kwargs)
        if model is None:
            if self.config.model_path is None:
                raise ValueError("Engine needs model_path (a Hugging Face model folder) or model=")
            from lazyspec.models import load_model

            model = load_model(self.config.model_path, dtype=self.config.dtype)
        self.model = model
        cfg = model.config
        if self.config.spec_enabled and "mtp" not in model.params:
            raise ValueError(
                f"speculative_algorithm={self.config.speculative_algorithm} needs an MTP head, "
                f"but the checkpoint at {self.config.model_path!r} has no mtp.* weights"
            )
        self._build(cfg)
        self._ids = itertools.count()
        self._inflight = None
        self._hit_tokens = 0
        self._prompt_tokens = 0
        if not self.config.skip_warmup:
            self.warmup()

    # ------------------------------------------------------------------ construction

    def _build(self, cfg: Any) -> None:
        c = self.config
        slots_per_req = 1 + c.checkpoint_slots_per_request
        max_running = c.max_running_requests or 16
        # default pool: room for extra_buffer's 3 pinned slots per request plus as many
        # cached checkpoints again (independent of the strategy, so shapes are shared)
        num_slots = c.max_mamba_cache_size or max_running * 6
        cap = num_slots // (slots_per_req + (1 if c.strategy == "extra_buffer_lazy" else 0))
        if cap < max_running:
            logger.warning(
                "max_running_requests capped from %d to %d by %d state slots "
                "(%d pinned per running request)",
                max_running,
                cap,
                num_slots,
                slots_per_req,
            )
            max_running = max(cap, 1)
        context = c.context_length or min(cfg.max_position_embeddings, c.max_total_tokens)
        context = -(-context // c.page_size) * c.page_size
        num_pages = -(-c.max_total_tokens // c.page_size)
        from lazyspec.kernels.backend import resolve_backend

        backend = resolve_backend(c.kernel_backend)  # pallas on GPU, xla on CPU and TPU
        self.sizes = PoolSizes(
            num_slots=num_slots,
            max_reqs=max_running,
            num_pages=num_pages,
            page_size=c.page_size,
            context_len=context,
            num_draft_positions=max(1, c.num_verify_tokens - 1),
        )
        static = StepStatic(
            num_slots=num_slots,
            max_reqs=max_running,
            num_kv_rows=(num_pages + 1) * c.page_size,
            chunk_size=c.mamba_chunk_size,
            num_verify=c.num_verify_tokens,
            spec=c.spec_enabled,
            backend=backend,
        )
        self.runner = Runner(self.model, self.sizes, static, c.dtype, c.mamba_ssm_dtype)
        self.kv_allocator = KVAllocator(num_pages, c.page_size)
        self.slot_allocator = SlotAllocator(num_slots)
        self.tree = RadixCache(
            c.page_size, self.kv_allocator, self.slot_allocator, disable=c.disable_radix_cache
        )
        self.tracker = CheckpointTracker(
            c.strategy,
            c.mamba_track_interval,
            c.num_verify_tokens,
            self.slot_allocator,
            self.tree,
            fail_spare_alloc=c.debug_fail_spare_alloc,
            evict_on_failure=c.debug_lazy_evict_on_failure,
        )
        limits = SchedulerLimits(
            max_running=max_running,
            max_reqs=max_running,
            context_len=context,
            chunked_prefill=c.chunked_prefill_size,
            chunk=c.mamba_chunk_size,
            max_extend_rows=MAX_EXTEND_ROWS,
            num_verify=c.num_verify_tokens,
            eos_ids=cfg.eos_token_ids,
        )
        lengths = tuple(
            n * c.mamba_chunk_size
            for n in _powers_of_two_up_to(c.chunked_prefill_size // c.mamba_chunk_size)
        )
        self.extend_buckets = (_powers_of_two_up_to(min(MAX_EXTEND_ROWS, max_running)), lengths)
        self.decode_buckets = _powers_of_two_up_to(max_running)
        self.scheduler = Scheduler(
            limits,
            self.kv_allocator,
            self.slot_allocator,
            self.tree,
            self.tracker,
            c.page_size,
            self.extend_buckets,
            self.decode_buckets,
        )
        self.max_running = max_running
        self._log_memory_plan(slots_per_req)

    def _log_memory_plan(self, slots_per_req: int) -> None:
        slot_bytes = self.runner.slot_bytes()
        self.memory_plan = {
            "strategy": self.config.strategy,
            "bytes_per_state_slot": slot_bytes,
            "state_slots": self.sizes.num_slots,
            "slots_per_running_request": slots_per_req,
            "transient_spare_slots": 1 if self.config.strategy == "extra_buffer_lazy" else 0,
            "max_running_requests": self.max_running,
            "slots_left_for_cached_checkpoints": self.sizes.num_slots
            - slots_per_req * self.max_running,
            "kv_tokens": self.sizes.num_pages * self.sizes.page_size,
            "kv_bytes_per_token": self.runner.kv_bytes_per_token(),
            "context_length": self.sizes.context_len,
        }
        logger.info("memory plan: %s", self.memory_plan)

    def warmup(self) -> None:
        """Compile every bucket shape now, so serving compiles nothing new."""
        from lazyspec.scheduler.batch import decode_arrays, extend_arrays

        sizes = self.sizes
        for rows in self.extend_buckets[0]:
            for length in self.extend_buckets[1]:
                arrays = extend_arrays(
                    rows, length, sizes.context_len, sizes.num_slots, sizes.max_reqs
                )
                self.runner.fetch(self.runner.launch("extend", arrays))
        for rows in self.decode_buckets:
            arrays = decode_arrays(
                rows,
                sizes.context_len,
                sizes.num_slots,
                sizes.max_reqs,
                self.config.mamba_track_interval,
            )
            self.runner.fetch(self.runner.launch("decode", arrays))

    # ------------------------------------------------------------------ requests

    def _tokenize(self, prompt: str) -> list[int]:
        if self.model.tokenizer is None:
            raise ValueError("this model folder has no tokenizer.json: pass input_ids")
        return list(self.model.tokenizer.encode(prompt).ids)

    def add_request(
        self,
        input_ids: list[int] | None = None,
        prompt: str | None = None,
        sampling_params: dict | SamplingParams | None = None,
        return_logprob: bool = False,
        rid: str | None = None,
    ) -> Req:
        if input_ids is None:
            if prompt is None:
                raise ValueError("give prompt or input_ids")
            input_ids = self._tokenize(prompt)
        input_ids = [int(t) for t in input_ids]
        if not input_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model.config.vocab_size
        bad = [t for t in input_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        sampling = (
            sampling_params
            if isinstance(sampling_params, SamplingParams)
            else SamplingParams.from_dict(sampling_params)
        )
        limit = self.sizes.context_len - 3 * self.config.num_verify_tokens
        if len(input_ids) + sampling.max_new_tokens > limit:
            raise ValueError(
                f"prompt ({len(input_ids)} tokens) + max_new_tokens ({sampling.max_new_tokens}) "
                f"exceeds the context limit {limit}"
            )
        req = Req(
            rid=rid or f"req-{next(self._ids)}",
            input_ids=input_ids,
            sampling=sampling,
            return_logprob=return_logprob,
        )
        self.scheduler.add(req)
        return req

    def step(self) -> None:
        """One iteration of the (overlapped) loop."""
        sched = self.scheduler
        plan = sched.schedule()
        outputs = self.runner.launch(plan.kind, plan.arrays) if plan else None
        if self.config.disable_overlap_schedule:
            sched.inflight = []
            if plan:
                sched.process(plan, self.runner.fetch(outputs))
            return
        previous = self._inflight
        self._inflight = (plan, outputs) if plan else None
        sched.inflight = plan.records if plan else []
        if previous:
            sched.process(previous[0], self.runner.fetch(previous[1]))

    @property
    def busy(self) -> bool:
        return self.scheduler.has_work or self._inflight is not None

    def run_until_done(self, reqs: Iterable[Req], check=None) -> None:
        pending = list(reqs)
        while not all(r.finished for r in pending) or self._inflight is not None:
            self.step()
            if check is not None:
                check(self)

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
    ) -> dict | list[dict]:
        batched = isinstance(prompt, list) or (
            input_ids is not None and input_ids and isinstance(input_ids[0], list)
        )
        prompts = prompt if isinstance(prompt, list) else [prompt]
        ids = input_ids if batched and input_ids is not None else [input_ids]
        count = max(len(prompts), len(ids))
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * count
        reqs = [
            self.add_request(
                input_ids=ids[i] if input_ids is not None else None,
                prompt=prompts[i] if prompt is not None else None,
                sampling_params=params[i],
                return_logprob=return_logprob,
            )
            for i in range(count)
        ]
        if not 0 <= top_logprobs_num <= TOP_LOGPROBS:
            raise ValueError(f"top_logprobs_num={top_logprobs_num} must be in [0, {TOP_LOGPROBS}]")
        self.run_until_done(reqs)
        results = [self.result(r, top_logprobs_num) for r in reqs]
        return results if batched else results[0]

    def result(self, req: Req, top_logprobs_num: int = 0) -> dict:
        meta = {
            "id": req.rid,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "finish_reason": req.finish_reason,
            "spec_verify_ct": req.spec_verify_ct,
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = list(zip(req.output_logprobs, req.output_ids))
            if top_logprobs_num:
                meta["output_top_logprobs"] = [
                    top[:top_logprobs_num] for top in req.output_top_logprobs
                ]
        text = ""
        if self.model.tokenizer is not None:
            text = self.model.tokenizer.decode(req.output_ids)
        return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}

    # ------------------------------------------------------------------ admin

    def flush_cache(self) -> bool:
        if self.busy:
            return False
        self.tree.flush()
        return True

    def check_integrity(self) -> None:
        """AssertionError unless every slot and every KV page is exactly one of free, cached
        in the tree, or held by one running request; also the allocator and tree invariants.

        A running request holds its working / keep / spare slots and ``own_pages`` (the pages
        it allocated and still owns: pages reached through a prefix match are the tree's).
        """
        running = self.scheduler.running
        held_slots = [
            slot
            for r in running
            for slot in {r.working_slot, r.keep_slot, r.spare_slot} - {NO_SLOT}
        ]
        held_pages = [int(p) for r in running if r.own_pages is not None for p in r.own_pages]
        check_all(self.kv_allocator, self.slot_allocator, self.tree, held_slots, held_pages)

    def get_server_info(self) -> dict:
        sched = self.scheduler
        steps, counts = sched.num_verify_steps, sched.accept_counts
        mean_accept = float(np.dot(np.arange(len(counts)), counts) / steps) if steps else None
        info = dict(self.memory_plan)
        info.update(
            {
                "num_running_requests": len(self.scheduler.running),
                "num_waiting_requests": len(self.scheduler.waiting),
                "free_state_slots": self.slot_allocator.num_free,
                "cached_state_slots": self.tree.num_cached_slots,
                "free_kv_tokens": self.kv_allocator.num_free_tokens,
                "cached_kv_tokens": self.tree.num_cached_tokens,
                "spare_alloc_failures": self.tracker.num_spare_failures,
                "speculative_algorithm": self.config.speculative_algorithm,
                "num_verify_tokens": self.config.num_verify_tokens,
                "num_verify_steps": steps,
                "num_compiled_programs": self.runner.num_compiled(),
                "avg_accept_length": mean_accept,
                "cache_hit_tokens": self.tree.stats.num_matched_tokens,
                "cache_queried_tokens": self.tree.stats.num_queried_tokens,
            }
        )
        if steps and self.config.spec_enabled:
            # fraction of verify steps that accepted the draft at position i (1-based)
            info["per_position_acceptance"] = [
                float(counts[i + 2 :].sum() / steps) for i in range(len(counts) - 2)
            ]
        return info

    def shutdown(self) -> None:
        while self._inflight is not None:
            self.step()
