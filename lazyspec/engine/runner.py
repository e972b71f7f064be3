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


# The config, the family and the static settings are static arguments hashed by value, so
# every runner of an equal model and equal settings shares one compilation per shape.
_extend_jit = jax.jit(extend_step, static_argnums=(0, 1, 2), donate_argnums=(4,))
_decode_jit = jax.jit(decode_step, static_argnums=(0, 1, 2), donate_argnums=(4,))


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
        self._extend = functools.partial(_extend_jit, self.family, self.cfg, static)
        self._decode = functools.partial(_decode_jit, self.family, self.cfg, static)

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

    @staticmethod
    def num_compiled() -> int:
        """Programs the jitted steps hold, for every runner of this process (runners of equal
        configs and settings share theirs)."""
        return _extend_jit._cache_size() + _decode_jit._cache_size()

    def read_slot(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copy of one slot's (conv, ssm) state, for tests and debugging."""
        return np.asarray(self.pools.conv[:, slot]), np.asarray(self.pools.ssm[:, slot])
