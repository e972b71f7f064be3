"""The MoE benchmark (``benchmarks/tools/bench_moe.py``) in its CPU smoke mode: the kernel and both
XLA forms are checked against ``grouped_experts`` and timed, and the table says so."""

from __future__ import annotations

import math

import pytest


def test_bench_moe_smoke_checks_every_form(tmp_path, load_tool):
    bench_moe = load_tool("bench_moe")
    out = tmp_path / "smoke.md"
    assert bench_moe.main(["--smoke", "--tokens", "3", "--out", str(out)]) == 0
    rows = [
        line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| tiny")
    ]
    impls = [row[2].strip() for row in rows]
    assert impls == ["pallas", "xla grouped_experts", "xla dense einsum"]
    for row in rows:
        assert row[4].strip().startswith("ok"), row
        # timed: a number (a difference of two chains' medians, so on a busy CPU a tiny
        # form's may come out at or below zero), and the routed bytes counted
        assert math.isfinite(float(row[5])) and float(row[6]) > 0.0, row


def test_bench_moe_profiler_timing_names_both_launches(tmp_path, monkeypatch, load_tool):
    """``--timing profiler`` (CPU, interpret mode): the dispatch's tiles ('launch') and
    explicit entries (one with the down launch's own chunk and stages) each get device time
    from the trace, split into the up and down launches, and the XLA forms are left out
    with ``--no-xla``. The dispatch's folded down product is off here (two tokens are within
    its default), so the 'launch' row has a down launch too."""
    bench_moe = load_tool("bench_moe")
    out = tmp_path / "profiled.md"
    argv = ["--smoke", "--tokens", "2", "--timing", "profiler", "--no-xla", "--out", str(out)]
    argv += ["--kernel-tuning", "moe.down_in_up_max_tokens=0"]
    tiles = "launch,16:32:16:4:1,16:32:16:4:1:32:1"  # the last: the down launch's own chunk
    assert bench_moe.main(argv + ["--tiles", tiles]) == 0
    rows = [
        line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| tiny")
    ]
    assert [row[2].strip() for row in rows] == ["pallas", "pallas", "pallas"]
    assert "block_out=32,block_k=16,num_warps=4,num_stages=1" in rows[1][3], rows[1]
    assert "block_k_down=32,down_num_stages=1" in rows[2][3], rows[2]
    for row in rows:
        assert row[4].strip().startswith("ok"), row
        total, up, down = float(row[5]), float(row[9]), float(row[10])
        assert up > 0.0 and down > 0.0 and up + down <= total, row
    assert "profiler's kernel durations" in out.read_text()


def test_bench_moe_launch_row_runs_the_dispatchs_folded_down(tmp_path, load_tool):
    """With ``MoETuning.down_in_up_max_tokens`` covering the row's tokens (set by
    ``--kernel-tuning``, which the table's header records), the 'launch' row runs the down
    product in the up launch, as the dispatch would: its tiles say so (the folded launch's
    own warps, also set), it is checked, and no down launch appears in its trace."""
    bench_moe = load_tool("bench_moe")
    out = tmp_path / "folded.md"
    argv = ["--smoke", "--tokens", "2", "--timing", "profiler", "--no-xla", "--out", str(out)]
    setting = ["--kernel-tuning", "moe.down_in_up_max_tokens=2,moe.fold_num_warps=2"]
    assert bench_moe.main(argv + ["--tiles", "launch"] + setting) == 0
    assert "kernel tuning: moe.down_in_up_max_tokens = 2" in out.read_text()
    (row,) = [
        line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| tiny")
    ]
    assert "down_in_up=True" in row[3] and "num_warps=2" in row[3], row
    assert row[4].strip().startswith("ok"), row
    total, up, down = float(row[5]), float(row[9]), float(row[10])
    assert up > 0.0 and down == 0.0 and up <= total, row


def test_bench_moe_fold_entries_run_the_folded_form(tmp_path, load_tool):
    """A ``fold:`` entry of ``--tiles`` runs the folded form (its row's tiles say
    ``down_in_up``, its check passes, no down launch in its trace) at the tiles it names; a
    plain entry runs two launches; a folded entry with a down launch's fields is refused."""
    bench_moe = load_tool("bench_moe")
    tiles = bench_moe.parse_tiles("fold:16:32:16:4:1,16:32:16:4:1")
    assert tiles[0] == {
        "block_rows": 16,
        "block_inner": 16,
        "block_out": 32,
        "block_k": 16,
        "num_warps": 4,
        "num_stages": 1,
        "down_in_up": True,
    }
    assert "down_in_up" not in tiles[1]
    with pytest.raises(SystemExit, match="no down launch"):
        bench_moe.parse_tiles("fold:16:32:16:4:1:16:1")
    out = tmp_path / "fold.md"
    argv = ["--smoke", "--tokens", "2", "--timing", "profiler", "--no-xla", "--out", str(out)]
    assert bench_moe.main(argv + ["--tiles", "fold:16:32:16:4:1,16:32:16:4:1"]) == 0
    rows = [
        line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| tiny")
    ]
    assert len(rows) == 2, rows
    for row, folded in zip(rows, (True, False)):
        assert ("down_in_up=True" in row[3]) == folded, row
        assert "block_inner=16" in row[3] and row[4].strip().startswith("ok"), row
        assert (float(row[10]) == 0.0) == folded, row  # the down launch's time
