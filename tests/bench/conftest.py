"""Fixtures of the benchmark tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
TOOLS = ROOT / "benchmarks" / "tools"


def _load(monkeypatch, path: Path):
    module_name = path.stem
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, module_name, module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def load_script(monkeypatch):
    """``load_script(name)``: ``scripts/{name}.py`` imported as module ``name``, registered
    in ``sys.modules`` for the test (its dataclasses look their module up there)."""

    def load(name: str):
        return _load(monkeypatch, SCRIPTS / f"{name}.py")

    return load


@pytest.fixture
def load_tool(monkeypatch):
    """``load_tool(name)``: the experiment tool ``benchmarks/tools/{name}.py``, imported as
    ``load_script`` imports a script."""

    def load(name: str):
        return _load(monkeypatch, TOOLS / f"{name}.py")

    return load
