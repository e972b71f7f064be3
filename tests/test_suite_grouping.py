"""The suite's xdist grouping (``tests/conftest.py``): under ``-n 2 --dist loadgroup`` every
test file runs in one worker, so its module-scoped fixtures (engines, subprocess runs) are
built once. A small generated suite with a copy of the conftest, run in a subprocess."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

CONFTEST = Path(__file__).resolve().parent / "conftest.py"
TEST_FILE = """
import os

import pytest


@pytest.mark.parametrize("i", range(8))
def test_record_the_worker(i):
    with open(os.path.join(os.path.dirname(__file__), "{name}.workers"), "a") as out:
        out.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
"""


def test_every_file_runs_in_one_worker(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(CONFTEST, suite / "conftest.py")
    names = ["test_a", "test_b", "test_c"]
    for name in names:
        (suite / f"{name}.py").write_text(TEST_FILE.format(name=name))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2"]
        + ["--dist", "loadgroup", str(suite)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    workers = {name: (suite / f"{name}.workers").read_text().split() for name in names}
    assert all(len(seen) == 8 for seen in workers.values()), workers
    assert all(len(set(seen)) == 1 for seen in workers.values()), workers
