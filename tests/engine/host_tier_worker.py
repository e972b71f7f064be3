"""The host tier at one tensor-parallel size, run in a fresh process on fake CPU devices.

``python -m tests.engine.host_tier_worker TP`` (``XLA_FLAGS`` set as ``device_runs`` does)
serves multi-turn conversations through device pools that cannot keep them and a host pool
that cannot keep them all (``test_host_cache``'s workload, prefill in one chunk size so that
few programs compile), with the integrity checks after every step and the copy oracle on,
flushes (every slot and page of both tiers must then be free, or the process fails), and
prints one JSON line: the turns whose output differs from the cache-free recompute, the
tier's counts, the host pools' shard shapes, and ``HostShards`` round trips over a split
and a replicated sharding.
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from lazyspec.engine.host_shards import HostShards
from lazyspec.engine.sharding import TP_AXIS, make_mesh
from lazyspec.testing.collector import quiet_collector
from lazyspec.testing.tier_oracle import TierCopyOracle
from lazyspec.testing.tiny_models import reference_greedy, small_engine, tiny_model
from tests.engine.test_host_cache import (
    NUM_NEW,
    POOLS,
    _conversations,
    _serve_turns,
    flush_and_check_free,
)

# one extend program (16 tokens, one row); a host pool of 3x the device's still evicts
SETTINGS = dict(
    POOLS,
    chunked_prefill_size=16,
    enable_hierarchical_cache=True,
    hicache_ratio=3.0,
    hicache_write_policy="write_through",
)


def serve(tp: int) -> dict:
    model = tiny_model("qwen3_next")
    engine = small_engine(model, "extra_buffer", tp_size=tp, **SETTINGS)
    copies = TierCopyOracle(engine)
    served = _serve_turns(engine, _conversations(4, seed=5), 2, type(engine).check_integrity)
    wrong = [
        i
        for i, (prompt, out) in enumerate(served)
        if out != reference_greedy(model, prompt, NUM_NEW, pad_len=256)[0]
    ]
    info = engine.get_server_info()
    flush_and_check_free(engine)  # a failed check fails the process
    pools = engine.host_cache.pools
    return {
        "wrong_turns": wrong,
        "num_turns": len(served),
        "counts": {k: info[f"hicache_{k}"] for k in ("num_host_hits", "num_host_evictions")},
        "checked": [copies.num_states_checked, copies.num_rows_checked],
        "ssm_shards": [list(shard.shape) for shard in pools.ssm.shards.values()],
        "ssm_shape": list(pools.ssm.shape),
        "kv_shards": [list(shard.shape) for shard in pools.kv.k[0].shards.values()],
        "kv_shape": list(pools.kv.k[0].shape),
    }


def round_trips(tp: int) -> dict[str, list]:
    """A pool [ids, heads] split by heads and one replicated: a block written at host ids
    reads back on every device as written; [shards held, whether equal]."""
    mesh = make_mesh(tp)
    rng = np.random.default_rng(tp)
    report = {}
    for name, spec in (("split", PartitionSpec(None, TP_AXIS)), ("replicated", PartitionSpec())):
        sharding = NamedSharding(mesh, spec)
        pool = HostShards(jax.ShapeDtypeStruct((9, 2 * tp), np.float32), sharding, 0)
        block = rng.standard_normal((4, 2 * tp)).astype(np.float32)
        ids = np.array([5, 2, 7])
        pool.write(ids, jax.device_put(block, sharding))
        back = pool.read(ids[::-1])
        same = all(
            np.array_equal(np.asarray(shard.data), block[:3][::-1][shard.index])
            for shard in back.addressable_shards
        )
        report[name] = [len(pool.shards), same and np.array_equal(pool.gather(ids), block[:3])]
    return report


if __name__ == "__main__":
    quiet_collector()  # as the suite's own processes (tests/conftest.py)
    tp = int(sys.argv[1])
    print(json.dumps({"serve": serve(tp), "round_trips": round_trips(tp)}))
