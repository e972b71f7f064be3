"""The host tier on the engine's side: the host pools and the copies the tree queues.

``HostCache`` holds the host pools (a ``TierBlock`` of ``HostShards``: numpy arrays per shard
of the device pools' sharding, whose slot and row axes are the host ids; slot 0 and page 0
stay zeros) and runs the tree's ``Transfer`` records (``HostTier.take``) in their order,
before the next step's launch:

* a store dispatches the gather of its device slots and rows (``Runner.store_block``) and
  keeps the block; its host write *lands* at ``complete``, after the next step's results are
  read back (by then the gather has run), so a store never waits for the device;
* a load puts its host ids on the devices, each device its shard (a copy, at once), and
  dispatches the scatter into its fresh device ids (``Runner.load_block``); a load of host
  ids whose store has not landed lands every pending store first (it waits for the device,
  rarely: a node evicted and matched again between two steps).

Both are ordered by JAX's dispatch order against the steps: a store reads the pools every
launched step wrote, a load writes before every later step reads. The bytes moved and the
host seconds spent issuing and landing them are counted for server info.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import jax
import numpy as np

from lazyspec.cache.allocators import KVAllocator, SlotAllocator
from lazyspec.cache.host_tier import STORE, HostTier, Transfer
from lazyspec.engine.host_shards import HostShards
from lazyspec.engine.tier_programs import TierBlock, block_shardings, block_spec, padded_ids
from lazyspec.models.interface import KVPools
from lazyspec.scheduler.layout import TRANSFER_SLOTS


@dataclass
class CopyStats:
    stored_bytes: int = 0
    loaded_bytes: int = 0
    store_seconds: float = 0.0  # host time issuing stores and landing them
    load_seconds: float = 0.0  # host time issuing loads (waits for pending stores included)


@dataclass(frozen=True)
class _PendingStore:
    block: TierBlock  # dispatched gather (device or pinned host arrays)
    host_slots: np.ndarray  # where its first len() slots land
    host_rows: np.ndarray  # where its first len() rows land


def kv_leaves(block: TierBlock) -> list:
    """The KV arrays of ``block`` in a fixed order (the draft head's last)."""
    leaves = [*block.kv.k, *block.kv.v]
    return leaves + ([*block.mtp_kv.k, *block.mtp_kv.v] if block.mtp_kv is not None else [])


class HostCache:
    def __init__(self, runner, tier: HostTier) -> None:
        self.runner, self.tier = runner, tier
        self.page_size = tier.kv.page_size
        self.num_slots, self.num_rows = TRANSFER_SLOTS, runner.layout.transfer_rows
        host_rows = (tier.kv.num_pages + 1) * self.page_size
        self.pools = host_pools(
            block_spec(runner.abstract, tier.slots.num_slots + 1, host_rows),
            block_shardings(runner.pool_shardings),
        )
        self.slot_bytes = sum(pool.bytes_per_id for pool in (self.pools.conv, self.pools.ssm))
        self.row_bytes = sum(pool.bytes_per_id for pool in kv_leaves(self.pools))
        self.stats = CopyStats()
        self._issued: list[Transfer] = []
        self._pending: list[_PendingStore] = []

    @property
    def host_bytes(self) -> int:
        pools = self.pools
        return sum(pool.nbytes for pool in (pools.conv, pools.ssm, *kv_leaves(pools)))

    # ------------------------------------------------------------------ copies

    def issue(self) -> None:
        """Mutates: run the tree's queued copies on the device, in their order; call before
        every launch (and before a flush)."""
        transfers = self.tier.take()
        start = 0
        for end in range(1, len(transfers) + 1):
            if end == len(transfers) or transfers[end].kind != transfers[start].kind:
                self._run(transfers[start:end])
                start = end
        self._issued += transfers

    def complete(self) -> None:
        """Mutates: land every pending store in the host pools and report the issued copies
        done to the tree (their nodes are no longer busy)."""
        self._land()
        issued, self._issued = self._issued, []
        self.tier.complete(issued)

    def _run(self, transfers: list[Transfer]) -> None:
        """Copies of one kind, merged and cut into calls of the programs' sizes."""
        with_state = [t for t in transfers if t.device_slot]
        device_slots = np.array([t.device_slot for t in with_state], np.int64)
        host_slots = np.array([t.host_slot for t in with_state], np.int64)
        device_rows = self._rows([t.device_pages for t in transfers])
        host_rows = self._rows([t.host_pages for t in transfers])
        slots, rows = self.num_slots, self.num_rows
        calls = max(-(-len(device_slots) // slots), -(-len(device_rows) // rows))
        copy = self._store if transfers[0].kind == STORE else self._load
        began = time.perf_counter()
        for i in range(calls):
            at_slots, at_rows = slice(i * slots, (i + 1) * slots), slice(i * rows, (i + 1) * rows)
            copy(
                device_slots[at_slots],
                host_slots[at_slots],
                device_rows[at_rows],
                host_rows[at_rows],
            )
        moved = len(device_slots) * self.slot_bytes + len(device_rows) * self.row_bytes
        seconds = time.perf_counter() - began
        if transfers[0].kind == STORE:
            self.stats.stored_bytes += moved
            self.stats.store_seconds += seconds
        else:
            self.stats.loaded_bytes += moved
            self.stats.load_seconds += seconds

    def _rows(self, pages: list[np.ndarray]) -> np.ndarray:
        ids = np.concatenate([np.zeros(0, np.int64), *pages])
        return (ids[:, None] * self.page_size + np.arange(self.page_size)).reshape(-1)

    def _store(self, device_slots, host_slots, device_rows, host_rows) -> None:
        block = self.runner.store_block(
            padded_ids(device_slots, self.num_slots, 0), padded_ids(device_rows, self.num_rows, 0)
        )
        self._pending.append(_PendingStore(block, host_slots, host_rows))

    def _load(self, device_slots, host_slots, device_rows, host_rows) -> None:
        if any(
            np.isin(host_slots, p.host_slots).any() or np.isin(host_rows, p.host_rows).any()
            for p in self._pending
        ):
            self._land()
        at_slots = padded_ids(host_slots, self.num_slots, 0)  # host slot 0 holds zeros
        at_rows = padded_ids(host_rows, self.num_rows, 0)
        pools = self.pools

        def rows_of(kv: KVPools | None) -> KVPools | None:
            if kv is None:
                return None
            return KVPools([k.read(at_rows) for k in kv.k], [v.read(at_rows) for v in kv.v])

        conv, ssm = pools.conv.read(at_slots), pools.ssm.read(at_slots)
        block = TierBlock(conv, ssm, rows_of(pools.kv), rows_of(pools.mtp_kv))
        layout = self.runner.layout
        self.runner.load_block(
            padded_ids(device_slots, self.num_slots, layout.sentinel_slot),
            padded_ids(device_rows, self.num_rows, layout.sentinel_kv_row),
            block,
        )

    def _land(self) -> None:
        began = time.perf_counter()
        for pending in self._pending:
            self.pools.conv.write(pending.host_slots, pending.block.conv)
            self.pools.ssm.write(pending.host_slots, pending.block.ssm)
            for pool, new in zip(kv_leaves(self.pools), kv_leaves(pending.block)):
                pool.write(pending.host_rows, new)
        self._pending = []
        self.stats.store_seconds += time.perf_counter() - began

    # ------------------------------------------------------------------ reports

    def info(self) -> dict:
        """The host tier's counts for server info (``hicache_*``); reads only."""
        tier = self.tier
        counts = {f"hicache_{k}": v for k, v in asdict(tier.stats).items()}
        counts.update({f"hicache_{k}": v for k, v in asdict(self.stats).items()})
        counts["hicache_free_state_slots"] = tier.slots.num_free
        counts["hicache_free_kv_tokens"] = tier.kv.num_free_tokens
        return counts

    def memory_plan(self) -> dict:
        """The host tier's part of the start-up report."""
        tier = self.tier
        return {
            "hicache_write_policy": tier.write_policy,
            "host_state_slots": tier.slots.num_slots,
            "host_kv_tokens": tier.kv.num_pages * self.page_size,
            "host_bytes": self.host_bytes,
        }


def host_pools(spec: TierBlock, shardings: TierBlock) -> TierBlock:
    """Host pools of ``spec``'s shapes (the host's ids), one ``HostShards`` a pool, kept
    per shard of ``shardings`` (the device pools')."""

    def rows_of(kv_spec: KVPools | None, kv_shardings: KVPools | None) -> KVPools | None:
        return jax.tree.map(lambda leaf, where: HostShards(leaf, where, 0), kv_spec, kv_shardings)

    return TierBlock(
        HostShards(spec.conv, shardings.conv, 1),
        HostShards(spec.ssm, shardings.ssm, 1),
        rows_of(spec.kv, shardings.kv),
        rows_of(spec.mtp_kv, shardings.mtp_kv),
    )


def build_host_tier(config, layout, runner) -> HostTier | None:
    """The radix cache's host tier for ``config`` (None when off), its pools sized by
    ``hicache_ratio`` or ``hicache_size`` against the device pools' bytes."""
    if not layout.host_tier:
        return None
    token_bytes = sum(  # the draft head's KV included
        pool.dtype.itemsize * int(np.prod(pool.shape[1:]))
        for pool in kv_leaves(block_spec(runner.abstract, 1, 1))
    )
    slots, pages = layout.host_pools(
        config.hicache_ratio, config.hicache_size, runner.slot_bytes(), token_bytes
    )
    kv = KVAllocator(pages, layout.page_size)
    return HostTier(kv, SlotAllocator(slots), config.hicache_write_policy)
