"""lazyspec: serve hybrid (recurrent + attention) LLMs from JAX with a checkpointing radix
cache and MTP speculative decoding."""

from __future__ import annotations

__all__ = ["Engine", "EngineConfig"]


def __getattr__(name: str):
    # Lazy, so host-only modules (scheduler, cache) import without jax.
    if name == "Engine":
        from lazyspec.engine.engine import Engine

        return Engine
    if name == "EngineConfig":
        from lazyspec.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
