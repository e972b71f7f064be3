"""Weight plans: where each parameter comes from, for loading and random init alike.

A *plan* is a nested dict (lists allowed) shaped like a params tree whose leaves say where
each array comes from: ``TensorSpec``, or any object with the same ``load`` / ``random``
methods and ``dtype`` field (``layers/moe.ExpertStack``). ``load_plan`` and ``init_plan``
turn it into params. Every family describes its weights this way, so loading, random init
and export read one description.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

Params = dict[str, Any]

# Mamba2's time-step init: dt log-uniform in this range, stored as its inverse softplus.
DT_INIT_RANGE = (1e-3, 0.1)


class MissingTensorError(KeyError, ValueError):
    """A tensor the plan needs is absent from the checkpoint.

    Both a KeyError (a failed name look-up, like the reader's own) and a ValueError (a
    checkpoint that does not fit the config), so callers may catch either.
    """

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: its name and shape in the file, and how it becomes a param.

    ``transpose`` reverses the axes (linear weights: ``[out, in]`` -> ``[in, out]``);
    ``reshape`` then gives the param's shape. ``dtype`` (e.g. "float32") keeps the param in
    that dtype whatever the model's. ``init`` picks the random initialiser: "normal" (std
    ``init_plan``'s scale times ``init_scale``), "zeros", "ones", "a_log" (log of
    uniform(1, 16)), "dt_bias" (inverse softplus of a dt log-uniform in ``DT_INIT_RANGE``)
    or "fan_in_uniform" (uniform within +-1/sqrt(last axis), PyTorch's conv default).
    ``axes`` names the logical axis of each axis of the param (``engine/sharding.py``
    maps them to mesh axes); None: replicated on every device.
    """

    name: str
    shape: tuple[int, ...]
    transpose: bool = False
    reshape: tuple[int, ...] | None = None
    init: str = "normal"
    init_scale: float = 1.0
    dtype: str | None = None
    axes: tuple[str | None, ...] | None = None

    def _to_param(self, array: np.ndarray) -> np.ndarray:
        if self.transpose:
            array = array.T
        return array.reshape(self.reshape) if self.reshape is not None else array

    @property
    def param_shape(self) -> tuple[int, ...]:
        shape = tuple(reversed(self.shape)) if self.transpose else tuple(self.shape)
        return tuple(self.reshape) if self.reshape is not None else shape

    def _check(self, reader) -> None:
        if self.name not in reader:
            raise MissingTensorError(
                f"checkpoint has no tensor {self.name!r} (expected shape {self.shape})"
            )
        shape = reader.shape(self.name)
        if tuple(shape) != tuple(self.shape):
            raise ValueError(f"tensor {self.name!r} has shape {shape}, expected {self.shape}")

    def load(self, reader, dtype, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """Read, check the shape, cast to ``dtype``; clear errors naming the tensor.

        ``index`` (slices of the param's axes) reads only that block of the param: straight
        from the file where the layout allows (a transpose, a reshape that drops unit axes),
        else by slicing the whole tensor."""
        self._check(reader)
        if index is None:
            return self._to_param(np.asarray(reader.get(self.name, dtype=None), dtype=dtype))
        index = tuple(index)
        if self.reshape is None:
            file_index = index[::-1] if self.transpose else index
            return self._to_param(np.asarray(reader.get_slice(self.name, file_index), dtype))
        if not self.transpose and 1 not in self.reshape:
            if [n for n in self.shape if n != 1] == list(self.reshape):
                blocks = iter(index)
                file_index = tuple(slice(None) if n == 1 else next(blocks) for n in self.shape)
                block = np.asarray(reader.get_slice(self.name, file_index), dtype)
                return block.reshape([n for n in block.shape if n != 1])
        return self.load(reader, dtype)[index]

    def random(
        self, rng: np.random.Generator, scale: float, index: tuple[slice, ...] | None = None
    ) -> np.ndarray:
        """A random float32 param of the final shape, per ``init``; ``index``: only that
        block of it (drawn on its own, so a block's values depend on the blocks' layout)."""
        full = self.param_shape
        shape = full if index is None else _block_shape(full, index)
        if self.init == "zeros":
            return np.zeros(shape, np.float32)
        if self.init == "ones":
            return np.ones(shape, np.float32)
        if self.init == "a_log":
            return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
        if self.init == "dt_bias":
            low, high = np.log(DT_INIT_RANGE)
            dt = np.exp(rng.uniform(low, high, shape))
            return (dt + np.log(-np.expm1(-dt))).astype(np.float32)
        if self.init == "fan_in_uniform":
            bound = full[-1] ** -0.5
            return rng.uniform(-bound, bound, shape).astype(np.float32)
        if self.init == "normal":
            return (scale * self.init_scale * rng.standard_normal(shape)).astype(np.float32)
        raise ValueError(f"unknown init {self.init!r} for tensor {self.name!r}")


def linear_spec(
    name: str,
    in_features: int,
    out_features: int,
    bias: bool = False,
    init_scale: float = 1.0,
    axes: tuple[str | None, str | None] = (None, None),
) -> Params:
    """Plan of an ``nn.Linear`` stored as ``{name}.weight`` (and ``{name}.bias``, zero-init).

    ``axes`` are the logical axes of the param ``[in, out]``; the bias takes the output's.
    """
    weight = TensorSpec(
        f"{name}.weight",
        (out_features, in_features),
        transpose=True,
        init_scale=init_scale,
        axes=axes,
    )
    if not bias:
        return {"weight": weight}
    bias_spec = TensorSpec(f"{name}.bias", (out_features,), init="zeros", axes=axes[1:])
    return {"weight": weight, "bias": bias_spec}


def _is_leaf(node: Any) -> bool:
    return hasattr(node, "load") and hasattr(node, "random")


def _param_dtype(leaf: Any, dtype) -> np.dtype:
    """The leaf's own dtype when it keeps one, else the model's."""
    return jnp.dtype(leaf.dtype if leaf.dtype is not None else dtype)


# Where a param goes: ``place(axes, shape) -> jax.sharding.Sharding`` (e.g.
# ``engine.sharding.ShardingPlan.sharding``), from the leaf's logical axes and its shape.
Placement = Callable[[tuple[str | None, ...], tuple[int, ...]], Any]


def _sharded(leaf: Any, place: Placement, block: Callable[[tuple[slice, ...]], np.ndarray]):
    """The param as a sharded array, each device receiving ``block(its index)`` only."""
    shape = leaf.param_shape
    return jax.make_array_from_callback(shape, place(leaf.axes or (), shape), block)


def load_plan(plan: Params, reader, dtype, place: Placement | None = None) -> Params:
    """Params read tensor by tensor from ``reader`` (a ``SafetensorsReader``), cast to dtype
    (or to a leaf's own dtype). With ``place``, each device reads only its block of each
    tensor straight into its shard."""

    def load(leaf: Any) -> jax.Array:
        leaf_dtype = _param_dtype(leaf, dtype)
        if place is None:
            return jnp.asarray(leaf.load(reader, leaf_dtype))
        return _sharded(leaf, place, lambda index: leaf.load(reader, leaf_dtype, index))

    return jax.tree.map(load, plan, is_leaf=_is_leaf)


def init_plan(
    plan: Params, key: jax.Array, dtype, scale: float = 0.02, place: Placement | None = None
) -> Params:
    """Random params for ``plan`` in ``dtype`` (or a leaf's own dtype), deterministic in ``key``.

    Drawn on the host with numpy (one generator per leaf, seeded from ``key`` and the
    leaf's index): compiling a random program per leaf shape would cost far more. With
    ``place``, each device draws only its block (a generator per leaf and block start), so
    the values depend on the sharding, and no host ever holds a whole sharded param.
    Normal leaves of ``DEVICE_DRAW_MIN_SIZE`` elements or more are drawn on the devices
    instead (``jax.random``, straight into their shardings).
    """
    leaves, treedef = jax.tree.flatten(plan, is_leaf=_is_leaf)
    root = np.random.SeedSequence(np.asarray(jax.random.key_data(key)).ravel().tolist())
    seqs = root.spawn(len(leaves))

    def draw(leaf: Any, seq: np.random.SeedSequence) -> jax.Array:
        leaf_dtype = _param_dtype(leaf, dtype)
        if place is None:
            return jnp.asarray(leaf.random(np.random.default_rng(seq), scale), leaf_dtype)

        def block(index: tuple[slice, ...]) -> np.ndarray:
            starts = [s.indices(n)[0] for s, n in zip(index, leaf.param_shape)]
            rng = np.random.default_rng([*seq.generate_state(4), *starts])
            return np.asarray(leaf.random(rng, scale, index), leaf_dtype)

        return _sharded(leaf, place, block)

    def draw_any(leaf: Any, seq: np.random.SeedSequence) -> jax.Array:
        size = int(np.prod(leaf.param_shape))
        if size < DEVICE_DRAW_MIN_SIZE or getattr(leaf, "init", "normal") != "normal":
            return draw(leaf, seq)
        sharding = place(leaf.axes or (), leaf.param_shape) if place is not None else None
        std = scale * getattr(leaf, "init_scale", 1.0)
        program = _device_normal(leaf.param_shape, _param_dtype(leaf, dtype), sharding)
        return program(jax.random.PRNGKey(int(seq.generate_state(1)[0])), np.float32(std))

    arrays = [draw_any(leaf, seq) for leaf, seq in zip(leaves, seqs)]
    return jax.tree.unflatten(treedef, arrays)


# Normal leaves of at least this many elements are drawn on the devices, each device its
# own shard: host draws of a checkpoint-sized model (tens of billions of values) would take
# many minutes. One program per (shape, dtype, sharding): a model repeats few shapes.
DEVICE_DRAW_MIN_SIZE = 1 << 24


@functools.cache
def _device_normal(shape: tuple[int, ...], dtype: Any, sharding: Any) -> Callable:
    def normal(key: jax.Array, std: jax.Array) -> jax.Array:
        return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    return jax.jit(normal, out_shardings=sharding)


def leaf_axes(plan: Params) -> Params:
    """The plan's tree with each leaf replaced by a ``PartitionSpec`` of its logical axis
    names (empty: replicated), the form flax's logical-partitioning helpers read."""
    return jax.tree.map(lambda s: PartitionSpec(*(s.axes or ())), plan, is_leaf=_is_leaf)


def _block_shape(shape: tuple[int, ...], index: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(len(range(*s.indices(size))) for s, size in zip(index, shape))
