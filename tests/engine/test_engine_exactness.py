"""The engine's greedy output equals cache-free one-request-at-a-time recompute, for every
checkpoint strategy, with and without the overlapped loop, page sizes 1 and 4; no leaks;
the null slot and page are never written; after every step every state the radix cache
holds equals a cache-free recompute of its prefix's state (``TreeStateOracle``).
Nemotron-H in every case; Granite 4.0-H and Qwen3.5 once per strategy, with the
overlapped loop."""

from __future__ import annotations

import numpy as np
import pytest

from lazyspec.engine.engine import Engine
from lazyspec.testing.sinks import assert_null_sinks_zero
from lazyspec.testing.state_oracle import TreeStateOracle
from lazyspec.testing.tiny_models import reference_greedy, tiny_model

INTERVAL = 64
NUM_NEW = (12, 20, 7, 16)


def _workload(seed: int = 0) -> list[list[int]]:
    """12 prompts: three shared prefixes, mixed lengths (odd, chunk-crossing)."""
    rng = np.random.default_rng(seed)
    prefixes = [list(rng.integers(3, 128, size=n)) for n in (70, 130, 5)]
    prompts = []
    for i in range(12):
        suffix = list(rng.integers(3, 128, size=int(rng.integers(1, 60))))
        prompts.append(prefixes[i % 3] + suffix)
    return prompts


@pytest.fixture(scope="module")
def expected():
    model = tiny_model()
    prompts = _workload()
    return prompts, [reference_greedy(model, p, NUM_NEW[i % 4])[0] for i, p in enumerate(prompts)]


CASES = [
    ("no_buffer", True, 1),
    ("extra_buffer", False, 1),
    ("extra_buffer", True, 1),
    ("extra_buffer", False, 4),
    ("extra_buffer", True, 4),
    ("extra_buffer_lazy", False, 1),
    ("extra_buffer_lazy", True, 1),
    ("extra_buffer_lazy", False, 4),
    ("extra_buffer_lazy", True, 4),
]


def _engine(strategy: str, overlap: bool, page_size: int, model=None, **kw) -> Engine:
    return Engine(
        model=tiny_model() if model is None else model,
        mamba_scheduler_strategy=strategy,
        disable_overlap_schedule=not overlap,
        page_size=page_size,
        mamba_track_interval=INTERVAL,
        chunked_prefill_size=kw.pop("chunked_prefill_size", 128),
        max_running_requests=kw.pop("max_running_requests", 4),
        max_total_tokens=8192,
        context_length=512,
        skip_warmup=True,
        **kw,
    )


@pytest.mark.parametrize("strategy,overlap,page_size", CASES)
def test_staggered_batch_matches_reference(expected, strategy, overlap, page_size):
    _check_staggered_batch(*expected, _engine(strategy, overlap, page_size), strategy)


# The other families, each strategy once with the overlapped loop, on half the workload:
# Granite 4.0-H (Mamba2 + attention without positions + MoE, Granite's multipliers) and
# Qwen3.5 (MoE, split GDN projections). Few buckets (rows 1-2, one 64-token extend length,
# shared by a family's three cases): compiles dominate their time.
FAMILY_CASES = [(family, *case) for family in ("granitemoehybrid", "qwen3_5") for case in CASES]


@pytest.fixture(scope="module")
def family_expected():
    """family -> (prompts, cache-free greedy outputs), computed once per family."""
    computed = {}

    def get(family: str):
        if family not in computed:
            model = tiny_model(family)
            prompts = _workload()[:6]
            computed[family] = (
                prompts,
                [
                    reference_greedy(model, p, NUM_NEW[i % 4], pad_len=256)[0]
                    for i, p in enumerate(prompts)
                ],
            )
        return computed[family]

    return get


@pytest.mark.parametrize("family,strategy,overlap,page_size", FAMILY_CASES)
def test_other_families_staggered_batch_matches_reference(
    family_expected, family, strategy, overlap, page_size
):
    engine = _engine(
        strategy,
        overlap,
        page_size,
        tiny_model(family),
        max_running_requests=2,
        chunked_prefill_size=64,
    )
    _check_staggered_batch(*family_expected(family), engine, strategy)


def _check_staggered_batch(prompts, want, engine: Engine, strategy: str) -> None:
    """Feed ``prompts`` three at a time, every four steps; outputs must equal ``want``, the
    integrity checks and the tree-slot oracle hold after every step, and a flush returns
    every slot and page."""
    oracle = TreeStateOracle(engine)
    reqs = []
    for i, prompt in enumerate(prompts):  # staggered arrival: 3 new requests every 4 steps
        reqs.append(
            engine.add_request(
                input_ids=prompt,
                sampling_params={"max_new_tokens": NUM_NEW[i % 4], "ignore_eos": True},
            )
        )
        if i % 3 == 2:
            for _ in range(4):
                engine.step()
                oracle(engine)
    engine.run_until_done(reqs, check=oracle)
    for i, req in enumerate(reqs):
        assert req.output_ids == want[i], f"request {i} ({len(prompts[i])} tokens) differs"
    assert_null_sinks_zero(engine)
    hits = sum(r.cached_tokens for r in reqs)
    if strategy != "no_buffer":  # no_buffer's states sit at whole prompts only
        assert hits > 0, "shared prefixes should give cache hits"
    assert oracle.num_checked > 0, "the oracle compared no tree state"
    assert engine.flush_cache()
    engine.check_integrity()
    assert engine.slot_allocator.num_free == engine.layout.num_slots
    assert engine.kv_allocator.num_free_pages == engine.layout.num_pages


def test_a_burst_prefills_in_steps_of_its_token_budget(expected, monkeypatch):
    """Twelve prompts arriving at once prefill in as many rows as ``max_prefill_tokens``
    holds (here all twelve first chunks in one step, the longer prompts' rest in a second)
    and decode to the cache-free outputs."""
    prompts, want = expected
    engine = _engine(
        "extra_buffer_lazy", True, 1, max_running_requests=12, max_prefill_tokens=12 * 128
    )
    shapes = []
    schedule = engine.scheduler.schedule

    def planned(*args):
        plan = schedule(*args)
        if plan is not None and plan.kind == "extend":
            shapes.append(plan.batch.tokens.shape)
        return plan

    monkeypatch.setattr(engine.scheduler, "schedule", planned)
    reqs = [
        engine.add_request(
            input_ids=p, sampling_params={"max_new_tokens": NUM_NEW[i % 4], "ignore_eos": True}
        )
        for i, p in enumerate(prompts)
    ]
    engine.run_until_done(reqs)
    assert shapes == [(12, 128), (4, 64)]
    assert [r.output_ids for r in reqs] == want
