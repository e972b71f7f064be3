"""Model families, loading, and the cache-free reference oracles.

The exports load lazily, so importing ``lazyspec.models.config`` (host-only code does)
never pulls in jax.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Model": "lazyspec.models.model",
    "incremental_logits": "lazyspec.models.model",
    "reference_logits": "lazyspec.models.model",
    "family_module": "lazyspec.models.registry",
    "load_model": "lazyspec.models.registry",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lazyspec.models' has no attribute {name!r}")
