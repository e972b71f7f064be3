"""The MoE benchmark (``scripts/bench_moe.py``) in its CPU smoke mode: the kernel and both
XLA forms are checked against ``grouped_experts`` and timed, and the table says so."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_moe.py"


def test_bench_moe_smoke_checks_every_form(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_moe", SCRIPT)
    bench_moe = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_moe", bench_moe)  # its dataclasses look it up
    spec.loader.exec_module(bench_moe)
    out = tmp_path / "smoke.md"
    assert bench_moe.main(["--smoke", "--tokens", "3", "--out", str(out)]) == 0
    rows = [
        line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| tiny")
    ]
    impls = [row[2].strip() for row in rows]
    assert impls == ["pallas", "xla grouped_experts", "xla dense einsum"]
    for row in rows:
        assert row[4].strip().startswith("ok"), row
        assert float(row[5]) != 0.0 and float(row[6]) > 0.0, row
