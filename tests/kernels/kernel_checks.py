"""Shared checks for the Pallas kernel tests: where the kernels run compiled, the one
tolerance rule, and the comparisons."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.kernels.common import TRITON_MIN_DOT, TRITON_PLATFORMS, pallas_compiler_params

# The Triton forms run compiled on a GPU and in interpret mode elsewhere; the Mosaic (TPU)
# forms run compiled on a TPU and in TPU interpret mode elsewhere.
INTERPRET = jax.default_backend() not in TRITON_PLATFORMS
TPU_INTERPRET = jax.default_backend() != "tpu"


def dot_tile(size: int) -> int:
    """A test's tile along a dot's dimension: ``size`` in interpret mode (which runs any
    tile, so the tiny cases still span several tiles), at least Triton's 16-wide dot
    minimum where the kernel runs compiled."""
    return size if INTERPRET else max(size, TRITON_MIN_DOT)


# Unit roundoff: half the spacing of the numbers near 1.
UNIT_ROUNDOFF = {
    jnp.dtype(jnp.float32): 2.0**-24,
    jnp.dtype(jnp.float16): 2.0**-11,
    jnp.dtype(jnp.bfloat16): 2.0**-8,
}
# float32 sums of the same n terms in two orders differ by about sqrt(n) roundings of the
# running sum (independent errors); 16 of those covers the tails at the sizes tested here and
# the few-ulp differences of exp / log1p between Triton, XLA and numpy.
ACCUMULATION_ULPS = 16


def tolerance(dtype, reduction_length: int = 1, roundings: int = 1) -> float:
    """The relative tolerance for a kernel against its reference when both read inputs of
    ``dtype``, accumulate ``reduction_length`` terms in float32 in their own orders, and
    round to ``dtype`` where the other does not ``roundings`` times (the result, and any
    intermediate such as bf16 probabilities before a value product). The float32 part is
    ``ACCUMULATION_ULPS * sqrt(reduction_length)`` float32 roundoffs; each rounding to
    ``dtype`` adds one unit roundoff of it. Used with ``assert_close``: relative to the
    element, and absolute at that fraction of the array's largest magnitude."""
    accumulation = (
        ACCUMULATION_ULPS * math.sqrt(reduction_length) * UNIT_ROUNDOFF[jnp.dtype(jnp.float32)]
    )
    return accumulation + roundings * UNIT_ROUNDOFF[jnp.dtype(dtype)]


def assert_close(actual, expected, tol: float, what: str) -> None:
    """Every element finite (unwritten outputs stay NaN in interpret mode) and within tol,
    relative to the element and to the array's largest magnitude."""
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    expected = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
    assert actual.shape == expected.shape, what
    assert np.isfinite(actual).all(), f"{what}: {np.sum(~np.isfinite(actual))} non-finite"
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * scale, err_msg=what)


def pallas_or_dispatch(
    triton_error: str | None, direct: Callable[..., Any], dispatched: Callable[..., Any]
) -> Callable[..., Any]:
    """The Pallas form a test runs: ``direct`` (a kernel's entry point) where it runs, in
    interpret mode or compiled at shapes Triton lowers (``triton_error``, the kernel's
    ``*_triton_error``, None); else a function of the same arguments that checks ``direct``
    refuses them with that error and returns ``dispatched``'s result (the dispatch, which
    takes the XLA form there)."""
    if INTERPRET or triton_error is None:
        return direct

    def refused_then_dispatched(*args, **kwargs):
        with pytest.raises(ValueError, match=re.escape(triton_error)):
            direct(*args, **kwargs)
        return dispatched(*args, **kwargs)

    return refused_then_dispatched


def launch_compiled(monkeypatch, dispatch_module) -> None:
    """Makes ``dispatch_module``'s launches compiled Triton ones, as on a GPU, for a test
    that traces (never runs) what its dispatch chooses there."""
    compiled = {"interpret": False, "compiler_params": pallas_compiler_params("gpu")}
    monkeypatch.setattr(dispatch_module, "pallas_options", lambda *a, **k: dict(compiled))


def as_one_program(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` traced and compiled as one program on each call, as the engine's steps run the
    kernels: its ``jax.Array`` arguments (at any depth of a pytree) are the program's
    inputs, every other value (numpy arrays, numbers, tiles, tunings) is fixed in it. Run op
    by op instead, each small op of a kernel's wrapper and of its interpreted body compiles
    on its own, which costs a few times the one program's compilation on the CPU."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        leaves, tree = jax.tree.flatten((args, kwargs))
        dynamic = [isinstance(leaf, jax.Array) for leaf in leaves]

        def program(arrays):
            given = iter(arrays)
            full = [next(given) if is_array else leaf for leaf, is_array in zip(leaves, dynamic)]
            inner_args, inner_kwargs = jax.tree.unflatten(tree, full)
            return fn(*inner_args, **inner_kwargs)

        return jax.jit(program)([leaf for leaf, is_array in zip(leaves, dynamic) if is_array])

    return call


def normal(rng, *shape) -> np.ndarray:
    """Fresh float32 standard normals of ``shape``."""
    return rng.standard_normal(shape).astype(np.float32)


def lower_for_cuda(fn, *args) -> str:
    """Lower ``fn`` for an NVIDIA GPU on this machine (Triton IR is built, not compiled)."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def launch_names(eqns) -> list[str]:
    """The kernel names of the ``pallas_call`` equations among ``eqns``."""
    return [
        str(e.params.get("name", e.params.get("name_and_src_info"))).split()[0]
        for e in eqns
        if e.primitive.name == "pallas_call"
    ]


def draw_slots(rng, batch: int, num_slots: int) -> np.ndarray:
    """Distinct real slots, with padding rows (slot 0) at random positions (at least one)."""
    slot = rng.choice(np.arange(1, num_slots + 1), size=batch, replace=False)
    padding = rng.random(batch) < 0.3
    padding[rng.integers(batch)] = True
    return np.where(padding, 0, slot).astype(np.int32)


class TpuInterpret:
    """A Mosaic kernel's ``interpret`` argument for the tests (``params``): off a TPU, TPU
    interpret mode (``pltpu.InterpretParams``: VMEM, DMAs, scalar prefetch and semaphores
    simulated on the CPU, fresh buffers NaN, reads out of bounds raise) recording the grid
    points it runs, so a test can tell the TPU interpreter ran its kernels (the generic
    ``interpret=True`` records none); on a TPU, False: compiled."""

    def __init__(self) -> None:
        from jax.experimental.pallas import tpu as pltpu

        self.grid_points: list[tuple[int, ...]] = []
        recorder = pltpu.InterpretParams(grid_point_recorder=self._record)
        self.params = recorder if TPU_INTERPRET else False

    def _record(self, token, grid_point, core_index):
        del core_index
        self.grid_points.append(tuple(int(i) for i in grid_point))
        return token

    def ran(self, num_points: int) -> bool:
        """Whether the interpreter ran ``num_points`` grid points (compiled: nothing to
        count, True)."""
        return not TPU_INTERPRET or len(self.grid_points) == num_points
