"""The Runner owns the parameters and the device pools and launches the jitted steps.

It is the only owner of the pools: each launch passes them (donated) into a step and
replaces the reference with the step's output. ``launch`` dispatches asynchronously and
returns device arrays; ``fetch`` blocks on one step's small outputs only.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lazyspec.engine.steps import (
    DecodeBatch,
    ExtendBatch,
    Pools,
    StepStatic,
    decode_step,
    extend_step,
)
from lazyspec.models.interface import KVPools
from lazyspec.scheduler.layout import Layout

logger = logging.getLogger(__name__)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@functools.cache
def _compiled_steps(family_key: _ById, static: StepStatic, cfg_key: _CfgKey):
    """Jitted steps shared by every runner with the same model config and static settings."""
    family, cfg = family_key.obj, cfg_key.cfg
    extend = jax.jit(functools.partial(extend_step, family, cfg, static), donate_argnums=(1,))
    decode = jax.jit(functools.partial(decode_step, family, cfg, static), donate_argnums=(1,))
    return extend, decode


class _ById:
    """Hash any object (a family module or namespace) by identity."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ById) and other.obj is self.obj


class _CfgKey:
    """Hash a model config by its repr (its family dataclass may hold lists)."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.key = repr(cfg)

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _CfgKey) and other.key == self.key


def abstract_pools(cfg: Any, layout: Layout, spec: bool, kv_dtype: str, ssm_dtype: str) -> Pools:
    """The pools' shapes and dtypes (``jax.ShapeDtypeStruct`` leaves): the one description
    that allocation and byte accounting read. Slot 0, page 0 and request row 0 are the null
    entries (see ``Layout``)."""
    kv_spec = jax.ShapeDtypeStruct(
        (layout.num_kv_rows, cfg.num_kv_heads, cfg.head_dim), _DTYPES[kv_dtype]
    )

    def kv_pools(num_layers: int) -> KVPools:
        return KVPools(k=[kv_spec] * num_layers, v=[kv_spec] * num_layers)

    num_rec, slots = len(cfg.recurrent_layer_ids), layout.num_slot_rows
    rows = layout.num_req_rows
    return Pools(
        kv=kv_pools(len(cfg.attention_layer_ids)),
        mtp_kv=kv_pools(cfg.num_mtp_layers) if spec else None,
        conv=jax.ShapeDtypeStruct((num_rec, slots, *cfg.conv_state_shape), _DTYPES[kv_dtype]),
        ssm=jax.ShapeDtypeStruct((num_rec, slots, *cfg.ssm_state_shape), _DTYPES[ssm_dtype]),
        seq_len=jax.ShapeDtypeStruct((rows,), jnp.int32),
        last_token=jax.ShapeDtypeStruct((rows,), jnp.int32),
        drafts=jax.ShapeDtypeStruct((rows, layout.num_draft_positions), jnp.int32),
    )


def _nbytes(leaf: jax.ShapeDtypeStruct) -> int:
    return math.prod(leaf.shape) * leaf.dtype.itemsize


def slot_bytes(pools: Pools) -> int:
    """Bytes of one state slot over all recurrent layers (conv + ssm)."""
    return sum(_nbytes(pool) // pool.shape[1] for pool in (pools.conv, pools.ssm))


def kv_bytes_per_token(pools: Pools) -> int:
    """K + V bytes of one token over all attention layers (the draft head's excluded)."""
    return sum(_nbytes(pool) // pool.shape[0] for pool in pools.kv.k + pools.kv.v)


class Runner:
    def __init__(
        self, model: Any, layout: Layout, static: StepStatic, kv_dtype: str, ssm_dtype: str
    ) -> None:
        self.family = model.family
        self.cfg = model.config
        self.params = model.params
        self.static = static
        self.abstract = abstract_pools(self.cfg, layout, static.spec, kv_dtype, ssm_dtype)
        self.pools = jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), self.abstract)
        extend, decode = _compiled_steps(_ById(self.family), static, _CfgKey(self.cfg))
        self._extend, self._decode = extend, decode

    def slot_bytes(self) -> int:
        return slot_bytes(self.abstract)

    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.abstract)

    # ------------------------------------------------------------------ steps

    def launch(self, batch: ExtendBatch | DecodeBatch) -> dict[str, jax.Array]:
        """Dispatch the step for ``batch`` (a host batch, moved to the device as it is);
        returns its outputs as device arrays without waiting for them."""
        step = self._extend if isinstance(batch, ExtendBatch) else self._decode
        outputs, self.pools = step(self.params, self.pools, jax.device_put(batch))
        return outputs

    @staticmethod
    def fetch(outputs: dict[str, jax.Array]) -> dict[str, np.ndarray]:
        return {k: np.asarray(v) for k, v in jax.device_get(outputs).items()}

    def num_compiled(self) -> int:
        return self._extend._cache_size() + self._decode._cache_size()

    def read_slot(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copy of one slot's (conv, ssm) state, for tests and debugging."""
        return np.asarray(self.pools.conv[:, slot]), np.asarray(self.pools.ssm[:, slot])
