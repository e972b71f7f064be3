"""Suite-wide fixtures."""

from __future__ import annotations

import gc
import importlib.util
import os
import sys
from pathlib import Path

import pytest

from lazyspec.testing.collector import quiet_collector
from lazyspec.testing.xla_flags import knows_fusion_emitters_flag, with_fast_compile

if os.environ.get("PYTEST_XDIST_WORKER"):
    # several test processes on one machine: none may take most of an accelerator's memory
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# The CPU backend's LLVM code of one program in one piece, not split over a thread pool: on
# the suite's two cores (two test processes) the split only adds work (the tiny engines'
# warm-up compiles about a tenth faster, in CPU time too). The generated code is the same.
# Added only where the loop emitters' flag is (jaxlib before 0.11, whose XLA knows both; XLA
# aborts on an unknown flag); newer ones compile as before.
SERIAL_CODEGEN = "--xla_cpu_parallel_codegen_split_count=1"


def suite_xla_flags(flags: str) -> str:
    """``flags`` with ``with_fast_compile``'s flags and ``SERIAL_CODEGEN``, unless they set
    the optimisation level (a timing run keeps its own flags)."""
    if "xla_backend_optimization_level" in flags:
        return flags
    serial = knows_fusion_emitters_flag() and "codegen_split_count" not in flags
    return with_fast_compile(f"{flags} {SERIAL_CODEGEN}" if serial else flags)


def import_installed_kernels_package() -> None:
    """Import the ``kernels`` distribution where one is installed (transformers 5.25 and later
    require it, and import it with their hub integration): from the repository root, where
    pytest runs, ``import kernels`` would find this repository's ``kernels/`` folder (the
    package installed as ``lazyspec.kernels``) and transformers' import of its names would
    fail. The folder is left off the search path for this one import."""
    root = Path(__file__).resolve().parents[1]
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != root]
    try:
        if importlib.util.find_spec("kernels") is not None:
            importlib.import_module("kernels")
    finally:
        sys.path[:] = saved


import_installed_kernels_package()

# compile without LLVM's costly passes (lazyspec.testing.xla_flags); before jax is imported.
# The suite's subprocesses take these flags from ``os.environ`` (add theirs after them).
os.environ["XLA_FLAGS"] = suite_xla_flags(os.environ.get("XLA_FLAGS", ""))

# fewer, cheaper garbage-collector walks while jax traces and lowers (the subprocess
# workers of the parallel tests call it too)
quiet_collector()


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to under ``-n 2 --dist loadgroup``: its file, and one
    unit for all the server files, which share a live engine whose compiled programs must not
    be dropped by another file's tests running between them in the same worker."""
    path = nodeid.split("::", 1)[0].split("@", 1)[0]
    return "tests/server" if path.startswith("tests/server/") else path


@pytest.hookimpl(optionalhook=True)  # a hook of xdist's: absent under -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` hands out ``work_unit``s whole, in the collection's order. A
    scheduler of its own, not ``xdist_group`` marks: xdist applies those by renaming each
    item's node id, which pytest 9.2 no longer reads, so every file's tests were spread over
    both workers again, each building the file's module-scoped engines."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return WorkUnitScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """The units with a ``slow`` test first: xdist hands the units out in this order (see
    ``pytest_configure``), and one started last would run on alone at the end."""
    slow = {work_unit(item.nodeid) for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: work_unit(item.nodeid) not in slow)


def pytest_configure(config):
    """xdist hands the units out in the collection's order, not reordered by their number of
    tests: that number says nothing of their time, and the suite puts its longest units
    first (``pytest_collection_modifyitems``)."""
    if config.pluginmanager.hasplugin("xdist"):
        config.option.loadscopereorder = False


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs(request):
    """Drop JAX's compiled programs after each test module: one process runs the whole
    suite, and without this it holds every module's executables to the end (the suite
    segfaulted inside XLA's CPU compiler once enough of them had piled up). The server
    tests share one live engine for the session and count its compilations: kept."""
    yield
    if request.module.__name__.startswith("tests.server"):
        return
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.clear_caches()
    gc.collect()
