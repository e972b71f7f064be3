"""Admission against estimated use, and retraction when a decode step cannot get its pages.

A KV pool too small for every request's ``max_new_tokens`` but large enough for what they
produce runs them all at once; a pool that forces retractions mid-decode gives outputs
token-identical to the cache-free oracle for every strategy, with speculation and the
overlapped loop on and off, the integrity checks holding after every step."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lazyspec.engine.engine import Engine
from lazyspec.scheduler.request import SamplingParams
from lazyspec.testing.sinks import assert_null_sinks_zero
from lazyspec.testing.tiny_models import reference_processed_greedy, small_engine, tiny_model

NUM_NEW = (20, 28, 12, 24, 16)
PENALIZED = (1, 4)
PENALTIES = dict(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.2)


def _engine(model, strategy: str, overlap: bool, spec: bool, **kw) -> Engine:
    return small_engine(model, strategy, overlap, spec, **kw)


@pytest.fixture(scope="module")
def case():
    """Five prompts (two shared prefixes), their sampling (greedy; two with penalties, whose
    token counts a resumed request must rebuild from its outputs so far) and their
    cache-free outputs."""
    model = tiny_model("qwen3_next")
    rng = np.random.default_rng(11)
    shared = [list(rng.integers(3, 128, size=n)) for n in (36, 20)]
    prompts = [
        shared[i % 2] + list(rng.integers(3, 128, size=int(n)))
        for i, n in enumerate((5, 30, 12, 41, 3))
    ]
    sampling = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in NUM_NEW]
    for i in PENALIZED:
        sampling[i] = dataclasses.replace(sampling[i], **PENALTIES)
    want = [reference_processed_greedy(model, p, s) for p, s in zip(prompts, sampling)]
    for i in PENALIZED:  # the penalties change these outputs
        plain = SamplingParams(max_new_tokens=NUM_NEW[i], ignore_eos=True)
        assert reference_processed_greedy(model, prompts[i], plain) != want[i]
    return model, prompts, sampling, want


CASES = [
    ("no_buffer", False, False),
    ("extra_buffer", False, False),
    ("extra_buffer", True, False),
    ("extra_buffer", False, True),
    ("extra_buffer", True, True),
    ("extra_buffer_lazy", False, False),
    ("extra_buffer_lazy", True, False),
    ("extra_buffer_lazy", False, True),
    ("extra_buffer_lazy", True, True),
]


@pytest.mark.parametrize("strategy,overlap,spec", CASES)
def test_retraction_mid_decode_matches_reference(case, strategy, overlap, spec):
    model, prompts, sampling, want = case
    # an optimistic estimate admits four prompts into a pool with little room to spare:
    # their outputs force retractions
    engine = _engine(
        model, strategy, overlap, spec, max_total_tokens=128, schedule_conservativeness=0.05
    )
    reqs = [engine.add_request(input_ids=p, sampling_params=s) for p, s in zip(prompts, sampling)]
    engine.run_until_done(reqs, check=Engine.check_integrity)
    for i, req in enumerate(reqs):
        assert req.finish_reason["type"] == "length", req.finish_reason
        assert req.output_ids == want[i], f"request {i} differs"
    info = engine.get_server_info()
    assert info["num_retractions"] > 0 and engine.stats().num_retractions > 0
    assert sum(r.num_retractions for r in reqs) == info["num_retractions"]
    assert any(reqs[i].num_retractions for i in PENALIZED)  # resumed with its counts
    assert_null_sinks_zero(engine)
    assert engine.flush_cache()
    assert engine.slot_allocator.num_free == engine.layout.num_slots
    assert engine.kv_allocator.num_free_pages == engine.layout.num_pages
