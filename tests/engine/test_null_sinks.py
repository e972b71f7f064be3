"""Slot 0, page 0 and request row 0 are sinks that nothing writes: after a serving run with
the radix cache disabled, or with speculation at page size 2, the null state slot, every KV
pool's rows of the null page and request row 0 of the token-count pools are still zero.

The workload pads every batch (3 requests in buckets of 4), reuses a cached prefix and
mixes greedy and sampled requests, so padded lanes, copy-on-write reads from tree slots and
both decode forms all run."""

from __future__ import annotations

import numpy as np
import pytest

from lazyspec.engine.engine import Engine
from lazyspec.testing.sinks import assert_null_sinks_zero, null_sink_rows
from lazyspec.testing.tiny_models import small_engine, tiny_model

# The exactness tests check the sinks after every strategy x overlap x page size run
# (tests/engine/test_engine_exactness.py) and every speculative run (test_spec_decoding.py);
# these add the cache turned off, speculation at page size 2, and sampled requests.
CASES = [
    # (strategy, disable_radix_cache, spec, page_size)
    ("extra_buffer", True, False, 2),
    ("extra_buffer", True, True, 1),
    ("extra_buffer_lazy", False, True, 2),
]


def _run_workload(engine: Engine) -> None:
    rng = np.random.default_rng(11)
    shared = [int(t) for t in rng.integers(3, 128, size=40)]
    prompts = [shared + [int(t) for t in rng.integers(3, 128, size=n)] for n in (5, 23, 9)]
    params = [
        {"max_new_tokens": 14, "ignore_eos": True},
        {"max_new_tokens": 9, "ignore_eos": True, "temperature": 0.8, "seed": 3},
        {"max_new_tokens": 20, "ignore_eos": True, "repetition_penalty": 1.3},
    ]
    first = engine.generate(input_ids=prompts, sampling_params=params)
    turn2 = [p + r["output_ids"] + [7, 8, 9] for p, r in zip(prompts, first)]
    engine.generate(input_ids=turn2, sampling_params=params)


@pytest.mark.parametrize("strategy,no_cache,spec,page_size", CASES)
def test_null_slot_and_null_page_stay_zero(strategy, no_cache, spec, page_size):
    engine = small_engine(
        tiny_model("qwen3_next"),
        strategy,
        spec=spec,
        disable_radix_cache=no_cache,
        page_size=page_size,
        chunked_prefill_size=32,
        max_total_tokens=2048,
    )
    before = null_sink_rows(engine)
    cfg = engine.model.config
    num_kv_pools = len(cfg.attention_layer_ids) + (cfg.num_mtp_layers if spec else 0)
    assert len(before) == 4 + 2 * num_kv_pools, sorted(before)
    assert all(not a.any() for a in before.values())
    _run_workload(engine)
    engine.check_integrity()
    # the run wrote real slots and pages (so zero sinks are not just an idle pool)
    pools = engine.runner.pools
    assert np.asarray(pools.ssm[:, 1:]).any() and np.asarray(pools.kv.k[0][page_size:]).any()
    assert np.asarray(pools.output_counts[1:]).any() and np.asarray(pools.in_prompt[1:]).any()
    if spec:
        assert np.asarray(pools.mtp_kv.k[0][page_size:]).any()
    assert_null_sinks_zero(engine)
