"""/metrics' engine gauges (server/metrics.py), from an engine's serving surface."""

from __future__ import annotations

from types import SimpleNamespace

from lazyspec.engine.results import EngineStats
from lazyspec.server.metrics import ServerMetrics


def _engine(host_info: dict) -> SimpleNamespace:
    stats = EngineStats(1, 2, 3, 4, 50, 60, 10, 200, 0)
    return SimpleNamespace(stats=lambda: stats, host_cache_info=lambda: host_info)


def test_the_host_tier_counts_are_exported_when_it_is_on():
    metrics = ServerMetrics()
    info = {"hicache_num_host_hits": 7, "hicache_loaded_bytes": 4096}
    metrics.observe_engine(_engine({**info, "hicache_write_policy": "write_back"}), None)
    text = metrics.render().decode()
    assert 'lazyspec_hicache{what="num_host_hits"} 7.0' in text
    assert 'lazyspec_hicache{what="loaded_bytes"} 4096.0' in text
    assert 'lazyspec_state_slots{use="cached"} 4.0' in text
    off = ServerMetrics()
    off.observe_engine(_engine({}), None)
    assert "lazyspec_hicache{" not in off.render().decode()
