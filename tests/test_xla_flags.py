"""The test runs' XLA flags (``lazyspec.testing.xla_flags``): every flag must be one the
installed jaxlib knows (XLA aborts the process on an unknown flag), and the CPU loop
emitters' flag is added only where jaxlib still has it."""

from __future__ import annotations

import os
import subprocess
import sys

from lazyspec.testing import xla_flags
from lazyspec.testing.xla_flags import FAST_COMPILE, LOOP_EMITTERS, NO_VERIFIER, with_fast_compile


def test_the_loop_emitters_flag_only_where_jaxlib_has_it(monkeypatch):
    monkeypatch.setattr(xla_flags, "jaxlib_version", lambda: (0, 10))
    assert with_fast_compile("--a") == f"--a {FAST_COMPILE} {NO_VERIFIER} {LOOP_EMITTERS}"
    for version in ((0, 11), (1, 0), None):
        monkeypatch.setattr(xla_flags, "jaxlib_version", lambda version=version: version)
        assert with_fast_compile("--a") == f"--a {FAST_COMPILE} {NO_VERIFIER}"
    level = "--xla_backend_optimization_level=3"
    assert with_fast_compile(level) == level  # a run that sets the level keeps its flags
    passes = "--xla_disable_hlo_passes=algsimp"
    assert with_fast_compile(passes) == f"{passes} {FAST_COMPILE}"  # theirs, not replaced


def test_the_installed_jaxlib_takes_the_flags():
    env = dict(os.environ, XLA_FLAGS=with_fast_compile(""), JAX_PLATFORMS="cpu")
    run = subprocess.run(
        [sys.executable, "-c", "import jax.numpy as jnp; print(float(jnp.ones(3).sum()))"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "3.0"
