"""``scripts/bench_engine.py`` end to end on CPU: the tiny preset at tp = 2 over two fake
devices, a batch of two rows on pages of 16 tokens, one row of the table with its floor, and
its profile (the device step's span).

It is also the regression run of a hang: every tensor-parallel step of more than one
request row at these shapes used to stop forever inside jaxlib's CPU triangular solve (the
chunked GDN prefill), which splits its batch over the thread pool both devices' programs
run on (the chunked form now inverts its systems with batched products instead:
``kernels/gdn/chunked.invert_unit_lower``). A subprocess with a timeout, so a hang fails
the test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lazyspec.testing.xla_flags import for_host_devices

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300


def test_tiny_preset_at_tp_2_decodes_two_rows(tmp_path):
    out = tmp_path / "table.md"
    command = [
        sys.executable,
        str(ROOT / "scripts" / "bench_engine.py"),
        "--preset", "tiny", "--backends", "xla", "--tp-size", "2", "--batches", "2",
        "--prompt-len", "64", "--output-len", "8", "--copy-mib", "16", "--out", str(out),
        "--page-size", "16", "--profile", str(tmp_path / "profile"),
    ]  # fmt: skip
    env = dict(os.environ, XLA_FLAGS=for_host_devices(2), JAX_PLATFORMS="cpu")
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"bench_engine at tp 2 with two rows hung past {TIMEOUT_S} s")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "2 rows, page size 16)" in done.stdout
    assert "2 decode programs bound" in done.stdout  # the timed steps call what serving does
    assert out.read_text().startswith("device: cpu (cpu), jax ")  # the card of the figures
    rows = [line for line in out.read_text().splitlines() if line.startswith("| tiny |")]
    assert len(rows) == 3, out.read_text()  # the step row, its host calls, its profile
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[1:4] == ["2", "xla", "2"]  # tp, backend, batch
    loop_ms, alone_ms, floor_ms = (float(c) for c in cells[5:8])
    assert loop_ms > 0 and alone_ms > 0 and 0 < floor_ms < alone_ms
    host = [c.strip() for c in rows[1].strip("|").split("|")]
    assert host[4] == "1"  # decode programs: one on a CPU
    schedule, launch, dispatch, fetch, process = (float(c) for c in host[6:])
    assert float(host[5]) == loop_ms and 0 < dispatch <= launch < loop_ms
    assert schedule > 0 and fetch > 0 and process > 0
    profile = [c.strip() for c in rows[2].strip("|").split("|")]
    kernels, device_ms, busy_ms = int(profile[3]), float(profile[4]), float(profile[5])
    assert kernels > 0 and device_ms > 0 and busy_ms > 0
    assert profile[6].endswith(" %")  # the floor over the span
