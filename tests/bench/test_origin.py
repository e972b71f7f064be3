"""The benchmarks' check that ``lazyspec`` and ``lazyspec.kernels`` are one tree's code
(``lazyspec.bench.origin``), on the installed checkout and on an older tree's copy."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lazyspec.bench.origin import code_folders, code_line, device_line, same_tree

ROOT = Path(__file__).resolve().parents[2]


def test_the_checkout_is_one_tree():
    package, kernels = code_folders()
    assert code_line() == f"code: lazyspec {package}, lazyspec.kernels {kernels}"


def test_the_device_line_names_the_card_and_jax():
    import jax

    kind = jax.devices()[0].device_kind
    assert device_line() == f"device: {kind} ({jax.default_backend()}), jax {jax.__version__}"


@pytest.mark.parametrize(
    "package,kernels,want",
    [
        ("/src/lazyspec", "/src/kernels", True),  # a source tree, installed editable
        ("/site/lazyspec", "/site/lazyspec/kernels", True),  # installed, or linked in a copy
        ("/copy/lazyspec", "/src/kernels", False),  # a copy over the checkout's kernels
        ("/copy/lazyspec", "/copy/other/kernels", False),
    ],
)
def test_same_tree_by_folders(package, kernels, want):
    assert same_tree(Path(package), Path(kernels)) is want


def _origin_in(tree: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(tree))
    code = "from lazyspec.bench.origin import code_line; print(code_line())"
    return subprocess.run(
        [sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True
    )


def test_an_older_tree_copy_is_refused_until_its_kernels_are_linked(tmp_path):
    """A copy of a tree run with ``PYTHONPATH`` (how an older tree is timed beside the
    checkout) imports the installed checkout's kernels: refused, naming both folders; with
    a ``lazyspec/kernels`` link to its own ``kernels/``, its own code, accepted."""
    package, kernels = code_folders()
    # the suite's install maps lazyspec.kernels to the checkout's kernels/ (editable)
    assert kernels == ROOT / "kernels" and package == ROOT / "lazyspec", (package, kernels)
    copy = tmp_path / "older"
    shutil.copytree(package, copy / "lazyspec", ignore=shutil.ignore_patterns("assets"))
    shutil.copytree(kernels, copy / "kernels")
    refused = _origin_in(copy)
    assert refused.returncode != 0
    assert "RuntimeError" in refused.stderr and "another tree's kernels" in refused.stderr
    assert str(copy / "lazyspec") in refused.stderr and str(kernels) in refused.stderr
    (copy / "lazyspec" / "kernels").symlink_to(Path("..") / "kernels")
    linked = _origin_in(copy)
    assert linked.returncode == 0, linked.stderr
    assert linked.stdout.strip() == (
        f"code: lazyspec {copy / 'lazyspec'}, lazyspec.kernels {copy / 'lazyspec' / 'kernels'}"
    )
