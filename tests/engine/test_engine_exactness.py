"""The engine's greedy output equals cache-free one-request-at-a-time recompute, for every
checkpoint strategy, with and without the overlapped loop, page sizes 1 and 4; no leaks;
the null slot and page are never written. Qwen3.5 runs every strategy with the overlapped
loop."""

from __future__ import annotations

import numpy as np
import pytest

from lazyspec.engine.engine import Engine
from lazyspec.testing.sinks import assert_null_sinks_zero
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
        model=model or tiny_model(),
        mamba_scheduler_strategy=strategy,
        disable_overlap_schedule=not overlap,
        page_size=page_size,
        mamba_track_interval=INTERVAL,
        chunked_prefill_size=kw.pop("chunked_prefill_size", 128),
        max_running_requests=kw.pop("max_running_requests", 4),
        max_total_tokens=8192,
        context_length=kw.pop("context_length", 512),
        skip_warmup=True,
        **kw,
    )


def _run_staggered(engine: Engine, prompts: list[list[int]]) -> list:
    """Three new requests every 4 steps, integrity checked after every step; the requests."""
    reqs = []
    for i, prompt in enumerate(prompts):
        reqs.append(
            engine.add_request(
                input_ids=prompt,
                sampling_params={"max_new_tokens": NUM_NEW[i % 4], "ignore_eos": True},
            )
        )
        if i % 3 == 2:
            for _ in range(4):
                engine.step()
                engine.check_integrity()
    engine.run_until_done(reqs, check=Engine.check_integrity)
    return reqs


def _check_outputs_and_release(engine: Engine, reqs, prompts, want, strategy: str) -> None:
    for i, req in enumerate(reqs):
        assert req.output_ids == want[i], f"request {i} ({len(prompts[i])} tokens) differs"
    assert_null_sinks_zero(engine)
    hits = sum(r.cached_tokens for r in reqs)
    if strategy != "no_buffer":
        assert hits > 0, "shared prefixes should give cache hits"
    assert engine.flush_cache()
    engine.check_integrity()
    assert engine.slot_allocator.num_free == engine.layout.num_slots
    assert engine.kv_allocator.num_free_pages == engine.layout.num_pages


@pytest.mark.parametrize("strategy,overlap,page_size", CASES)
def test_staggered_batch_matches_reference(expected, strategy, overlap, page_size):
    prompts, want = expected
    engine = _engine(strategy, overlap, page_size)
    reqs = _run_staggered(engine, prompts)
    _check_outputs_and_release(engine, reqs, prompts, want, strategy)


# few buckets (rows 1-2, one 64-token extend length): the Qwen3.5 runs compile little
SMALL = dict(max_running_requests=2, chunked_prefill_size=64, context_length=256)


@pytest.fixture(scope="module")
def expected_qwen3_5():
    model = tiny_model("qwen3_5")
    prompts = _workload()[:6]
    want = [
        reference_greedy(model, p, NUM_NEW[i % 4], pad_len=256)[0] for i, p in enumerate(prompts)
    ]
    return prompts, want


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer", "extra_buffer_lazy"])
def test_qwen3_5_staggered_batch_matches_reference(expected_qwen3_5, strategy):
    """Qwen3.5 (MoE) through every strategy with the overlapped loop."""
    prompts, want = expected_qwen3_5
    engine = _engine(strategy, True, 1, model=tiny_model("qwen3_5"), **SMALL)
    reqs = _run_staggered(engine, prompts)
    _check_outputs_and_release(engine, reqs, prompts, want, strategy)
