"""Speculative decoding (NEXTN, chain) on a hybrid model: exact against non-speculative
greedy decoding for every strategy with overlap on and off, every accept length and
crossing offset driven by a scripted draft head, and the checkpoint-boundary finish grid."""

from __future__ import annotations

import numpy as np
import pytest

from lazyspec.bench import boundary
from lazyspec.engine.engine import Engine
from lazyspec.scheduler.request import SamplingParams
from lazyspec.testing.scripted_drafter import make_script, scripted_model
from lazyspec.testing.sinks import assert_null_sinks_zero
from lazyspec.testing.state_oracle import TreeStateOracle, _prefix
from lazyspec.testing.tiny_models import (
    reference_greedy,
    reference_processed_greedy,
    small_engine,
    tiny_model,
)

D = 4


def _engine(model, strategy: str, overlap: bool, spec: bool, **kw) -> Engine:
    interval = kw.pop("interval", 16)
    return small_engine(model, strategy, overlap, spec, mamba_track_interval=interval, **kw)


@pytest.fixture(scope="module")
def batch_case():
    model = tiny_model("qwen3_next")
    rng = np.random.default_rng(5)
    shared = list(rng.integers(3, 128, size=40))
    prompts = [shared + list(rng.integers(3, 128, size=int(n))) for n in (3, 30, 17, 50, 9, 1)]
    lengths = [10, 25, 6, 18, 12, 20]
    want = [reference_greedy(model, p, n, pad_len=256)[0] for p, n in zip(prompts, lengths)]
    return model, prompts, lengths, want


@pytest.mark.parametrize("strategy", ["extra_buffer", "extra_buffer_lazy"])
@pytest.mark.parametrize("overlap", [True, False])
def test_spec_batch_equals_greedy(batch_case, strategy, overlap):
    model, prompts, lengths, want = batch_case
    engine = _engine(model, strategy, overlap, spec=True)
    reqs = [
        engine.add_request(input_ids=p, sampling_params={"max_new_tokens": n, "ignore_eos": True})
        for p, n in zip(prompts, lengths)
    ]
    engine.run_until_done(reqs, check=Engine.check_integrity)
    assert [r.output_ids for r in reqs] == want
    assert all(r.spec_verify_ct > 0 for r in reqs)
    assert_null_sinks_zero(engine)
    assert engine.flush_cache()
    assert engine.slot_allocator.num_free == engine.layout.num_slots
    assert engine.kv_allocator.num_free_pages == engine.layout.num_pages


@pytest.fixture(scope="module")
def scripted_case():
    model = tiny_model("qwen3_next")
    rng = np.random.default_rng(7)
    prompt = list(rng.integers(3, 128, size=37))
    num_new = 90
    greedy = reference_greedy(model, prompt, num_new, pad_len=256)[0]
    return model, prompt, num_new, greedy


def _crossing_offsets(prompt_len: int, accept_hist: list[int], interval: int) -> set[int]:
    pre, offsets = prompt_len, set()
    for n in accept_hist:
        post = pre + n
        if pre // interval != post // interval:
            offsets.add((post // interval) * interval - pre - 1)
        pre = post
    return offsets


@pytest.mark.parametrize(
    "strategy,overlap,fail",
    [
        ("extra_buffer", True, False),
        ("extra_buffer", False, False),
        ("extra_buffer_lazy", True, False),
        ("extra_buffer_lazy", False, False),
        ("extra_buffer_lazy", True, True),
    ],
)
def test_scripted_drafts_every_accept_length(scripted_case, strategy, overlap, fail):
    model, prompt, num_new, greedy = scripted_case
    script = make_script(prompt + greedy, 512, corrupt_prob=0.3, vocab=128, seed=3)
    engine = _engine(
        scripted_model(model, script), strategy, overlap, spec=True, debug_fail_spare_alloc=fail
    )
    req = engine.add_request(
        input_ids=prompt, sampling_params={"max_new_tokens": num_new, "ignore_eos": True}
    )
    engine.run_until_done([req], check=Engine.check_integrity)
    assert req.output_ids == greedy
    assert set(req.accept_hist) == set(range(1, D + 1)), np.bincount(req.accept_hist)
    assert _crossing_offsets(len(prompt), req.accept_hist, 16) == set(range(D))
    # accept lengths never depend on the checkpoint strategy or on allocation failures
    assert req.accept_hist == _ACCEPT.setdefault("hist", req.accept_hist)
    turn2 = prompt + greedy[:60] + [9, 10, 11]
    hit = engine.generate(
        input_ids=turn2, sampling_params={"max_new_tokens": 6, "ignore_eos": True}
    )
    assert hit["meta_info"]["cached_tokens"] % 16 == 0 and hit["meta_info"]["cached_tokens"] > 0
    assert hit["output_ids"] == reference_greedy(model, turn2, 6, pad_len=256)[0]


_ACCEPT: dict[str, list[int]] = {}


def test_scripted_drafts_see_the_penalties_of_the_accepted_prefix(scripted_case):
    """Penalties at verify position j count the drafts accepted before j: the draft head
    proposes the penalized greedy continuation itself (a few positions corrupted), so most
    verify steps accept several drafts, and the output equals the cache-free penalized
    reference (which differs from plain greedy)."""
    model, prompt, _, greedy = scripted_case
    params = SamplingParams(
        max_new_tokens=40, ignore_eos=True, frequency_penalty=0.7, repetition_penalty=1.5
    )
    want = reference_processed_greedy(model, prompt, params)
    assert want != greedy[:40]
    script = make_script(prompt + want, 512, corrupt_prob=0.2, vocab=128, seed=4)
    engine = _engine(scripted_model(model, script), "extra_buffer", True, spec=True)
    req = engine.add_request(input_ids=prompt, sampling_params=params)
    engine.run_until_done([req], check=Engine.check_integrity)
    assert req.output_ids == want
    assert max(req.accept_hist) == D, req.accept_hist


@pytest.fixture(scope="module")
def qwen3_5_case():
    """Tiny Qwen3.5 (MoE, with its MTP head): two conversations sharing a prefix, each
    with a second turn that extends the first turn's prompt and output."""
    model = tiny_model("qwen3_5")
    rng = np.random.default_rng(11)
    shared = list(rng.integers(3, 128, size=24))
    prompts = [shared + list(rng.integers(3, 128, size=int(n))) for n in (5, 19)]
    first = [reference_greedy(model, p, 12, pad_len=256)[0] for p in prompts]
    turn2 = [p + out + [7, 8, 9] for p, out in zip(prompts, first)]
    second = [reference_greedy(model, p, 8, pad_len=256)[0] for p in turn2]
    return model, prompts, first, turn2, second


@pytest.mark.parametrize("strategy", ["extra_buffer_lazy", "extra_buffer"])
def test_qwen3_5_mtp_speculation_equals_greedy(qwen3_5_case, strategy):
    """NEXTN with Qwen3.5's own MTP head (split GDN projections, MoE draft layer): greedy
    output equals the cache-free reference, turn 2 hits the radix cache, every request ran
    verify steps, with overlap on and the integrity checks after every step."""
    model, prompts, first, turn2, second = qwen3_5_case
    assert model.config.has_mtp
    engine = _engine(model, strategy, True, spec=True, max_running_requests=2)
    for inputs, num_new, want in ((prompts, 12, first), (turn2, 8, second)):
        params = {"max_new_tokens": num_new, "ignore_eos": True}
        reqs = [engine.add_request(input_ids=p, sampling_params=params) for p in inputs]
        engine.run_until_done(reqs, check=Engine.check_integrity)
        assert [r.output_ids for r in reqs] == want
        assert all(r.spec_verify_ct > 0 for r in reqs)
    assert all(r.cached_tokens > 0 for r in reqs)  # turn 2 resumed from checkpoints
    info = engine.get_server_info()
    assert info["num_verify_steps"] > 0 and info["avg_accept_length"] >= 1.0
    assert_null_sinks_zero(engine)
    assert engine.flush_cache()
    assert engine.slot_allocator.num_free == engine.layout.num_slots


def test_no_buffer_with_spec_is_rejected():
    with pytest.raises(ValueError, match="no_buffer"):
        _engine(tiny_model("qwen3_next"), "no_buffer", False, spec=True)


def test_spec_needs_mtp_head():
    with pytest.raises(ValueError, match="MTP"):
        _engine(tiny_model("nemotron_h"), "extra_buffer", True, spec=True)


def test_boundary_finish_grid_small():
    """The source document's grid, scaled down: prompt 100, I = 32, boundary 160."""
    args = boundary.parse_args(
        [
            "--prompt-len",
            "100",
            "--interval",
            "32",
            "--chunk",
            "16",
            "--chunked-prefill",
            "64",
            "--boundary",
            "160",
            "--cont",
            "8",
            "--context",
            "256",
            "--kv-tokens",
            "4096",
            "--offsets=-2,-1,0,1,2,16",
        ]
    )
    cells = boundary.run_grid(args)
    served = {(c.spec, c.exhausted): [] for c in cells}
    for c in cells:
        assert c.identical == c.total == 8, c
        assert c.max_dlogprob <= 1e-3, c
        served[(c.spec, c.exhausted)].append(c.served)
    assert [c.offset for c in cells[:6]] == [-2, -1, 0, 1, 2, 16]
    # checkpoint served per offset: 96 = the in-prompt checkpoint (prompt 100, I = 32);
    # 128 / 160 = a decode-time checkpoint settled before the finish
    assert served == {
        (True, False): [128, 128, 128, 128, 128, 160],
        (True, True): [96, 96, 96, 96, 96, 160],
        (False, False): [128, 128, 128, 128, 160, 160],
        (False, True): [128, 128, 96, 96, 160, 160],
    }


def test_prefill_checkpoint_waits_for_the_in_flight_in_place_verify():
    """Lazy, D = 4, every spare allocation failing, a prompt of 95 ending one token before
    the boundary 96 (I = 32): the first verify, launched before the prefill result is
    processed, writes the keep slot in place across 96. The prompt's checkpoint (80, on the
    grid G = 16) must stay out of the tree (the in-flight guard), and every slot the tree
    holds equals a cache-free recompute of its prefix's state after every step."""
    engine = _engine(
        tiny_model("qwen3_next"),
        "extra_buffer_lazy",
        True,
        spec=True,
        interval=32,
        debug_fail_spare_alloc=True,
    )
    oracle = TreeStateOracle(engine)
    prompt = list(np.random.default_rng(7).integers(3, 128, size=95))
    req = engine.add_request(
        input_ids=prompt, sampling_params={"max_new_tokens": 12, "ignore_eos": True}
    )
    engine.run_until_done([req], check=oracle)
    assert engine.policy.num_spare_failures > 0 and oracle.num_checked > 0
    lengths = sorted(len(_prefix(n)) for n in engine.tree.iter_nodes() if n.has_state)
    assert 80 not in lengths and lengths[0] == 64  # the first chunk's checkpoint
    assert lengths[-1] == 96  # the in-place crossing, settled while running, at finish
