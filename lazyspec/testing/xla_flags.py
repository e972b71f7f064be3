"""XLA flags of the CPU test runs (no jax import here: set them before jax loads).

``FAST_COMPILE`` compiles without LLVM's costly optimisation passes. The suite's time is
mostly the compilation of small programs that then run a few times: the engine tests take
about a fifth less wall time with it, the interpret-mode Pallas steps compile in about half.
It lowers the optimisation of the generated code on any backend, so a run with it is never
a timing.

They also turn off the CPU backend's newer fusion emitters for the older loop emitters:
on the tiny engines' step programs compilation takes about half the time, and a test file
of engine runs about a third less CPU time (the programs run fast enough either way).
"""

FAST_COMPILE = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    " --xla_cpu_use_fusion_emitters=false"
)


def with_fast_compile(flags: str) -> str:
    """``flags`` (an XLA_FLAGS value) with ``FAST_COMPILE`` added unless it sets the level."""
    if "xla_backend_optimization_level" in flags:
        return flags
    return f"{flags} {FAST_COMPILE}".strip()
