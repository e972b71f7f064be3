"""Model families, loading, and the cache-free reference oracles.

The exports load lazily, so importing ``lazyspec.models.config`` (host-only code does)
never pulls in jax.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Model", "family_module", "incremental_logits", "load_model", "reference_logits"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("lazyspec.models.model"), name)
    raise AttributeError(f"module 'lazyspec.models' has no attribute {name!r}")
