"""--mem-fraction-static sizes the KV and state pools from the device's memory (a faked
figure here): the engine built from the plan holds what the plan says, and fills the
fraction."""

from __future__ import annotations

import logging

import pytest

from lazyspec.server import pools
from tests.server.conftest import ENGINE_SETTINGS

GIB = 2**30
# the server tests' engine, its KV pool left to the pool plan
SETTINGS = dict(
    {k: v for k, v in ENGINE_SETTINGS.items() if k != "max_total_tokens"},
    max_running_requests=4,
    skip_warmup=True,
)


def _fake_device(monkeypatch, platform: str, memory: int) -> None:
    monkeypatch.setattr(pools, "device_memory", lambda: (platform, memory))


def _launch_kwargs(model_dir, argv: list[str]) -> tuple[dict, object]:
    """EngineConfig keywords and SGLang flags as scripts/serve.py builds them."""
    from lazyspec.server.flags import apply_sglang_flags
    from lazyspec.server.launch import build_parser, engine_kwargs

    args = build_parser().parse_args(["--model-path", str(model_dir), *argv])
    kwargs = engine_kwargs(args)
    kwargs["model_path"] = args.model_path
    return kwargs, apply_sglang_flags(args, kwargs)


def test_an_accelerator_fills_the_default_fraction(model_dir, monkeypatch, caplog):
    from lazyspec.engine.engine import Engine

    memory = GIB // 4
    _fake_device(monkeypatch, "gpu", memory)
    kwargs, sglang = _launch_kwargs(model_dir, [])
    kwargs.update(SETTINGS)
    with caplog.at_level(logging.INFO, logger="lazyspec.server.pools"):
        plan = pools.apply_pool_plan(kwargs, sglang.mem_fraction_static)
    assert plan is not None and "mem_fraction_static 0.85" in caplog.text
    engine = Engine(**kwargs)
    info = engine.memory_plan
    assert info["kv_tokens"] == plan.kv_tokens == kwargs["max_total_tokens"]
    assert info["state_slots"] == plan.state_slots == kwargs["max_mamba_cache_size"]
    held = (
        info["weight_bytes_per_device"]
        + info["kv_bytes_per_device"]
        + info["state_bytes_per_device"]
        + info["token_count_bytes_per_device"]
    )
    budget = pools.DEFAULT_MEM_FRACTION * memory
    # the pools fill the fraction to within a few pages and slots, never past it
    assert budget - 4 * (plan.slot_bytes + plan.kv_bytes_per_token) < plan.total_bytes <= budget
    assert held <= plan.total_bytes
    assert info["weight_bytes_per_device"] == plan.weight_bytes
    assert info["kv_bytes_per_token"] == plan.kv_bytes_per_token
    assert info["bytes_per_state_slot"] == plan.slot_bytes
    # SGLang's split: state bytes / KV bytes = --mamba-full-memory-ratio (0.9)
    assert plan.state_bytes / plan.kv_bytes == pytest.approx(0.9, rel=0.01)


def test_the_flag_sets_the_fraction_and_the_ratio_and_keeps_a_given_size(model_dir, monkeypatch):
    _fake_device(monkeypatch, "gpu", GIB)
    argv = ["--mem-fraction-static", "0.5", "--mamba-full-memory-ratio", "0.25"]
    kwargs, sglang = _launch_kwargs(model_dir, argv)
    kwargs.update(SETTINGS)
    plan = pools.apply_pool_plan(kwargs, sglang.mem_fraction_static, sglang.mamba_full_memory_ratio)
    assert (
        plan.total_bytes <= GIB // 2 < plan.total_bytes + plan.slot_bytes + plan.kv_bytes_per_token
    )
    assert plan.state_bytes / plan.kv_bytes == pytest.approx(0.25, rel=0.01)
    kwargs, sglang = _launch_kwargs(model_dir, [*argv, "--max-total-tokens", "4k"])
    kwargs.update(SETTINGS)
    plan = pools.apply_pool_plan(kwargs, sglang.mem_fraction_static)
    assert kwargs["max_total_tokens"] == plan.kv_tokens == 4000
    assert plan.total_bytes <= GIB // 2 < plan.total_bytes + plan.slot_bytes  # state takes the rest


def test_cpu_keeps_the_fixed_defaults_unless_the_flag_is_given(model_dir, monkeypatch):
    _fake_device(monkeypatch, "cpu", 64 * GIB)
    kwargs, sglang = _launch_kwargs(model_dir, [])
    before = dict(kwargs)
    assert pools.apply_pool_plan(kwargs, sglang.mem_fraction_static) is None
    assert kwargs == before and "max_total_tokens" not in kwargs


def test_a_fraction_too_small_for_one_request_names_the_figures(model_dir, monkeypatch):
    _fake_device(monkeypatch, "gpu", 2**16)
    kwargs, _ = _launch_kwargs(model_dir, [])
    kwargs.update(SETTINGS)
    with pytest.raises(ValueError, match=r"--mem-fraction-static=0.5 of 0.00 GiB leaves"):
        pools.apply_pool_plan(kwargs, 0.5)


def test_a_planned_server_runs_a_batch_sized_for_its_memory(model_dir, monkeypatch):
    """Unless --max-running-requests is given, a server with pools planned from memory
    runs up to PLANNED_RUNNING requests, its request tables sized for them."""
    _fake_device(monkeypatch, "gpu", GIB)
    plans = {}
    for argv in ([], ["--max-running-requests", "4"]):
        kwargs, sglang = _launch_kwargs(model_dir, argv)
        kwargs.update({k: v for k, v in SETTINGS.items() if k != "max_running_requests"})
        plans[len(argv)] = pools.apply_pool_plan(kwargs, sglang.mem_fraction_static)
        assert kwargs["max_running_requests"] == (int(argv[1]) if argv else pools.PLANNED_RUNNING)
    # a table row per request and the padding row's
    assert plans[0].fixed_bytes * 5 == plans[2].fixed_bytes * (pools.PLANNED_RUNNING + 1)
