"""What every op shares: the platform tests, Pallas' launch options (interpret mode on CPU,
Triton compiler params on GPUs), the tile fitting rules, and the kernels' small helpers
(tile checks, whole-array blocks, masked row loads)."""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pallas_triton

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


def check_tile(name: str, size: int, block: int | None) -> int:
    """The tile size for an axis of ``size`` (None = whole axis); ValueError unless it divides."""
    block = size if block is None else block
    if block <= 0 or size % block:
        raise ValueError(f"{name}={block} must be a positive divisor of {size}")
    return block


def check_tpu_tile(name: str, size: int, block: int | None, unit: int) -> int:
    """A tile for an axis that is a minor block dim on a TPU: the whole axis or a multiple of
    unit that divides it."""
    block = check_tile(name, size, block)
    if block != size and block % unit:
        raise ValueError(f"{name}={block} must be {size} or a multiple of {unit} on TPU")
    return block


def tpu_head_tile(num_heads: int, preferred: int, unit: int = 8) -> int | None:
    """A head tile for a TPU layout (a minor block dim): the largest multiple of ``unit`` up
    to ``preferred`` that divides ``num_heads``; else all heads where they are no more than
    ``preferred``; else None (no legal tile near the tuning's: the caller's XLA form runs)."""
    for tile in range(preferred - preferred % unit, 0, -unit):
        if num_heads % tile == 0:
            return tile
    return num_heads if num_heads <= preferred else None


def tpu_interpret(interpret: Any) -> Any:
    """A Mosaic kernel's ``interpret`` argument: True means TPU interpret mode
    (``pltpu.InterpretParams()``: VMEM, DMAs, scalar prefetch and semaphores simulated on
    the CPU, reads out of bounds raise, fresh buffers hold NaN); an ``InterpretParams`` is
    passed on; False compiles for Mosaic."""
    if interpret is True:
        from jax.experimental.pallas import tpu as pltpu  # Mosaic imports only where used

        return pltpu.InterpretParams()
    return interpret


def whole() -> pl.BlockSpec:
    """A block that is the whole array (indexed inside the kernel)."""
    return pl.BlockSpec()


def powers_of_two(*sizes: int) -> bool:
    """Whether every size is a power of two, as a Triton block's dimensions must be."""
    return all(n & (n - 1) == 0 for n in sizes)


def triton_shape_error(kernel: str, **block_dims: int) -> str | None:
    """None where every one of a Triton-layout kernel's ``block_dims`` (the dimensions of
    the arrays its body loads, computes and stores) is a power of two, as the Pallas Triton
    lowering needs; else the message naming those that are not. Pure: the dispatches ask it
    to choose their XLA form, the kernels to refuse such a compiled launch before tracing."""
    odd = [f"{name}={size}" for name, size in block_dims.items() if not powers_of_two(size)]
    if not odd:
        return None
    return (
        f"{kernel} cannot run compiled through Triton: its block dims must be powers of two "
        f"and {', '.join(odd)} {'is' if len(odd) == 1 else 'are'} not (run it interpreted, "
        "or the XLA form)"
    )


def refuse_triton_shapes(interpret: Any, error: str | None) -> None:
    """ValueError with ``error`` (a ``triton_shape_error``) for a compiled launch: the
    Triton-layout kernels compile only through Triton, which would fail deep in its lowering."""
    if error is not None and not interpret:
        raise ValueError(error)


def load_rows(view, first, num_rows: int) -> jax.Array:
    """``view[...]``, a tile of ``view.shape[0]`` rows starting at row ``first`` (a multiple
    of that count) of an array of ``num_rows`` rows, read with the rows past the array as
    zeros (a masked load) where the last tile is partial: no padded copy of the array is
    needed. Where every tile is whole, a plain load."""
    if num_rows % view.shape[0] == 0:
        return view[...]
    index = first + jax.lax.broadcasted_iota(jnp.int32, view.shape, 0)
    return pallas_triton.load(view, mask=index < num_rows, other=0)
