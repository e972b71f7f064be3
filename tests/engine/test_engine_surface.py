"""The engine's serving surface: abort / stop end the request they name and report whether
they did, ``stats()`` agrees with the pools and with ``get_server_info``, and the fixed
facts are read-only."""

from __future__ import annotations

import dataclasses

import pytest

from lazyspec.engine.engine import Engine
from lazyspec.testing.tiny_models import small_engine, tiny_model


@pytest.fixture(scope="module")
def engine() -> Engine:
    return small_engine(
        tiny_model(),
        "auto",
        mamba_track_interval=64,
        mamba_chunk_size=64,
        chunked_prefill_size=128,
        context_length=512,
    )


def _add(engine: Engine, rid: str, num_new: int = 40):
    params = {"max_new_tokens": num_new, "ignore_eos": True}
    return engine.add_request(input_ids=list(range(3, 80)), sampling_params=params, rid=rid)


def _drain(engine: Engine) -> None:
    while engine.busy:
        engine.step()


def test_abort_and_stop_end_the_named_request(engine):
    waiting, running, stopped = _add(engine, "w"), _add(engine, "r"), _add(engine, "s")
    assert engine.abort("w")  # still waiting: never admitted
    assert engine.has_requests
    engine.step()
    engine.step()
    stats = engine.stats()
    assert stats.num_running_requests == 2 and stats.num_waiting_requests == 0
    assert stats.free_state_slots < stats.state_slots
    assert engine.abort("r")
    assert engine.stop("s")
    assert not engine.abort("r") and not engine.stop("s") and not engine.abort("unknown")
    assert not engine.has_requests
    _drain(engine)
    assert waiting.finish_reason == {"type": "abort"} and not waiting.output_ids
    assert running.finish_reason == {"type": "abort"}
    assert stopped.finish_reason == {"type": "stop"}
    assert 0 < len(stopped.output_ids) < 40
    stats = engine.stats()
    # the stopped request's checkpoint was cached, the aborted one's was not
    assert stats.cached_state_slots == 1
    assert stats.free_state_slots + stats.cached_state_slots == stats.state_slots
    assert stats.free_kv_tokens + stats.cached_kv_tokens == stats.kv_tokens
    assert engine.flush_cache()
    assert engine.stats().free_state_slots == stats.state_slots


def test_stats_match_server_info_and_the_memory_plan(engine):
    _add(engine, "a", num_new=20)
    engine.step()
    info, stats = engine.get_server_info(), engine.stats()
    assert engine.num_compiled() == info["num_compiled_programs"] > 0
    assert stats.num_running_requests == 1
    for field, value in dataclasses.asdict(stats).items():
        assert info[field] == value, field
    plan = engine.memory_plan
    assert plan["state_slots"] == stats.state_slots and plan["kv_tokens"] == stats.kv_tokens
    plan["state_slots"] = -1
    assert engine.memory_plan["state_slots"] == stats.state_slots  # a copy each time
    assert engine.max_request_len == plan["context_length"] - 3 * info["num_verify_tokens"]
    with pytest.raises(ValueError, match="context limit"):
        engine.add_request(input_ids=[5], sampling_params={"max_new_tokens": 512})
    _drain(engine)
    assert engine.vocab_size == engine.model.config.vocab_size


def test_a_request_that_fails_in_preparation_fails_alone(engine, monkeypatch):
    """A request whose sampling values slip past validation (validation switched off here)
    and then overflow the batch's int32 / float32 arrays is ended with an error reason when
    the scheduler prepares it; the requests around it run as if it had never been sent."""
    from lazyspec.scheduler.request import SamplingParams

    def run(poison: list[dict]) -> tuple[list, list]:
        good = [_add(engine, f"good-{i}-{len(poison)}", 30) for i in range(2)]
        bad = [
            engine.add_request(
                input_ids=list(range(5, 40)),
                sampling_params=SamplingParams(max_new_tokens=8, **fields),
                rid=f"bad-{i}",
            )
            for i, fields in enumerate(poison)
        ]
        good.append(_add(engine, f"good-2-{len(poison)}", 30))
        _drain(engine)
        return good, bad

    reference, _ = run([])
    engine.flush_cache()
    monkeypatch.setattr(SamplingParams, "validate", lambda self, vocab_size=None: None)
    good, bad = run([{"top_k": 2**40}, {"temperature": 1e39}, {"seed": 2**70}])
    assert [r.output_ids for r in good] == [r.output_ids for r in reference]
    assert all(len(r.output_ids) == 30 for r in good)
    for req in bad[:2]:
        assert req.finished and not req.output_ids
        assert req.finish_reason["type"] == "abort" and req.finish_reason["status_code"] == 500
        assert "prepared" in req.finish_reason["message"]
    assert bad[2].finish_reason["type"] == "length"  # a 70-bit seed keeps its low 32 bits
    engine.check_integrity()
    stats = engine.stats()
    assert stats.free_state_slots + stats.cached_state_slots == stats.state_slots


def test_add_request_checks_sampling_against_the_vocabulary(engine):
    from lazyspec.scheduler.request import SamplingParams

    vocab = engine.vocab_size
    for params in (
        {"top_k": vocab + 1},
        {"top_k": 2**40},
        {"temperature": 1e39},
        {"temperature": float("nan")},
        {"stop_token_ids": [vocab]},
        {"seed": 2**64},
        {"ignore_eos": "yes"},
    ):
        with pytest.raises(ValueError):
            engine.add_request(input_ids=[5, 6], sampling_params=params)
        with pytest.raises(ValueError):  # a SamplingParams instance is checked too
            engine.add_request(input_ids=[5, 6], sampling_params=SamplingParams(**params))
    assert not engine.has_requests
    engine.add_request(input_ids=[5, 6], sampling_params={"top_k": vocab}, rid="edge")
    _drain(engine)


def test_cache_counters_count_each_admitted_request_once(engine):
    """``cache_hit_tokens`` / ``cache_queried_tokens`` are the sums of the admitted requests'
    ``cached_tokens`` / prompt lengths, aborted ones included: the tree's own re-matches
    (a running request continuing on its inserted prefix, a waiting head re-queried) and
    requests never admitted add nothing."""
    _drain(engine)
    engine.flush_cache()
    info = engine.get_server_info()
    hits0, queried0 = info["cache_hit_tokens"], info["cache_queried_tokens"]
    prompt = [3 + i % 120 for i in range(200)]  # a checkpoint at 128 is cached while it runs
    first = engine.add_request(input_ids=prompt, sampling_params={"max_new_tokens": 4})
    _drain(engine)
    later = [
        engine.add_request(input_ids=prompt + [7, 8], sampling_params={"max_new_tokens": 30})
        for _ in range(6)  # more than max_running: two wait for room
    ]
    engine.step()
    engine.step()
    engine.abort(later[0].rid)  # admitted, then aborted: still counted
    never = engine.add_request(input_ids=prompt, sampling_params={"max_new_tokens": 3})
    engine.abort(never.rid)  # never admitted: not counted
    _drain(engine)
    admitted = [first, *later]
    assert sum(r.cached_tokens for r in admitted) > 0
    info = engine.get_server_info()
    assert info["cache_hit_tokens"] - hits0 == sum(r.cached_tokens for r in admitted)
    assert info["cache_queried_tokens"] - queried0 == sum(len(r.input_ids) for r in admitted)
