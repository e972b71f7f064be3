"""The host tier's two device programs: gather a block of state slots and KV rows out of the
pools (a store's first half), and scatter a block into them (a load's second half).

A ``TierBlock`` holds ``TRANSFER_SLOTS`` slots of both state pools and ``transfer_rows`` rows
of every KV pool (the draft head's included): one compiled shape each way, in the program
table (``programs.STORE`` / ``programs.LOAD``). Padding lanes of a gather read the null slot
and page (zeros, ignored); those of a scatter point at the drop sentinels, so slot 0 and page
0 are never written. Where the device has a ``pinned_host`` memory, a gather's outputs are
placed there by the program itself, so a store's copy to the host is part of it; on CPU the
block is an ordinary array that numpy reads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import numpy as np

from lazyspec.engine.sharding import ShardingPlan
from lazyspec.engine.steps import Pools
from lazyspec.models.interface import KVPools

HOST_MEMORY = "pinned_host"


@jax.tree_util.register_dataclass
@dataclass
class TierBlock:
    conv: jax.Array  # [L_rec, S, conv_dim, K-1]
    ssm: jax.Array  # [L_rec, S, H, d_a, d_b]
    kv: KVPools  # each [R, n_kv_heads, head_dim]
    mtp_kv: KVPools | None


def gather_tier(pools: Pools, slots: jax.Array, rows: jax.Array) -> TierBlock:
    """Slots ``slots [S]`` and KV rows ``rows [R]`` of every pool (reads only)."""

    def take(kv: KVPools | None) -> KVPools | None:
        return None if kv is None else KVPools([k[rows] for k in kv.k], [v[rows] for v in kv.v])

    return TierBlock(pools.conv[:, slots], pools.ssm[:, slots], take(pools.kv), take(pools.mtp_kv))


def scatter_tier(pools: Pools, slots: jax.Array, rows: jax.Array, block: TierBlock) -> Pools:
    """``pools`` with ``block`` written at ``slots`` / ``rows``; sentinel lanes write nothing."""

    def put(kv: KVPools | None, got: KVPools | None) -> KVPools | None:
        if kv is None:
            return None
        k = [pool.at[rows].set(new, mode="drop") for pool, new in zip(kv.k, got.k)]
        v = [pool.at[rows].set(new, mode="drop") for pool, new in zip(kv.v, got.v)]
        return KVPools(k, v)

    return dataclasses.replace(
        pools,
        conv=pools.conv.at[:, slots].set(block.conv, mode="drop"),
        ssm=pools.ssm.at[:, slots].set(block.ssm, mode="drop"),
        kv=put(pools.kv, block.kv),
        mtp_kv=put(pools.mtp_kv, block.mtp_kv),
    )


def block_spec(pools: Pools, num_slots: int, num_rows: int) -> TierBlock:
    """A block's shapes and dtypes (``ShapeDtypeStruct`` leaves) for pools like ``pools``."""

    def rows_of(leaf) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((num_rows, *leaf.shape[1:]), leaf.dtype)

    def slots_of(leaf) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((leaf.shape[0], num_slots, *leaf.shape[2:]), leaf.dtype)

    def kv(pools_kv: KVPools | None) -> KVPools | None:
        if pools_kv is None:
            return None
        return KVPools([rows_of(k) for k in pools_kv.k], [rows_of(v) for v in pools_kv.v])

    return TierBlock(slots_of(pools.conv), slots_of(pools.ssm), kv(pools.kv), kv(pools.mtp_kv))


def block_shardings(pool_shardings: Pools, memory_kind: str | None = None) -> TierBlock:
    """A block's shardings: its pools' (the slot and row axes are never sharded), in
    ``memory_kind`` (None: the device's own memory)."""
    block = TierBlock(
        pool_shardings.conv, pool_shardings.ssm, pool_shardings.kv, pool_shardings.mtp_kv
    )
    if memory_kind is None:
        return block
    return jax.tree.map(lambda sharding: sharding.with_memory_kind(memory_kind), block)


def host_memory_kind(sharding: ShardingPlan) -> str | None:
    """``pinned_host`` where the mesh's devices have it and are accelerators; None on CPU
    (whose device memory is the host's: numpy reads a block as it is)."""
    device = sharding.mesh.devices.flat[0]
    if device.platform == "cpu":
        return None
    kinds = {memory.kind for memory in device.addressable_memories()}
    return HOST_MEMORY if HOST_MEMORY in kinds else None


def padded_ids(ids: np.ndarray, size: int, pad: int) -> np.ndarray:
    """``ids`` padded with ``pad`` to ``size`` entries, int32."""
    out = np.full(size, pad, np.int32)
    out[: len(ids)] = ids
    return out
