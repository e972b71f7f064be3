"""Runs of this repository's code in a fresh Python process on fake CPU devices (the
device count is fixed when jax is first imported, so a test that needs another count runs
its work in a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def cpu_devices_env(num_devices: int) -> dict[str, str]:
    """This process's environment for a child on ``num_devices`` fake CPU devices that can
    import ``tests``."""
    from lazyspec.testing.xla_flags import for_host_devices

    return dict(
        os.environ,
        XLA_FLAGS=for_host_devices(num_devices),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )


def last_json_line(stdout: str) -> dict:
    """The report a child prints as its last line."""
    return json.loads(stdout.strip().splitlines()[-1])


def run_on_cpu_devices(args: list[str], num_devices: int, timeout: float) -> dict:
    """``python *args`` in the repository root on ``num_devices`` fake CPU devices; its
    report (``last_json_line``). A non-zero exit fails with the child's stderr."""
    done = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=cpu_devices_env(num_devices),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return last_json_line(done.stdout)
