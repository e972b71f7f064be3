"""The host tier's copy oracle: what a load brings back equals what was stored, bit for bit.

``TierCopyOracle(engine)`` wraps the engine's ``HostCache``: when a store is issued it reads
(blocking) the device slots and KV rows it copies; when it lands, the host pools must hold
exactly those bytes; when a load is issued, the device slots and rows it writes must then
hold exactly the bytes stored at its host ids. Integer views compare the bytes, so a NaN or
a negative zero is compared as stored.
"""

from __future__ import annotations

import numpy as np

from lazyspec.engine.host_cache import kv_leaves
from lazyspec.engine.tier_programs import TierBlock


def _bytes(array: np.ndarray) -> np.ndarray:
    array = np.ascontiguousarray(array)
    return array.view(np.uint8).reshape(*array.shape, array.itemsize)


class TierCopyOracle:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.cache = cache = engine.host_cache
        self.stored_slots: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # host slot -> bytes
        self.stored_rows: dict[int, list[np.ndarray]] = {}  # host row -> bytes per KV pool
        self.num_states_checked = 0  # loaded states compared (a test asserts it is not 0)
        self.num_rows_checked = 0
        store, load, land = cache._store, cache._load, cache._land

        def checked_store(device_slots, host_slots, device_rows, host_rows):
            states, rows = self._read_device(device_slots, device_rows)
            for i, slot in enumerate(host_slots.tolist()):
                self.stored_slots[slot] = (states[0][:, i], states[1][:, i])
            for i, row in enumerate(host_rows.tolist()):
                self.stored_rows[row] = [leaf[i] for leaf in rows]
            store(device_slots, host_slots, device_rows, host_rows)

        def checked_land():
            land()
            self._check_host()

        def checked_load(device_slots, host_slots, device_rows, host_rows):
            load(device_slots, host_slots, device_rows, host_rows)
            self._check_loaded(device_slots, host_slots, device_rows, host_rows)

        cache._store, cache._load, cache._land = checked_store, checked_load, checked_land

    def _read_device(self, slots: np.ndarray, rows: np.ndarray):
        pools = self.engine.runner.pools  # read whole (indexing a device array compiles)
        states = tuple(_bytes(np.asarray(pool)[:, slots]) for pool in (pools.conv, pools.ssm))
        block = TierBlock(None, None, pools.kv, pools.mtp_kv)
        return states, [_bytes(np.asarray(leaf)[rows]) for leaf in kv_leaves(block)]

    def _check_host(self) -> None:
        pools = self.cache.pools  # per shard: compared put together
        for slot, (conv, ssm) in self.stored_slots.items():
            if self._host_holds_slot(slot):
                at = np.array([slot])
                assert np.array_equal(_bytes(pools.conv.gather(at)[:, 0]), conv), f"host {slot}"
                assert np.array_equal(_bytes(pools.ssm.gather(at)[:, 0]), ssm), f"host {slot}"

    def _host_holds_slot(self, slot: int) -> bool:
        """Whether ``slot`` is still the copy recorded (not freed and stored again since)."""
        return any(node.host_slot == slot for node in self.engine.tree.iter_nodes())

    def _check_loaded(self, device_slots, host_slots, device_rows, host_rows) -> None:
        states, rows = self._read_device(device_slots, device_rows)
        for i, slot in enumerate(host_slots.tolist()):
            conv, ssm = self.stored_slots[slot]
            assert np.array_equal(states[0][:, i], conv), f"loaded slot {device_slots[i]}"
            assert np.array_equal(states[1][:, i], ssm), f"loaded slot {device_slots[i]}"
            self.num_states_checked += 1
        for i, row in enumerate(host_rows.tolist()):
            for got, want in zip(rows, self.stored_rows[row]):
                assert np.array_equal(got[i], want), f"loaded KV row {device_rows[i]}"
            self.num_rows_checked += 1
