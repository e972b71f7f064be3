"""The null slot and the null page must never be written: host views for tests."""

from __future__ import annotations

import numpy as np


def null_sink_rows(engine) -> dict[str, np.ndarray]:
    """Host copies of everything that must stay zero: slot 0 of the conv / ssm pools, rows
    0..page_size-1 (page 0) of every target and MTP KV pool, and request row 0 of the
    token-count pools."""
    pools, page_size = engine.runner.pools, engine.layout.page_size
    rows = {"conv slot 0": np.asarray(pools.conv[:, 0]), "ssm slot 0": np.asarray(pools.ssm[:, 0])}
    rows["output_counts row 0"] = np.asarray(pools.output_counts[0])
    rows["in_prompt row 0"] = np.asarray(pools.in_prompt[0])
    kv_pools = {"kv": pools.kv}
    if pools.mtp_kv is not None:
        kv_pools["mtp_kv"] = pools.mtp_kv
    for name, kv in kv_pools.items():
        for part in ("k", "v"):
            for layer, pool in enumerate(getattr(kv, part)):
                rows[f"{name}.{part}[{layer}] page 0"] = np.asarray(pool[:page_size])
    return rows


def assert_null_sinks_zero(engine) -> None:
    """AssertionError naming every null slot / page row that holds a non-zero value."""
    rows = null_sink_rows(engine)
    written = {name: float(np.abs(a).max()) for name, a in rows.items() if a.any()}
    assert not written, f"null slot / page written: {written}"
