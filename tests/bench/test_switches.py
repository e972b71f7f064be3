"""``--kernel-switch`` (``lazyspec.bench.switches``): the dispatch constants a benchmark
process sets before tracing, and the errors on a switch that names nothing settable."""

from __future__ import annotations

import pytest

from lazyspec.bench.switches import apply_switches
from lazyspec.kernels import backend, moe_experts


def test_switches_set_the_named_constants(monkeypatch):
    monkeypatch.setattr(backend, "MOE_ROUTE_IN_UP_MAX_TOKENS", 0)
    monkeypatch.setattr(backend, "MOE_DOWN_IN_UP_MAX_TOKENS", 0)
    monkeypatch.setattr(moe_experts, "RANK_MAX_ELEMENTS", 0)
    items = [
        "backend.MOE_ROUTE_IN_UP_MAX_TOKENS=1",
        "backend.MOE_DOWN_IN_UP_MAX_TOKENS=2",
        "moe_experts.RANK_MAX_ELEMENTS=16384",
    ]
    lines = apply_switches(items)
    assert backend.MOE_ROUTE_IN_UP_MAX_TOKENS == 1
    assert backend.MOE_DOWN_IN_UP_MAX_TOKENS == 2
    assert moe_experts.RANK_MAX_ELEMENTS == 16384
    assert lines == [
        "backend.MOE_ROUTE_IN_UP_MAX_TOKENS = 1",
        "backend.MOE_DOWN_IN_UP_MAX_TOKENS = 2",
        "moe_experts.RANK_MAX_ELEMENTS = 16384",
    ]
    assert backend.moe_launch(2, *_stacks())["down_in_up"]  # read by the dispatch


def test_a_bool_constant_stays_a_bool(monkeypatch):
    monkeypatch.setattr(backend, "SOME_FLAG", False, raising=False)
    assert apply_switches(["backend.SOME_FLAG=1"]) == ["backend.SOME_FLAG = True"]
    assert backend.SOME_FLAG is True


def _stacks():
    import jax
    import jax.numpy as jnp

    spec = jax.ShapeDtypeStruct
    return spec((8, 64, 32), jnp.float32), spec((8, 32, 64), jnp.float32)


@pytest.mark.parametrize(
    "item, message",
    [
        ("backend.MOE_ROUTE_IN_UP_MAX_TOKENS", "expected module.NAME=INT"),
        ("engine.MOE_ROUTE_IN_UP_MAX_TOKENS=1", "expected module.NAME=INT"),
        ("backend.NO_SUCH_SWITCH=1", "not an int or bool constant"),
        ("backend.DEFAULT_MOE_TILES=1", "not an int or bool constant"),
        ("backend.moe_launch=1", "not an int or bool constant"),
        ("backend.MOE_ROUTE_IN_UP_MAX_TOKENS=yes", "is not an integer"),
    ],
)
def test_a_bad_switch_is_refused_before_any_is_set(item, message, monkeypatch):
    monkeypatch.setattr(backend, "MOE_DOWN_IN_UP_MAX_TOKENS", 0)
    with pytest.raises(ValueError, match=message):
        apply_switches(["backend.MOE_DOWN_IN_UP_MAX_TOKENS=2", item])
    assert backend.MOE_DOWN_IN_UP_MAX_TOKENS == 0
