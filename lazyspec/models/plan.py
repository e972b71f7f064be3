"""Weight plans: where each parameter comes from, for loading and random init alike.

A *plan* is a nested dict (lists allowed) shaped like a params tree whose leaves say where
each array comes from: ``TensorSpec``, or any object with the same ``load`` / ``random``
methods and ``dtype`` field (``layers/moe.ExpertStack``). ``load_plan`` and ``init_plan``
turn it into params. Every family describes its weights this way, so loading, random init
and export read one description.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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
    """

    name: str
    shape: tuple[int, ...]
    transpose: bool = False
    reshape: tuple[int, ...] | None = None
    init: str = "normal"
    init_scale: float = 1.0
    dtype: str | None = None

    def _to_param(self, array: np.ndarray) -> np.ndarray:
        if self.transpose:
            array = array.T
        return array.reshape(self.reshape) if self.reshape is not None else array

    def load(self, reader, dtype) -> np.ndarray:
        """Read, check the shape, cast to ``dtype``; clear errors naming the tensor."""
        if self.name not in reader:
            raise MissingTensorError(
                f"checkpoint has no tensor {self.name!r} (expected shape {self.shape})"
            )
        array = reader.get(self.name, dtype=None)
        if tuple(array.shape) != tuple(self.shape):
            raise ValueError(
                f"tensor {self.name!r} has shape {tuple(array.shape)}, expected {self.shape}"
            )
        return self._to_param(np.asarray(array, dtype=dtype))

    def random(self, rng: np.random.Generator, scale: float) -> np.ndarray:
        """A random float32 param of the final shape, per ``init``."""
        shape = self._to_param(np.empty(self.shape, dtype=np.int8)).shape
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
            bound = shape[-1] ** -0.5
            return rng.uniform(-bound, bound, shape).astype(np.float32)
        if self.init == "normal":
            return (scale * self.init_scale * rng.standard_normal(shape)).astype(np.float32)
        raise ValueError(f"unknown init {self.init!r} for tensor {self.name!r}")


def linear_spec(
    name: str, in_features: int, out_features: int, bias: bool = False, init_scale: float = 1.0
) -> Params:
    """Plan of an ``nn.Linear`` stored as ``{name}.weight`` (and ``{name}.bias``, zero-init)."""
    weight = TensorSpec(
        f"{name}.weight", (out_features, in_features), transpose=True, init_scale=init_scale
    )
    if not bias:
        return {"weight": weight}
    return {"weight": weight, "bias": TensorSpec(f"{name}.bias", (out_features,), init="zeros")}


def _is_leaf(node: Any) -> bool:
    return hasattr(node, "load") and hasattr(node, "random")


def _param_dtype(leaf: Any, dtype) -> np.dtype:
    """The leaf's own dtype when it keeps one, else the model's."""
    return jnp.dtype(leaf.dtype if leaf.dtype is not None else dtype)


def load_plan(plan: Params, reader, dtype) -> Params:
    """Params read tensor by tensor from ``reader`` (a ``SafetensorsReader``), cast to dtype
    (or to a leaf's own dtype)."""
    return jax.tree.map(
        lambda s: jnp.asarray(s.load(reader, _param_dtype(s, dtype))), plan, is_leaf=_is_leaf
    )


def init_plan(plan: Params, key: jax.Array, dtype, scale: float = 0.02) -> Params:
    """Random params for ``plan`` in ``dtype`` (or a leaf's own dtype), deterministic in ``key``.

    Drawn on the host with numpy (one generator per leaf, seeded from ``key`` and the
    leaf's index): compiling a random program per leaf shape would cost far more.
    """
    leaves, treedef = jax.tree.flatten(plan, is_leaf=_is_leaf)
    root = np.random.SeedSequence(np.asarray(jax.random.key_data(key)).ravel().tolist())
    rngs = [np.random.default_rng(seq) for seq in root.spawn(len(leaves))]
    arrays = [
        jnp.asarray(s.random(rng, scale), _param_dtype(s, dtype)) for s, rng in zip(leaves, rngs)
    ]
    return jax.tree.unflatten(treedef, arrays)
