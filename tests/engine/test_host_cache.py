"""The radix cache's host tier in the engine (engine/host_cache.py): multi-turn
conversations on device pools too small to keep them between turns and a host pool too
small to keep them all, for every checkpoint strategy and with speculation on and off, under
each write policy once. Greedy outputs equal the cache-free recompute token for token; a
loaded checkpoint and KV row equal the stored ones bit for bit (``TierCopyOracle``); the
integrity checks hold after every step; the host evicts; after warm-up (once) serving
compiles nothing, the copy programs included; after a flush every slot and page of both
tiers is free. At tp = 2 the host pools are kept per shard and all of this holds."""

from __future__ import annotations

import numpy as np
import pytest

from lazyspec.testing.compiles import backend_compiles
from lazyspec.testing.tier_oracle import TierCopyOracle
from lazyspec.testing.tiny_models import reference_greedy, small_engine, tiny_model
from tests.engine.device_runs import run_on_cpu_devices

NUM_NEW, TOOL = 5, 12  # tokens a turn generates; a tool output's tokens added after it
# device pools that cannot keep four conversations between their turns, a host pool
# (``hicache_ratio`` of the device's) that holds about three of the first turns' and fewer
# of the later ones
POOLS = dict(max_total_tokens=192, max_mamba_cache_size=6, max_running_requests=1)


def _conversations(num: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 128, size=int(n))] for n in rng.integers(60, 90, num)]


def _serve_turns(engine, prompts: list[list[int]], turns: int, check) -> list[tuple]:
    """Every conversation's turns, one request at a time, the conversations in turn in order
    and in reverse order (the last one served comes back first: some turns hit the device,
    some the host, some neither); each turn's (prompt, outputs)."""
    rng = np.random.default_rng(1)
    served = []
    for turn in range(turns):
        for i in range(len(prompts))[:: 1 if turn % 2 == 0 else -1]:
            prompt = prompts[i]
            req = engine.add_request(
                input_ids=prompt, sampling_params={"max_new_tokens": NUM_NEW, "ignore_eos": True}
            )
            engine.run_until_done([req], check=check)
            served.append((prompt, req.output_ids))
            prompts[i] = prompt + req.output_ids + [int(t) for t in rng.integers(3, 128, TOOL)]
    return served


def flush_and_check_free(engine) -> None:
    """Flush the cache: the integrity checks hold and every slot and page of both tiers is
    free."""
    assert engine.flush_cache()
    engine.check_integrity()
    host = engine.tree.host
    assert engine.slot_allocator.num_free == engine.layout.num_slots
    assert engine.kv_allocator.num_free_pages == engine.layout.num_pages
    assert host.slots.num_free == host.slots.num_slots
    assert host.kv.num_free_pages == host.kv.num_pages


CASES = [
    # strategy, family (qwen3_next has an MTP head), speculation, write policy
    ("no_buffer", "qwen3_next", False, "write_back"),
    ("extra_buffer", "qwen3_next", False, "write_through"),
    ("extra_buffer_lazy", "qwen3_next", False, "write_through_selective"),
    ("extra_buffer", "qwen3_next", True, "write_back"),
    ("extra_buffer_lazy", "qwen3_next", True, "write_through"),
]


@pytest.mark.parametrize("strategy,family,spec,policy", CASES)
def test_multi_turn_with_the_host_tier_equals_the_cache_free_run(strategy, family, spec, policy):
    model = tiny_model(family)
    warmed = policy == "write_through" and not spec  # and serving then compiles nothing
    engine = small_engine(
        model,
        strategy,
        spec=spec,
        enable_hierarchical_cache=True,
        hicache_ratio=1.5,
        hicache_write_policy=policy,
        skip_warmup=not warmed,
        **POOLS,
    )
    copies = TierCopyOracle(engine)
    prompts = _conversations(4, seed=CASES.index((strategy, family, spec, policy)))
    with backend_compiles() as compiled:
        served = _serve_turns(engine, prompts, 3, check=type(engine).check_integrity)
    assert not warmed or not compiled, f"{len(compiled)} programs compiled while serving"
    for i, (prompt, out) in enumerate(served):
        assert out == reference_greedy(model, prompt, NUM_NEW, pad_len=256)[0], f"request {i}"
    info = engine.get_server_info()
    assert info["hicache_num_host_hits"] > 0 and info["hicache_loaded_bytes"] > 0
    if policy != "write_through_selective":  # selective copies only twice-hit nodes
        assert info["hicache_num_host_evictions"] > 0
    assert copies.num_states_checked > 0 and copies.num_rows_checked > 0
    flush_and_check_free(engine)


def test_a_request_aborted_with_its_load_in_flight_leaves_the_loaded_node_cached():
    """A load writes only fresh ids of the tree node it restores, and the program is
    dispatched before any step that follows: a request aborted right after its admission
    (its load and first extend launched, nothing processed) frees its own ids, and the node
    stays cached on both tiers for the next request, whose output is exact."""
    model = tiny_model("qwen3_next")
    engine = small_engine(
        model, "extra_buffer", enable_hierarchical_cache=True, hicache_ratio=1.5, **POOLS
    )
    copies = TierCopyOracle(engine)
    first, *others = _conversations(3, seed=9)
    served = _serve_turns(engine, [first, *others], 1, type(engine).check_integrity)
    returning = first + served[0][1] + [5, 6, 7]
    params = {"max_new_tokens": NUM_NEW, "ignore_eos": True}
    req = engine.add_request(input_ids=returning, sampling_params=params)
    engine.step()  # admitted: the match loaded from the host, the first extend launched
    assert engine.get_server_info()["hicache_num_host_hits"] == 1 and req.cached_tokens
    assert engine.abort(req.rid)
    engine.check_integrity()
    again = engine.add_request(input_ids=returning, sampling_params=params)
    engine.run_until_done([again], check=type(engine).check_integrity)
    assert again.cached_tokens == req.cached_tokens  # the loaded node, now on the device
    assert engine.get_server_info()["hicache_num_host_hits"] == 1
    assert again.output_ids == reference_greedy(model, returning, NUM_NEW, pad_len=256)[0]
    assert copies.num_states_checked == 1
    flush_and_check_free(engine)


@pytest.mark.parametrize("strategy", ["extra_buffer", "extra_buffer_lazy"])
def test_a_request_retracted_with_its_load_in_flight_resumes_exact(strategy):
    """A long request decodes until the pool has exactly the pages a returning
    conversation's admission takes (its prompt past the match, the run-past headroom and
    the host part it loads): the returning request is admitted with a host hit, its load
    and first extend launched, and the next decode step, short of one page, retracts it
    (the fewest outputs) with nothing of it processed. The retraction drops its lock: the
    loaded node stays cached on the device, the request resumes from it without a second
    load, both outputs equal the cache-free recompute, the integrity checks hold after
    every step, and after a flush every slot and page of both tiers is free. (no_buffer
    turns the overlapped loop off: nothing of a request is in flight at the next plan.)"""
    model = tiny_model("qwen3_next")
    settings = dict(POOLS, max_running_requests=2, max_mamba_cache_size=8)
    # estimates of future tokens round to 0: admission takes just the pages it needs
    engine = small_engine(
        model,
        strategy,
        enable_hierarchical_cache=True,
        hicache_ratio=1.5,
        schedule_conservativeness=1e-6,
        **settings,
    )
    check = type(engine).check_integrity
    copies = TierCopyOracle(engine)
    first, *others = _conversations(3, seed=9)
    served = _serve_turns(engine, [first, *others], 1, check)
    returning = first + served[0][1] + [5, 6, 7]
    match = engine.tree.match_prefix(returning[:-1])
    assert match.load_tokens and match.load_state  # on the host only
    need = len(returning) + engine.layout.run_past_headroom - match.prefix_len
    need += match.load_tokens
    params = {"ignore_eos": True}
    # 100 tokens: the pool has the returning request's pages a few decode steps later
    long_prompt = [int(t) for t in np.random.default_rng(4).integers(3, 128, 100)]
    long_req = engine.add_request(
        input_ids=long_prompt, sampling_params=params | {"max_new_tokens": 16}
    )
    cache = engine.scheduler.cache
    while cache.num_available_pages > need and not long_req.finished:  # a page a step
        engine.step()
        check(engine)
    assert cache.num_available_pages == need and long_req.output_ids
    req = engine.add_request(
        input_ids=returning, sampling_params=params | {"max_new_tokens": NUM_NEW}
    )
    engine.step()  # admitted: the match loaded from the host, the first extend launched
    check(engine)
    assert engine.get_server_info()["hicache_num_host_hits"] == 1 and req.cached_tokens
    engine.step()  # the long request's next page: the returning one is retracted
    check(engine)
    assert req.num_retractions == 1 and not req.output_ids and not long_req.num_retractions
    resumed = engine.tree.match_prefix(returning[:-1])
    assert resumed.prefix_len == match.prefix_len and not resumed.needs_load
    engine.run_until_done([long_req, req], check=check)
    assert engine.get_server_info()["hicache_num_host_hits"] == 1
    assert req.output_ids == reference_greedy(model, returning, NUM_NEW, pad_len=256)[0]
    assert long_req.output_ids == reference_greedy(model, long_prompt, 16, pad_len=256)[0]
    assert copies.num_states_checked == 1 and copies.num_rows_checked == match.load_tokens
    flush_and_check_free(engine)


TP = 2


@pytest.mark.slow
def test_host_tier_at_tp_2_keeps_shards_and_equals_the_cache_free_run():
    """At tp = 2 on fake CPU devices (``host_tier_worker``: the device count is fixed when
    jax is first imported) the host pools are kept per shard: a state pool's shards split
    its heads, a KV pool's its KV heads, a replicated pool is held once; with host
    evictions and hits, every turn equals the cache-free recompute, the copy oracle holds
    per device, and after a flush every slot and page of both tiers is free."""
    report = run_on_cpu_devices(["-m", "tests.engine.host_tier_worker", str(TP)], TP, 300)
    served = report["serve"]
    assert served["wrong_turns"] == [] and served["num_turns"] == 8
    assert served["counts"]["num_host_hits"] > 0 and served["counts"]["num_host_evictions"] > 0
    assert min(served["checked"]) > 0
    for pool, heads_axis in (("ssm", 2), ("kv", 1)):
        shape, shards = served[f"{pool}_shape"], served[f"{pool}_shards"]
        split = shape[:heads_axis] + [shape[heads_axis] // TP] + shape[heads_axis + 1 :]
        assert shards == [split] * TP, pool
    assert report["round_trips"] == {"split": [TP, True], "replicated": [1, True]}
