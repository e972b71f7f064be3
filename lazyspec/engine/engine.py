"""The offline engine, shaped like ``sglang.Engine``: generate / flush_cache / server info.

The loop is the overlapped one of DESIGN §5: plan step n+1, launch it, then read back and
process step n. A decode step with grammar rows is launched in two programs, its masks
filled between them, after step n is processed. ``disable_overlap_schedule`` processes each
step right after launching it.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from lazyspec.cache.allocators import KVAllocator, SlotAllocator, check_all
from lazyspec.cache.radix_cache import RadixCache
from lazyspec.config import EngineConfig
from lazyspec.engine.host_cache import HostCache, build_host_tier
from lazyspec.engine.programs import FUSED, SPLIT
from lazyspec.engine.results import EngineStats, request_result
from lazyspec.engine.runner import PackedOutputs, Runner
from lazyspec.engine.steps import StepStatic
from lazyspec.scheduler.batch import mean_accept_length
from lazyspec.scheduler.cache import RequestCache
from lazyspec.scheduler.grammar import GrammarBackend, grammar_of, make_backend
from lazyspec.scheduler.layout import plan_memory
from lazyspec.scheduler.policy import RowRecord, SlotPolicy
from lazyspec.scheduler.request import TOP_LOGPROBS, Req, SamplingParams
from lazyspec.scheduler.scheduler import Scheduler
from lazyspec.scheduler.token_ratio import NewTokenRatio
from lazyspec.token_map import draft_token_ids, read_token_map

logger = logging.getLogger(__name__)


class Engine:
    """``Engine(model_path=..., **EngineConfig fields)`` or ``Engine(model=Model, ...)``."""

    def __init__(
        self,
        model: Any = None,
        warmup_progress: Callable[[int, int], None] | None = None,
        background_warmup: bool = False,
        **kwargs: Any,
    ) -> None:
        """``warmup_progress(done, total)`` is called as warm-up compiles; with
        ``background_warmup`` the engine is built once the programs a first request needs
        are compiled (see ``warmup``)."""
        self.config = c = EngineConfig(**kwargs)
        from lazyspec.engine import multihost
        from lazyspec.engine.sharding import sharding_plan

        multihost.initialize(c)  # several processes: join them before touching a device

        if model is None:
            if c.model_path is None:
                raise ValueError("Engine needs model_path (a Hugging Face model folder) or model=")
            from lazyspec.models import load_model
            from lazyspec.models.registry import load_model_config

            # the mesh first, so that each device reads only its slices of the checkpoint
            self.sharding = sharding_plan(load_model_config(c.model_path), c.tp_size, c.nnodes)
            model = load_model(
                c.model_path,
                dtype=c.dtype,
                place=self.sharding.sharding,
                load_format=c.load_format,
                seed=c.random_seed,
            )
        else:
            self.sharding = sharding_plan(model.config, c.tp_size, c.nnodes)
        self.model = model
        self.config = c = c.for_platform(self.sharding.platform)
        cfg = model.config
        if self.config.spec_enabled and "mtp" not in model.params:
            raise ValueError(
                f"speculative_algorithm={self.config.speculative_algorithm} needs an MTP head, "
                f"but the checkpoint at {self.config.model_path!r} has no mtp.* weights"
            )
        self._build(cfg)
        self._ids = itertools.count()
        self._inflight = None
        self._compiler = None  # the table compiling or compiled (``warmup.TableCompiler``)
        # built now (its library is imported at the first compile) so that threads share it
        self._grammars = (
            make_backend(c.grammar_backend, model.tokenizer, cfg.vocab_size, cfg.eos_token_ids)
            if model.tokenizer is not None
            else None
        )
        # the other processes compile as process 0's warm-up sends them its calls (follow)
        if not self.config.skip_warmup and self.config.is_leader:
            self.warmup(warmup_progress, background_warmup)

    # ------------------------------------------------------------------ construction

    def _build(self, cfg: Any) -> None:
        c = self.config
        layout = self.layout = plan_memory(c, cfg)
        if layout.max_running < layout.requested_running:
            logger.warning(
                "max_running_requests capped from %d to %d by %d state slots "
                "(%d per running request at most)",
                layout.requested_running,
                layout.max_running,
                layout.num_slots,
                layout.strategy.peak_slots,
            )
        from lazyspec.kernels.backend import default_tuning, resolve_backend
        from lazyspec.kernels.tuning import parse_overrides

        tuning = default_tuning().with_overrides(parse_overrides(c.kernel_tuning))
        static = StepStatic(
            num_slots=layout.num_slots,
            max_running=layout.max_running,
            num_kv_rows=layout.num_kv_rows,
            chunk_size=layout.chunk_size,
            num_verify=layout.num_verify,
            spec=c.spec_enabled,
            backend=resolve_backend(c.kernel_backend),  # pallas on GPU, xla on CPU / TPU
            moe_runner=c.moe_runner_backend,
            tuning=tuning,
            page_size=layout.page_size,
        )
        from lazyspec.engine.multihost import StepBroadcast

        # several processes: process 0 sends every device call, the others receive them
        self.broadcast = StepBroadcast(layout) if c.nnodes > 1 else None
        self.runner = Runner(
            self.model,
            layout,
            static,
            c.dtype,
            c.mamba_ssm_dtype,
            self.sharding,
            broadcast=self.broadcast if c.is_leader else None,
            draft_token_ids=self._draft_token_ids(cfg),
            decode_copies=c.decode_program_copies or self._default_decode_copies(),
            grammar=self._grammar_form(),
        )
        self.kv_allocator = KVAllocator(layout.num_pages, layout.page_size)
        self.slot_allocator = SlotAllocator(layout.num_slots)
        self.tree = RadixCache(
            layout.page_size,
            self.kv_allocator,
            self.slot_allocator,
            disable=c.disable_radix_cache,
            eviction=c.mamba_cache_policy,
            host=build_host_tier(c, layout, self.runner),
        )
        self.host_cache = HostCache(self.runner, self.tree.host) if self.tree.host else None
        self.policy = SlotPolicy(
            layout.strategy,
            layout.track_interval,
            layout.decode_positions,
            self.slot_allocator,
            self.tree,
            grid=layout.prefill_track_grid,
            fail_spare_alloc=c.debug_fail_spare_alloc,
            evict_on_failure=c.debug_lazy_evict_on_failure,
        )
        cache = RequestCache(layout, self.tree, self.kv_allocator, self.slot_allocator)
        self.scheduler = Scheduler(
            layout,
            self.policy,
            cache,
            cfg.eos_token_ids,
            NewTokenRatio(c.schedule_conservativeness),
            schedule_policy=c.schedule_policy,
        )
        self.max_running = layout.max_running
        self._memory_plan = layout.memory_plan(
            self.runner.slot_bytes(), self.runner.kv_bytes_per_token()
        )
        self._memory_plan.update(self.runner.bytes_per_device())
        self._memory_plan.update(self.host_cache.memory_plan() if self.host_cache else {})
        logger.info("memory plan: %s", self._memory_plan)

    def _draft_token_ids(self, cfg: Any) -> np.ndarray | None:
        """The speculative token map's ids completed for this model (EOS added, padded), or
        None without a map; ValueError naming an id outside the vocabulary."""
        path = self.config.speculative_token_map
        if path is None:
            return None
        ids = draft_token_ids(read_token_map(path), cfg.vocab_size, cfg.eos_token_ids)
        logger.info(
            "speculative token map %s: the draft head scores %d of %d token ids (%d columns)",
            path,
            len(np.unique(ids)),
            cfg.vocab_size,
            len(ids),
        )
        return ids

    def _grammar_form(self) -> str | None:
        """How batches with grammar rows run (``programs.program_keys``): none without a
        tokenizer or a grammar backend; split around their masks in the overlapped loop,
        fused without it."""
        if self.model.tokenizer is None or self.config.grammar_backend == "none":
            return None
        return FUSED if self.config.disable_overlap_schedule else SPLIT

    def _default_decode_copies(self) -> int:
        """Two copies of the decode program where programs run as CUDA graphs (``StepCalls``)."""
        return 2 if self.sharding.platform == "gpu" else 1

    def warmup(
        self, progress: Callable[[int, int], None] | None = None, background: bool = False
    ) -> None:
        """Compile every program of the runner's table, in a thread pool, and run each once
        (``warmup.compile_table``), so serving compiles nothing new. With ``background``,
        return once the programs a first request needs are compiled and run; the rest
        compile on (``warmup_status``), and a step that needs one waits for it.

        ``progress(done, total)`` is called with ``done = 0`` first and after each program
        waited for; an exception it raises stops the warm-up (and propagates)."""
        from lazyspec.engine.warmup import compile_table, warm_in_turn

        if self.broadcast is not None:  # the other processes compile as they follow
            warm_in_turn(self.runner, progress)
            return
        self._compiler = compile_table(
            self.runner, progress, background, self.config.compile_threads
        )

    def warmup_status(self) -> dict | None:
        """The program table's compilation, its counts and the persistent compilation
        cache's hits and misses (``TableCompiler.status``); None if it was not compiled
        ahead. Safe from any thread."""
        return None if self._compiler is None else self._compiler.status()

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
        logprob_start_len: int | None = None,
    ) -> Req:
        """Queue a request. ``logprob_start_len`` asks for the logprobs of the prompt tokens
        from that index on (in [0, prompt length); its prefix is then matched in the cache
        only up to there, so the positions are computed)."""
        if input_ids is None:
            if prompt is None:
                raise ValueError("give prompt or input_ids")
            input_ids = self._tokenize(prompt)
        input_ids = [int(t) for t in input_ids]
        if not input_ids:
            raise ValueError("the prompt is empty")
        vocab = self.vocab_size
        bad = [t for t in input_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        sampling = (
            sampling_params
            if isinstance(sampling_params, SamplingParams)
            else SamplingParams.from_dict(sampling_params)
        )
        sampling.validate(vocab_size=vocab)
        grammar = grammar_of(sampling)
        limit = self.max_request_len
        if len(input_ids) + sampling.max_new_tokens > limit:
            raise ValueError(
                f"prompt ({len(input_ids)} tokens) + max_new_tokens ({sampling.max_new_tokens}) "
                f"exceeds the context limit {limit}"
            )
        if logprob_start_len is not None and (
            isinstance(logprob_start_len, bool)
            or not isinstance(logprob_start_len, int)
            or not 0 <= logprob_start_len < len(input_ids)
        ):
            raise ValueError(
                f"logprob_start_len={logprob_start_len!r} must be in [0, {len(input_ids)}) "
                "(the prompt's length)"
            )
        req = Req(
            rid=rid or f"req-{next(self._ids)}",
            input_ids=input_ids,
            sampling=sampling,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
        )
        if grammar is not None:
            req.grammar = self.grammar_backend.matcher(*grammar)
        self.scheduler.add(req)
        return req

    @property
    def grammar_backend(self) -> GrammarBackend:
        """The grammar compiler of this model's tokenizer (ValueError without one, or with
        grammar_backend none). Thread-safe: a server compiles in its parse threads."""
        if self._grammars is None:
            if self.config.grammar_backend == "none":
                raise ValueError("structured output is off on this server (--grammar-backend none)")
            raise ValueError("constrained decoding needs the model folder's tokenizer.json")
        return self._grammars

    def check_grammar(self, sampling: SamplingParams) -> None:
        """Compile ``sampling``'s grammar if it has one (cached for ``add_request``);
        ValueError with the compiler's message if it is malformed. Safe from any thread."""
        grammar = grammar_of(sampling)
        if grammar is not None:
            self.grammar_backend.compile(*grammar)

    def step(self) -> None:
        """One iteration of the (overlapped) loop: plan and launch step n+1, then process
        step n's results with step n+1's records as the in-flight ones."""
        if not self.config.is_leader:
            raise RuntimeError(
                f"node_rank={self.config.node_rank} runs no scheduler: call follow(), and send "
                "requests to node_rank 0"
            )
        sched, runner = self.scheduler, self.runner
        sync = self.config.disable_overlap_schedule
        plan = sched.schedule(self._inflight_records())
        self._issue_copies()  # the host tier's, before any program that follows them
        if plan and plan.kind == "decode" and plan.grammar_reqs and not sync:
            self._step_split(plan)
            return
        if plan and plan.grammar_reqs:
            # a prefill's first token is sampled under the matcher's state now (no step in
            # flight samples for its rows); without overlap every step is processed
            runner.update_vocab_masks(*sched.grammar_masks(plan))
        outputs = runner.launch(plan.batch, plan.table_chunks, plan.count_seeds) if plan else None
        if sync:
            if plan:
                sched.process(plan, runner.fetch(self._wanted(plan, outputs)), inflight=())
            self._complete_copies()
            return
        previous = self._inflight
        self._inflight = (plan, self._copy_back(self._wanted(plan, outputs))) if plan else None
        if previous:
            sched.process(previous[0], runner.fetch(previous[1]), self._inflight_records())
        self._complete_copies()

    def _step_split(self, plan) -> None:
        """The overlapped loop for a decode step with grammar rows, whose masks follow the
        tokens and drafts of the step in flight: launch the step's forward, process the
        step in flight (which advances the matchers), fill the masks while the device runs
        the forward, then launch the step's sampling and commit."""
        sched, runner = self.scheduler, self.runner
        pending = runner.launch_forward(plan.batch, plan.table_chunks, plan.count_seeds)
        previous, self._inflight = self._inflight, (plan, None)
        if previous:
            sched.process(previous[0], runner.fetch(previous[1]), plan.records)
        self._complete_copies()
        runner.update_vocab_masks(*sched.grammar_masks(plan))
        outputs = runner.launch_finish(pending)
        self._inflight = (plan, self._copy_back(self._wanted(plan, outputs)))

    @staticmethod
    def _wanted(plan, outputs: dict | PackedOutputs) -> dict | PackedOutputs:
        """The outputs the host reads of a step: the prompt logprobs and the top logprobs
        only if a row asked for them (a decode step's packed outputs are copied whole)."""
        if isinstance(outputs, PackedOutputs):
            return outputs
        skip = () if plan.prompt_logprobs else ("prompt_",)
        if not any(record.req.return_logprob for record in plan.records):
            skip += ("top_",)
        return {k: v for k, v in outputs.items() if not k.startswith(skip)}

    @staticmethod
    def _copy_back(outputs: dict | PackedOutputs) -> dict | PackedOutputs:
        """Start the device-to-host copies of a just-launched step's outputs (those it
        keeps in flight: ``_wanted``), so that they run when the step ends rather than when
        ``Runner.fetch`` asks, after the next step's launch (BENCHMARKS.md, "Engine decode
        step, 2026-12-02 (third)"); returns ``outputs``."""
        for value in [outputs] if isinstance(outputs, PackedOutputs) else outputs.values():
            value.copy_to_host_async()
        return outputs

    def _issue_copies(self) -> None:
        """Run the host tier's queued copies (``HostCache.issue``)."""
        if self.host_cache is not None:
            self.host_cache.issue()

    def _complete_copies(self) -> None:
        """Land the issued copies once the step launched after them was read back: their
        programs ran before it (``HostCache.complete``)."""
        if self.host_cache is not None:
            self.host_cache.complete()

    def _inflight_records(self) -> list[RowRecord]:
        """The records of the launched step whose results are not processed yet."""
        return self._inflight[0].records if self._inflight else []

    @property
    def busy(self) -> bool:
        """True while a request waits or runs or a step is in flight; reads only."""
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
        logprob_start_len: int | None = None,
    ) -> dict | list[dict]:
        if not 0 <= top_logprobs_num <= TOP_LOGPROBS:
            raise ValueError(f"top_logprobs_num={top_logprobs_num} must be in [0, {TOP_LOGPROBS}]")
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
                logprob_start_len=logprob_start_len,
            )
            for i in range(count)
        ]
        self.run_until_done(reqs)
        results = [self.result(r, top_logprobs_num) for r in reqs]
        return results if batched else results[0]

    def result(self, req: Req, top_logprobs_num: int = 0) -> dict:
        """``req``'s outputs and meta info as ``generate`` returns them; reads only."""
        return request_result(req, self.model.tokenizer, top_logprobs_num)

    # ------------------------------------------------------------------ admin

    def flush_cache(self) -> bool:
        """Empty the radix cache (both tiers, the host's copies in flight landed first);
        False, with nothing changed, while a request or step is in flight."""
        if self.busy:
            return False
        self._issue_copies()
        self._complete_copies()
        self.tree.flush()
        return True

    def check_integrity(self) -> None:
        """AssertionError unless every slot and every KV page is exactly one of free, cached
        in the tree, or held by one running request; also the allocator and tree invariants.

        A running request holds its working / keep / spare slots and ``own_pages`` (the pages
        it allocated and still owns: pages reached through a prefix match are the tree's).
        """
        running = self.scheduler.running
        held_slots = [slot for r in running for slot in r.slots.owned()]
        # a retracted request's slots that a launched step may still write
        held_slots += [slot for r in self.scheduler.waiting for slot in r.slots.retired]
        held_pages = [int(p) for r in running if r.own_pages is not None for p in r.own_pages]
        check_all(self.kv_allocator, self.slot_allocator, self.tree, held_slots, held_pages)
        self._check_table()

    def _check_table(self) -> None:
        """AssertionError unless the device request table equals the host's once the pending
        updates are applied (waits for the launched steps)."""
        cache = self.scheduler.cache
        table = self.runner.read_table()
        pending = cache.pending_updates()
        table[pending[0], pending[1]] = pending[2]
        wrong = np.argwhere(table != cache.req_to_token)
        assert not wrong.size, (
            f"device request table differs from the host's at (row, position) {wrong[:5]}"
        )

    def get_server_info(self) -> dict:
        sched = self.scheduler
        steps, counts = sched.num_verify_steps, sched.accept_counts
        mean_accept = mean_accept_length(counts)
        info = self.memory_plan
        # the plan's state_slots / kv_tokens keep their place; the counts follow in field order
        info.update(dataclasses.asdict(self.stats()))
        info.update(
            {
                "spare_alloc_failures": self.policy.num_spare_failures,
                "speculative_algorithm": self.config.speculative_algorithm,
                "num_verify_tokens": self.config.num_verify_tokens,
                "num_verify_steps": steps,
                "speculative_disable_by_batch_size": self.config.speculative_disable_by_batch_size,
                "num_decode_steps_without_speculation": sched.num_spec_off_steps,
                "num_compiled_programs": self.num_compiled(),
                "warmup": self.warmup_status(),
                "avg_accept_length": mean_accept,
                # once per admitted request (a request waiting for room is not re-counted)
                "cache_hit_tokens": sched.num_cached_tokens,
                "cache_queried_tokens": sched.num_admitted_tokens,
                "new_token_ratio": sched.token_ratio.value,
            }
        )
        info.update(self.host_cache_info())
        if steps and self.config.spec_enabled:
            # fraction of verify steps that accepted the draft at position i (1-based)
            info["per_position_acceptance"] = [
                float(counts[i + 2 :].sum() / steps) for i in range(len(counts) - 2)
            ]
        return info

    def shutdown(self) -> None:
        """Mutates: finishes the in-flight step; with several processes, then releases the
        others from ``follow`` (no step can run after that). Programs of the table not
        yet compiling are dropped."""
        if self._compiler is not None:
            self._compiler.cancel()
        while self._inflight is not None:
            self.step()
        if self.broadcast is not None and self.config.is_leader:
            self.broadcast.send_stop()

    def follow(self) -> int:
        """On node_rank > 0: make every device call process 0's engine makes (its warm-up
        included) until its ``shutdown``; returns the number of calls. Blocks."""
        if self.config.is_leader:
            raise RuntimeError("node_rank=0 runs the scheduler: it has no one to follow")
        return self.runner.follow(self.broadcast)

    # ------------------------------------------------------------------ serving surface
    # What a server may call. The engine is not thread-safe: call the methods that read or
    # change requests and pools from the one thread that calls ``step()``, between steps
    # (the server's engine thread). The facts fixed at construction (memory_plan onwards)
    # are safe to read from any thread.

    def abort(self, rid: str) -> bool:
        """Mutates: ends request ``rid`` with nothing cached; False if unknown or finished."""
        return self.scheduler.abort(rid)

    def stop(self, rid: str, reason: dict[str, Any] | None = None) -> bool:
        """Mutates: finishes ``rid`` early (default reason ``{"type": "stop"}``) and caches
        its safe checkpoint as for any finish; False if unknown or finished."""
        return self.scheduler.stop(rid, self._inflight_records(), reason)

    @property
    def has_requests(self) -> bool:
        """True while a request waits or runs (an in-flight step is not counted); reads only."""
        return self.scheduler.has_work

    def stats(self) -> EngineStats:
        """Request and pool counts now; reads only, cheap enough for every step."""
        return EngineStats(
            num_running_requests=len(self.scheduler.running),
            num_waiting_requests=len(self.scheduler.waiting),
            free_state_slots=self.slot_allocator.num_free,
            cached_state_slots=self.tree.num_cached_slots,
            free_kv_tokens=self.kv_allocator.num_free_tokens,
            cached_kv_tokens=self.tree.num_cached_tokens,
            state_slots=self.layout.num_slots,
            kv_tokens=self.layout.kv_tokens,
            num_retractions=self.scheduler.num_retractions,
        )

    def host_cache_info(self) -> dict[str, Any]:
        """The host tier's counts (``hicache_*``: host hits, tokens and states loaded and
        stored, bytes and host seconds); empty when it is off. Reads only."""
        return self.host_cache.info() if self.host_cache is not None else {}

    def num_compiled(self) -> int:
        """Device programs compiled so far (every bucket after warm-up); reads only."""
        return self.runner.num_compiled()

    @property
    def memory_plan(self) -> dict[str, Any]:
        """A copy of the pool sizing fixed at construction; safe to read at any time."""
        return dict(self._memory_plan)

    @property
    def max_request_len(self) -> int:
        """Largest prompt + max_new_tokens ``add_request`` accepts; fixed, safe any time."""
        return self.layout.max_request_len

    @property
    def vocab_size(self) -> int:
        """Token ids ``add_request`` accepts are ``0..vocab_size-1``; fixed, safe any time."""
        return self.model.config.vocab_size

    @property
    def tokenizer(self) -> Any:
        """The model folder's tokenizer (None without tokenizer.json); fixed, safe any time."""
        return self.model.tokenizer
