"""The host-side cache modules must import (and work) with jax unavailable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import importlib.abc, sys

class BlockJax(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "jax" or name.startswith(("jax.", "jaxlib")):
            raise ImportError(f"jax is blocked in this test: {name}")
        return None

sys.meta_path.insert(0, BlockJax())
try:
    import jax
except ImportError:
    pass
else:
    raise SystemExit("the jax blocker does not work")

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


def test_cache_modules_import_and_run_without_jax() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok []"
