"""The kernel benchmark (``lazyspec.bench.kernels``) in its CPU smoke mode: every Pallas case
(and the chunked prefill form) is checked against its reference and timed, and the table says so."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def bench_kernels():
    from lazyspec.bench import kernels

    return kernels


def test_bench_kernels_smoke_checks_every_pallas_case(bench_kernels, tmp_path):
    out = tmp_path / "smoke.md"
    argv = [
        "--smoke",
        "--kernels",
        "state,ceiling,chunk,scatter",
        "--models",
        "tiny-gdn",
        "--out",
        str(out),
    ]
    assert bench_kernels.main(argv) == 0
    rows = [
        line.split("|")[1:-1]
        for line in out.read_text().splitlines()
        if line.startswith("| ") and not line.startswith("| kernel")
    ]
    rows = [[cell.strip() for cell in row] for row in rows]
    # {state, scatter} x 1 batch x 2 token counts x (1 Pallas tile + XLA), the ceiling (decode
    # only) x (1 tile + XLA), and the prefill (chunk) bench at one batch and length: chunked
    # form + scan
    assert len(rows) == 12
    checked = [row for row in rows if row[4] in ("pallas", "chunked")]
    assert len(checked) == 6
    assert [row[0] for row in rows].count("copy-gdn") == 2
    assert all(row[6].startswith("ok ") for row in checked), [row[6] for row in checked]
    assert all(row[7] and row[8] for row in rows)  # every case timed, bytes counted


def test_max_abs_diff_flags_non_finite(bench_kernels):
    import jax.numpy as jnp

    from lazyspec.bench import kernel_timing

    a = jnp.ones((4, 8), jnp.float32)
    assert kernel_timing.max_abs_diff(a, a.at[1, 2].add(3.0)) == 3.0
    assert kernel_timing.max_abs_diff(a, a.at[3, 1].set(jnp.nan)) == float("inf")
