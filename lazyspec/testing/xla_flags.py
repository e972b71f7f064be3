"""XLA flags of the CPU test runs (no jax import here: set them before jax loads).

``FAST_COMPILE`` compiles without LLVM's costly optimisation passes. The suite's time is
mostly the compilation of small programs that then run a few times: the engine tests take
about a fifth less wall time with it, the interpret-mode Pallas steps compile in about half.
It lowers the optimisation of the generated code on any backend, so a run with it is never
a timing.

Where jaxlib still has them (before 0.11: jaxlib 0.11.2 aborts on the flag as unknown),
they also turn off the CPU backend's newer fusion emitters for the older loop emitters: on
the tiny engines' step programs compilation takes about half the time, and a test file of
engine runs about a third less CPU time (the programs run fast enough either way).

``NO_VERIFIER`` skips XLA's HLO verifier, which re-checks the whole module between its
compiler passes: under ``perf``, 5 % of an engine test's CPU samples (about a sixth of its
XLA compiling) were the verifier's, and none with the flag. It checks XLA's own passes, not
the program's results. Added unless the flags name passes to disable themselves.
"""

import os
from importlib import metadata

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
LOOP_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
NO_VERIFIER = "--xla_disable_hlo_passes=hlo-verifier"
# the first jaxlib whose XLA no longer knows LOOP_EMITTERS' flag
LOOP_EMITTERS_UNTIL = (0, 11)


def jaxlib_version() -> tuple[int, ...] | None:
    """The installed jaxlib's (major, minor), None if it is not installed."""
    try:
        return tuple(int(part) for part in metadata.version("jaxlib").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return None


def knows_fusion_emitters_flag() -> bool:
    """Whether the installed jaxlib's XLA has ``xla_cpu_use_fusion_emitters``."""
    version = jaxlib_version()
    return version is not None and version < LOOP_EMITTERS_UNTIL


def with_fast_compile(flags: str) -> str:
    """``flags`` (an XLA_FLAGS value) with ``FAST_COMPILE`` added unless it sets the level,
    ``NO_VERIFIER`` unless it disables passes itself, and ``LOOP_EMITTERS`` where the
    installed jaxlib knows it."""
    if "xla_backend_optimization_level" in flags:
        return flags
    extra = "" if "xla_disable_hlo_passes" in flags else f" {NO_VERIFIER}"
    extra += f" {LOOP_EMITTERS}" if knows_fusion_emitters_flag() else ""
    return f"{flags} {FAST_COMPILE}{extra}".strip()


def for_host_devices(num_devices: int) -> str:
    """The XLA_FLAGS of a subprocess on ``num_devices`` fake CPU devices: this process's
    flags (in the suite, those ``tests/conftest.py`` sets) with the device count, compiled
    fast (``with_fast_compile``)."""
    flags = os.environ.get("XLA_FLAGS", "")
    return with_fast_compile(f"{flags} --xla_force_host_platform_device_count={num_devices}")
