"""Counting XLA compilations with JAX's own monitoring events."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def backend_compiles() -> Iterator[list[float]]:
    """The seconds of every backend (XLA) compilation made inside the block, one entry each:
    a program found in JAX's caches (a jitted function's, or one compiled ahead of a call)
    adds none."""
    import jax

    seen: list[float] = []

    def listen(event: str, seconds: float, **_: object) -> None:
        if event == BACKEND_COMPILE:
            seen.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
