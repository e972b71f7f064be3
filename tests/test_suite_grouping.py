"""The suite's process set-up (``tests/conftest.py``).

Its xdist grouping: under ``-n 2 --dist loadgroup`` every test file runs in one worker, so
its module-scoped fixtures (engines, subprocess runs) are built once, and the files with a
``slow`` test are handed out first (small generated suites with a copy of the conftest, run
in a subprocess). Its garbage collector: quieted (``lazyspec.testing.collector``)."""

from __future__ import annotations

import gc
import shutil
import subprocess
import sys
from pathlib import Path

from lazyspec.testing.collector import THRESHOLDS

CONFTEST = Path(__file__).resolve().parent / "conftest.py"
TEST_FILE = """
import os

import pytest


@pytest.mark.parametrize("i", range(8))
def test_record_the_worker(i):
    with open(os.path.join(os.path.dirname(__file__), "{name}.workers"), "a") as out:
        out.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
"""


def _run(tmp_path, files: dict[str, str], workers: int) -> Path:
    """The generated suite's folder, after a run of ``files`` (name -> source)."""
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(CONFTEST, suite / "conftest.py")
    (suite / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: long\n")
    for name, text in files.items():
        (suite / f"{name}.py").write_text(text)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(workers)]
        + ["--dist", "loadgroup", str(suite)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return suite


def test_every_file_runs_in_one_worker(tmp_path):
    names = ["test_a", "test_b", "test_c"]
    suite = _run(tmp_path, {name: TEST_FILE.format(name=name) for name in names}, workers=2)
    workers = {name: (suite / f"{name}.workers").read_text().split() for name in names}
    assert all(len(seen) == 8 for seen in workers.values()), workers
    assert all(len(set(seen)) == 1 for seen in workers.values()), workers


ORDER_FILE = """
import os

import pytest

pytestmark = [{mark}]


@pytest.mark.parametrize("i", range({count}))
def test_record_the_order(i):
    with open(os.path.join(os.path.dirname(__file__), "order"), "a") as out:
        out.write("{name}\\n")
"""


def test_files_with_a_slow_test_are_handed_out_first(tmp_path):
    """One worker runs the groups in the order xdist hands them out: the one-test file
    marked ``slow``, last by name and by its number of tests, runs first."""
    files = {
        name: ORDER_FILE.format(name=name, count=count, mark=mark)
        for name, count, mark in (
            ("test_a", 4, ""),
            ("test_b", 4, ""),
            ("test_z", 1, "pytest.mark.slow"),
        )
    }
    order = (_run(tmp_path, files, workers=1) / "order").read_text().split()
    assert order == ["test_z"] + ["test_a"] * 4 + ["test_b"] * 4, order


def test_the_suite_quiets_the_garbage_collector():
    assert gc.get_threshold() == THRESHOLDS
    assert gc.get_freeze_count() > 0
