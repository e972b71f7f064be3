"""The engine's serving surface: abort / stop end the request they name and report whether
they did, ``stats()`` agrees with the pools and with ``get_server_info``, and the fixed
facts are read-only."""

from __future__ import annotations

import dataclasses

import pytest

from lazyspec.engine.engine import Engine
from lazyspec.testing.tiny_models import tiny_model


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(
        model=tiny_model(),
        mamba_track_interval=64,
        chunked_prefill_size=128,
        max_running_requests=4,
        max_total_tokens=4096,
        context_length=512,
        skip_warmup=True,
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
