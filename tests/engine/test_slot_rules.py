"""Slot rules of DESIGN §6-§7 on the engine, each with the tree-slot oracle (every state the
tree holds equals a cache-free recompute of its prefix's state after every step): a stop
with a step in flight donates nothing that step writes; an abort inserts nothing; a finish
after an in-place write is not donated (``keep_clobbered``); a spare allocation that fails
evicts nothing; under the value policy a running request's prefill checkpoint evicts no
cached checkpoint worth more than itself.

Without speculation (D = 1) every decode step advances one token, so the step that crosses
a multiple of the interval is known in advance: prompt 40, I = 16, the prompt's checkpoint
at 32 (the prefill grid G = 16), decode crossings at 48, 64, ..."""

from __future__ import annotations

import numpy as np

from lazyspec.engine.engine import Engine
from lazyspec.scheduler.request import NO_SLOT
from lazyspec.testing.state_oracle import TreeStateOracle, _prefix
from lazyspec.testing.tiny_models import small_engine, tiny_model

INTERVAL = 16


def _engine(model=None, **kw) -> Engine:
    """``small_engine`` (its checkpoint interval ``INTERVAL``), lazy by default."""
    strategy = kw.pop("strategy", "extra_buffer_lazy")
    overlap = not kw.pop("disable_overlap_schedule", False)
    engine = small_engine(model or tiny_model(), strategy, overlap, **kw)
    assert engine.config.mamba_track_interval == INTERVAL
    return engine


def _prompt(seed: int, n: int = 40) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 128, size=n)]


def _cached_lengths(engine: Engine) -> list[int]:
    return sorted(len(_prefix(n)) for n in engine.tree.iter_nodes() if n.has_state)


def _params(n: int) -> dict:
    return {"max_new_tokens": n, "ignore_eos": True}


def test_stop_with_a_step_in_flight_donates_nothing_that_step_writes():
    """Every spare allocation fails, so the keep slot is written in place: the crossing of
    48 settles while running (keep labelled 48), then the request is stopped while the step
    that crosses 64 is in flight and targets the keep slot. The stop must not donate it
    (``Engine.stop`` passes the in-flight records): the node for 48 tokens would receive
    the state after 64."""
    engine = _engine(debug_fail_spare_alloc=True)
    oracle = TreeStateOracle(engine)
    req = engine.add_request(input_ids=_prompt(1), sampling_params=_params(100))
    stopped = False
    while engine.busy:
        engine.step()
        inflight = [r for r in engine._inflight_records() if r.req is req]
        crossing = req.seq_len + 1 == 64  # the in-flight step covers token 64
        if not stopped and inflight and crossing:
            (record,) = inflight
            assert record.in_place and record.target_slot == req.slots.keep
            assert req.slots.last_track_len == 48
            assert engine.stop(req.rid)
            stopped = True
        oracle(engine)
    assert stopped and req.finished and oracle.num_checked > 0
    assert 48 not in _cached_lengths(engine) and 64 not in _cached_lengths(engine)
    assert engine.slot_allocator.num_free + engine.tree.num_cached_slots == engine.layout.num_slots


def test_abort_inserts_nothing():
    """An aborted request's checkpoints stay out of the tree: the decode checkpoint at 48
    (settled, safe to donate at a finish) and its KV are given back, not cached."""
    engine = _engine()
    oracle = TreeStateOracle(engine)
    req = engine.add_request(input_ids=_prompt(2), sampling_params=_params(100))
    while req.seq_len < 56:
        engine.step()
        oracle(engine)
    before = _cached_lengths(engine)
    assert req.slots.last_track_len == 48 and 48 not in before  # what a finish would donate
    assert engine.abort(req.rid)
    while engine.busy:
        engine.step()
        oracle(engine)
    assert _cached_lengths(engine) == before
    assert engine.tree.num_cached_tokens == max(before, default=0)  # no KV of the request
    assert engine.slot_allocator.num_free + engine.tree.num_cached_slots == engine.layout.num_slots


def test_finish_after_an_in_place_write_is_not_donated():
    """No overlap (nothing in flight to guard), every spare allocation fails: the step that
    finishes the request crosses 64 and writes the keep slot (labelled 48) in place. Only
    ``keep_clobbered`` keeps it out of the tree."""
    engine = _engine(debug_fail_spare_alloc=True, disable_overlap_schedule=True)
    oracle = TreeStateOracle(engine)
    # prompt 40: the first output comes from the prefill; decode step k covers 40 + k tokens,
    # so the step that crosses 64 (k = 24) brings the 25th output
    req = engine.add_request(input_ids=_prompt(3), sampling_params=_params(25))
    engine.run_until_done([req], check=oracle)
    assert req.slots.working == NO_SLOT and len(req.output_ids) == 25
    assert engine.policy.num_spare_failures > 0 and oracle.num_checked > 0
    assert _cached_lengths(engine) == [32]  # the prompt's checkpoint only


def test_spare_allocation_failure_never_evicts_a_cached_checkpoint():
    """One running request, four slots: the running request pins two, the tree holds the
    rest, so the lazy spare allocation near each boundary fails for real; no cached
    checkpoint is evicted for it (a transient slot is never worth a cached checkpoint)."""
    engine = _engine(max_running_requests=1, max_mamba_cache_size=4)
    oracle = TreeStateOracle(engine)
    first = engine.add_request(input_ids=_prompt(4), sampling_params=_params(30))
    engine.run_until_done([first], check=oracle)
    second = engine.add_request(input_ids=_prompt(5), sampling_params=_params(40))
    while not second.output_ids:
        engine.step()
    cached = sorted(engine.tree.cached_slot_ids())
    assert engine.slot_allocator.num_free == 0 and engine.tree.num_evictable_slots > 0
    while engine.busy:
        engine.step()
        oracle(engine)
        if not second.finished:
            assert sorted(engine.tree.cached_slot_ids()) == cached
    assert engine.policy.num_spare_failures > 0 and not engine.policy.fail_spare_alloc


def test_running_checkpoint_never_evicts_a_checkpoint_worth_more():
    """Value policy, a full pool: two conversations' checkpoints are cached, then a long
    prompt runs in several chunks. Its chunk and prompt checkpoints, which it supersedes
    itself, are declined rather than evicting the cached conversations' (SGLang's rules
    evict them), and the next turn of each conversation still hits."""
    model = tiny_model()
    hits = {}
    for policy in ("value", "sglang"):
        engine = _engine(
            model, max_running_requests=1, max_mamba_cache_size=5, mamba_cache_policy=policy
        )
        oracle = TreeStateOracle(engine)
        turns = []
        for seed in (6, 7):
            req = engine.add_request(input_ids=_prompt(seed), sampling_params=_params(30))
            engine.run_until_done([req], check=oracle)
            turns.append(req.input_ids + req.output_ids)
        long = engine.add_request(input_ids=_prompt(8, 200), sampling_params=_params(4))
        engine.run_until_done([long], check=oracle)
        declined = engine.policy.num_declined_inserts
        cached = []
        for tokens in turns:
            nxt = engine.add_request(input_ids=tokens + _prompt(9, 5), sampling_params=_params(2))
            engine.run_until_done([nxt], check=oracle)
            cached.append(nxt.cached_tokens)
        hits[policy] = (declined, cached)
    assert hits["value"][0] > 0 and hits["sglang"][0] == 0
    assert hits["value"][1] == [64, 64]  # each turn's decode checkpoint (40 + 30 tokens)
    assert hits["sglang"][1] != [64, 64]
