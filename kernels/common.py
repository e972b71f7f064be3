"""What every op's dispatch shares: the platform tests, Pallas' launch options (interpret
mode on CPU, Triton compiler params on GPUs) and the tile fitting rules."""

from __future__ import annotations

from typing import Any, Literal

import jax

KernelBackend = Literal["pallas", "xla"]
KERNEL_BACKENDS: tuple[str, ...] = ("pallas", "xla")
TRITON_PLATFORMS = ("gpu", "cuda", "rocm")
TRITON_MIN_DOT = 16  # Triton's dots need every dim >= 16


def platform_of(platform: str | None) -> str:
    """``platform``, or JAX's default backend where None."""
    return jax.default_backend() if platform is None else platform


def default_backend(platform: str | None = None) -> str:
    """ "pallas" on a GPU platform, else "xla" (platform defaults to JAX's default). TPU
    defaults to "xla" too: the kernels index a whole-array pool ref, which Mosaic TPU would
    stage into VMEM, and no TPU run has been made (``kernel_backend="pallas"`` still asks
    for them)."""
    return "pallas" if platform_of(platform) in TRITON_PLATFORMS else "xla"


def resolve_backend(name: str | None, platform: str | None = None) -> str:
    """The backend to use: ``name`` if given (validated), else the platform default."""
    if name is None:
        return default_backend(platform)
    if name not in KERNEL_BACKENDS:
        raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {name!r}")
    return name


def on_platform(name: str, platform: str | None = None) -> bool:
    """Whether ``platform`` (default: JAX's default backend) is ``name``."""
    return platform_of(platform) == name


def pallas_compiler_params(
    platform: str | None = None, num_warps: int = 4, num_stages: int = 1
) -> Any:
    """Compiler params for a compiled (not interpreted) launch: Triton on GPUs, where the
    in-kernel pool indexing is measured to work; None (the default lowering) elsewhere."""
    if platform_of(platform) not in TRITON_PLATFORMS:
        return None
    from jax.experimental.pallas import triton as pallas_triton

    return pallas_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def pallas_options(
    interpret: bool, compiler_params: Any = None, num_warps: int = 4, num_stages: int = 1
) -> dict[str, Any]:
    """Interpret mode when asked or on CPU (where Pallas has no compiled lowering), else
    ``compiler_params`` (None: Triton's with ``num_warps`` and ``num_stages``)."""
    if interpret or on_platform("cpu"):
        return {"interpret": True, "compiler_params": None}
    if compiler_params is None:
        compiler_params = pallas_compiler_params(num_warps=num_warps, num_stages=num_stages)
    return {"interpret": False, "compiler_params": compiler_params}


def fitted_tile(size: int, preferred: int) -> int:
    """The largest power of two <= ``preferred`` that divides ``size`` (at least 1)."""
    tile = 1
    while tile * 2 <= preferred and size % (tile * 2) == 0:
        tile *= 2
    return tile


def small_step_tile(num_tokens: int, max_tokens: int, size: int, preferred: int) -> int | None:
    """``fitted_tile(size, preferred)`` at a step of up to ``max_tokens`` tokens where
    ``preferred`` is set (> 0); else None: the launch keeps its own tile."""
    if preferred > 0 and num_tokens <= max_tokens:
        return fitted_tile(size, preferred)
    return None
