"""The package's layering rules, checked by folder rather than by a hand-kept module list.

* Host-only folders (``lazyspec/cache``, ``lazyspec/scheduler``), ``lazyspec/config.py`` and
  ``lazyspec/token_map.py`` never import jax: every module in them imports, and the cache
  runs, with jax blocked.
* The import graph of ``lazyspec`` (module-level imports) has no cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from lazyspec.testing.no_jax import BLOCK_JAX

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lazyspec"
HOST_FOLDERS = ("cache", "scheduler")
HOST_MODULES = ("lazyspec.config", "lazyspec.token_map")

RUN_HOST_MODULES = (
    BLOCK_JAX
    + """
for name in sys.argv[1:]:
    importlib.import_module(name)

from lazyspec.cache.allocators import KVAllocator, SlotAllocator
from lazyspec.cache.radix_cache import RadixCache, check_all

kv, slots = KVAllocator(8, 2), SlotAllocator(4)
tree = RadixCache(2, kv, slots)
rows = kv.pages_to_token_indices(kv.alloc_pages(2))
tree.insert([5, 6, 7, 8], rows, slots.alloc(1)[0])
assert tree.match_prefix([5, 6, 7, 8, 9]).prefix_len == 4
check_all(kv, slots, tree, [], [])
loaded = sorted(m for m in sys.modules if m == "jax" or m.startswith(("jax.", "jaxlib")))
print("ok", loaded)
"""
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def host_modules() -> list[str]:
    found = [
        _module_name(p) for folder in HOST_FOLDERS for p in sorted((PACKAGE / folder).rglob("*.py"))
    ]
    return found + list(HOST_MODULES)


def test_host_folders_import_and_run_without_jax() -> None:
    modules = host_modules()
    assert "lazyspec.scheduler.scheduler" in modules and "lazyspec.cache.radix_cache" in modules
    result = subprocess.run(
        [sys.executable, "-c", RUN_HOST_MODULES, *modules],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok []"


def _top_level_imports(path: Path, known: set[str]) -> set[str]:
    """lazyspec modules imported at module level (not inside functions) by ``path``."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        out.update(n for n in names if n in known)
    return out


def import_graph() -> dict[str, set[str]]:
    files = {p: _module_name(p) for p in PACKAGE.rglob("*.py")}
    files.update(
        {
            p: "lazyspec.kernels" + _module_name(p)[len("kernels") :]
            for p in (ROOT / "kernels").rglob("*.py")
        }
    )
    known = set(files.values())
    return {name: _top_level_imports(path, known) - {name} for path, name in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 40 and graph["lazyspec.engine.engine"], "the graph was not read"
    assert find_cycle(graph) is None, find_cycle(graph)


def test_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
