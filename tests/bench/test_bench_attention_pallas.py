"""The decode-attention benchmark (``lazyspec.bench.attention``) in its CPU smoke mode: the
kernel is checked against the jnp form, every form that applies on CPU is timed (torch's in
its child process), and the table and plot are written."""

from __future__ import annotations

import importlib.util

import numpy as np


def test_bench_attention_smoke_checks_and_times_pallas(tmp_path):
    from lazyspec.bench import attention

    out = tmp_path / "attention.md"
    assert attention.main(["--smoke", "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    header = next(line for line in lines if line.startswith("| context"))
    names = [cell.strip() for cell in header.split("|")[1:-1]]
    rows = [line for line in lines if line.startswith("| ") and line != header]
    assert len(rows) == 1  # one context x one batch
    cells = dict(zip(names, (cell.strip() for cell in rows[0].split("|")[1:-1])))
    assert cells["check"].startswith("ok "), cells["check"]
    # timed (a number, not n/a); on a shared CPU the chain difference may be any sign
    timed = ["pallas us", "jnp us", "jnp@max us"]
    if importlib.util.find_spec("torch") is not None:
        timed.append("torch us")
    for form in timed:
        assert np.isfinite(float(cells[form])), form
    assert cells["cudnn us"] == "n/a"  # GPU only
    assert float(cells["KV MB"]) > 0
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "attention.png").stat().st_size > 0
