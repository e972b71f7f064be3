"""The Runner owns the parameters and the device pools and launches the jitted steps.

It is the only owner of the pools: each launch passes them (donated) into a step and
replaces the reference with the step's output. ``launch`` dispatches asynchronously and
returns device arrays; ``fetch`` blocks on one step's small outputs only.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lazyspec.engine.sampling import SamplingArrays
from lazyspec.engine.steps import (
    DecodeBatch,
    ExtendBatch,
    Pools,
    StepStatic,
    decode_step,
    extend_step,
)
from lazyspec.models.interface import KVPools

logger = logging.getLogger(__name__)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "seed")


@dataclass(frozen=True)
class PoolSizes:
    num_slots: int
    max_reqs: int
    num_pages: int
    page_size: int
    context_len: int
    num_draft_positions: int  # width of the per-request draft table


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


class Runner:
    def __init__(
        self, model: Any, sizes: PoolSizes, static: StepStatic, kv_dtype: str, ssm_dtype: str
    ) -> None:
        self.family = model.family
        self.cfg = model.config
        self.params = model.params
        self.sizes = sizes
        self.static = static
        self.pools = self._allocate(kv_dtype, ssm_dtype)
        extend, decode = _compiled_steps(_ById(self.family), static, _CfgKey(self.cfg))
        self._extend, self._decode = extend, decode

    # ------------------------------------------------------------------ pools

    def _allocate(self, kv_dtype: str, ssm_dtype: str) -> Pools:
        cfg, sizes = self.cfg, self.sizes
        kv_rows = (sizes.num_pages + 1) * sizes.page_size
        kv_shape = (kv_rows, cfg.num_kv_heads, cfg.head_dim)
        dtype = _DTYPES[kv_dtype]
        num_attn = len(cfg.attention_layer_ids)
        kv = KVPools(
            k=[jnp.zeros(kv_shape, dtype) for _ in range(num_attn)],
            v=[jnp.zeros(kv_shape, dtype) for _ in range(num_attn)],
        )
        mtp_kv = None
        if self.static.spec:
            mtp_kv = KVPools(
                k=[jnp.zeros(kv_shape, dtype) for _ in range(cfg.num_mtp_layers)],
                v=[jnp.zeros(kv_shape, dtype) for _ in range(cfg.num_mtp_layers)],
            )
        num_rec = len(cfg.recurrent_layer_ids)
        conv = jnp.zeros((num_rec, sizes.num_slots + 1, *cfg.conv_state_shape), dtype)
        ssm = jnp.zeros((num_rec, sizes.num_slots + 1, *cfg.ssm_state_shape), _DTYPES[ssm_dtype])
        rows = sizes.max_reqs + 1
        return Pools(
            kv=kv,
            mtp_kv=mtp_kv,
            conv=conv,
            ssm=ssm,
            seq_len=jnp.zeros((rows,), jnp.int32),
            last_token=jnp.zeros((rows,), jnp.int32),
            drafts=jnp.zeros((rows, sizes.num_draft_positions), jnp.int32),
        )

    def slot_bytes(self) -> int:
        """Bytes of one state slot over all recurrent layers (conv + ssm)."""
        per_layer_conv = self.pools.conv[0, 0].size * self.pools.conv.dtype.itemsize
        per_layer_ssm = self.pools.ssm[0, 0].size * self.pools.ssm.dtype.itemsize
        return (per_layer_conv + per_layer_ssm) * self.pools.conv.shape[0]

    def kv_bytes_per_token(self) -> int:
        k0 = self.pools.kv.k[0] if self.pools.kv.k else None
        if k0 is None:
            return 0
        return 2 * len(self.pools.kv.k) * k0[0].size * k0.dtype.itemsize

    # ------------------------------------------------------------------ steps

    def launch(self, kind: str, arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        sampling = SamplingArrays(**{k: jnp.asarray(arrays[k]) for k in _SAMPLING_KEYS})
        fields = {k: jnp.asarray(v) for k, v in arrays.items() if k not in _SAMPLING_KEYS}
        if kind == "extend":
            outputs, self.pools = self._extend(
                self.params, self.pools, ExtendBatch(sampling=sampling, **fields)
            )
        else:
            outputs, self.pools = self._decode(
                self.params, self.pools, DecodeBatch(sampling=sampling, **fields)
            )
        return outputs

    @staticmethod
    def fetch(outputs: dict[str, jax.Array]) -> dict[str, np.ndarray]:
        return {k: np.asarray(v) for k, v in jax.device_get(outputs).items()}

    def num_compiled(self) -> int:
        return self._extend._cache_size() + self._decode._cache_size()

    def read_slot(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copy of one slot's (conv, ssm) state, for tests and debugging."""
        return np.asarray(self.pools.conv[:, slot]), np.asarray(self.pools.ssm[:, slot])
