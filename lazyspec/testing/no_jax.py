"""A prelude for subprocess tests that must run with jax unavailable (host-only code)."""

from __future__ import annotations

# Python source: installs an import hook that refuses jax / jaxlib, and checks it works.
BLOCK_JAX = """
import importlib, importlib.abc, sys

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
"""
