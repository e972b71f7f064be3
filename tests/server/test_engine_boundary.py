"""The server reaches the engine only through its serving surface (``Engine.abort``,
``stop``, ``stats``, ...): no code under lazyspec/server names the engine's scheduler,
radix tree, allocators, slot policy, runner or memory layout."""

from __future__ import annotations

import ast
from pathlib import Path

import lazyspec.server

INTERNALS = frozenset(
    {"scheduler", "tree", "kv_allocator", "slot_allocator", "policy", "runner", "layout"}
)
SERVER_DIR = Path(lazyspec.server.__file__).parent


def internal_accesses(source: str) -> list[tuple[int, str]]:
    """(line, name) of every ``x.<internal>`` and ``getattr(x, "<internal>")`` in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in INTERNALS:
            found.append((node.lineno, node.attr))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in {"getattr", "setattr", "hasattr"}
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in INTERNALS
        ):
            found.append((node.lineno, node.args[1].value))
    return found


def test_scanner_finds_every_form_of_access():
    source = (
        "def f(engine, worker):\n"
        "    engine.scheduler.abort('r')\n"
        "    worker.engine.tree.flush()\n"
        "    n = engine.kv_allocator.num_free_tokens + engine.slot_allocator.num_free\n"
        "    getattr(engine, 'runner').num_compiled()\n"
        "    return engine.layout.num_slots, engine.policy, engine.stats()\n"
    )
    names = sorted(name for _, name in internal_accesses(source))
    assert names == sorted(INTERNALS)


def test_server_sources_use_only_the_engine_surface():
    files = sorted(SERVER_DIR.rglob("*.py"))
    # the scan covers the modules that hold the engine, so an empty result means something
    assert {"worker.py", "metrics.py", "app.py"} <= {f.name for f in files}
    offenders = [
        f"{path.relative_to(SERVER_DIR)}:{line}: .{name}"
        for path in files
        for line, name in internal_accesses(path.read_text())
    ]
    assert not offenders, "the server reaches into engine internals:\n" + "\n".join(offenders)
