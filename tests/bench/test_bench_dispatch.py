"""``scripts/bench_dispatch.py``: its count of XLA's command-buffer updates per timed phase
(read from the log lines XLA writes on a GPU), and a CPU run of the tiny preset."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from lazyspec.testing.xla_flags import with_fast_compile

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_dispatch.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_dispatch", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _update_line(allocs: int) -> str:
    # the shape of XLA's log line (command_buffer_thunk, VLOG 3)
    return (
        "I1203 09:52:30.512244    1664 command_buffer_thunk.cc:336] [0] Create/Update command "
        "buffer by recoding command buffer cmd sequence after 1 executions since last update; "
        f"num_commands=268; updated_allocs={allocs}; is_first_record=false; needs_update=true"
    )


def test_updates_are_counted_per_phase():
    bench = _module()
    log = "\n".join(
        [
            _update_line(7),  # before any phase (compilation, warm-up): not counted
            bench.PHASE + "first",
            "I1203 09:52:30.512496    1664 command_buffer_thunk.cc:362] [0] Updated command "
            "buffer in 239 μs; num_commands=268",
            *[_update_line(10)] * 4,
            _update_line(12),
            bench.PHASE + "second",
            "some other line",
        ]
    )
    counts = bench.count_updates(log, calls=2)  # 2 timed + 3 untimed calls a phase
    assert counts == {"first": (1.0, 10.0), "second": (0.0, 0.0)}


def test_tiny_preset_runs_on_cpu():
    env = dict(os.environ, XLA_FLAGS=with_fast_compile(os.environ.get("XLA_FLAGS", "")))
    command = [sys.executable, str(SCRIPT), "--preset", "tiny", "--backends", "xla"]
    command += ["--dtype", "float32", "--batches", "1", "--calls", "3", "--ref-commands", "4"]
    result = subprocess.run(
        command + ["--count-updates"], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| tiny xla decode")]
    # one program and two in turn, each idle and chained, in the timing and the update tables
    assert len(rows) == 8
    for copies in (1, 2):
        assert sum(f", {copies} in turn, " in row for row in rows) == 4, rows
    assert "n/a on this backend" in result.stdout
