"""The references' float32 dots run in full precision: XLA's default float32 dot on a GPU is
TF32 (10 mantissa bits), far outside ``kernel_checks.tolerance`` of the kernels' IEEE dots."""

from __future__ import annotations

import jax
import pytest


@pytest.fixture(autouse=True)
def full_precision_references():
    with jax.default_matmul_precision("highest"):
        yield
