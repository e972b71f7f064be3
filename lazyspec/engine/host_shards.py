"""One host pool of the host tier, kept shard by shard as its device pool is sharded.

Under tensor parallelism a state or KV pool is split over the mesh by heads (or replicated,
KV heads fewer than devices); its slot or row axis, the *id axis*, is never split. A
``HostShards`` holds one numpy array per distinct shard of the device pool's sharding, over
the host's ids: a store lands each device's shard of a gathered block in that shard's host
array (replicas once), and a load hands each device its own shard's rows
(``jax.make_array_from_callback``), so a copy never assembles or slices whole arrays on the
host. At tp = 1 there is one shard, the whole pool.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Sharding

# a shard's place in the whole pool: (start, stop) per axis, None for a whole axis
ShardKey = tuple[tuple[int | None, int | None], ...]


def _key(index: tuple[slice, ...]) -> ShardKey:
    return tuple((part.start, part.stop) for part in index)


class HostShards:
    def __init__(self, spec: jax.ShapeDtypeStruct, sharding: Sharding, id_axis: int) -> None:
        """Zeros of ``spec``'s shape and dtype (the id axis as long as the host's ids),
        held per shard of ``sharding``."""
        self.shape, self.dtype = tuple(spec.shape), np.dtype(spec.dtype)
        self.sharding, self.id_axis = sharding, id_axis
        self.shards: dict[ShardKey, np.ndarray] = {}
        for index in sharding.devices_indices_map(self.shape).values():
            key = _key(index)
            assert key[id_axis] == (None, None), f"id axis {id_axis} sharded: {index}"
            if key not in self.shards:
                shard_shape = [len(range(*part.indices(n))) for part, n in zip(index, self.shape)]
                self.shards[key] = np.zeros(shard_shape, self.dtype)

    @property
    def nbytes(self) -> int:
        """Host bytes held (a replicated shard once)."""
        return sum(shard.nbytes for shard in self.shards.values())

    @property
    def bytes_per_id(self) -> int:
        """Bytes of one id (slot or row) of the whole pool."""
        return self.dtype.itemsize * int(np.prod(self.shape)) // self.shape[self.id_axis]

    def _at(self, ids) -> tuple:
        return (slice(None),) * self.id_axis + (ids,)

    def write(self, ids: np.ndarray, block: jax.Array) -> None:
        """Mutates: host ``ids`` take the first ``len(ids)`` ids of ``block`` (a gathered
        block sharded as this pool; waits for it), shard by shard."""
        head = self._at(slice(0, len(ids)))
        for shard in block.addressable_shards:
            if shard.replica_id == 0:
                self.shards[_key(shard.index)][self._at(ids)] = np.asarray(shard.data)[head]

    def read(self, ids: np.ndarray) -> jax.Array:
        """Host ``ids`` as a device array sharded as this pool: each device gets its
        shard's rows (reads only)."""
        shape = list(self.shape)
        shape[self.id_axis] = len(ids)
        return jax.make_array_from_callback(
            tuple(shape), self.sharding, lambda index: self.shards[_key(index)][self._at(ids)]
        )

    def gather(self, ids: np.ndarray) -> np.ndarray:
        """Host ``ids`` of the whole pool, the shards put together (for checks; reads only)."""
        shape = list(self.shape)
        shape[self.id_axis] = len(ids)
        out = np.empty(shape, self.dtype)
        for key, shard in self.shards.items():
            out[tuple(slice(*part) for part in key)] = shard[self._at(ids)]
        return out
