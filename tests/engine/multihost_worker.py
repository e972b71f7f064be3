"""One process of a two-process tensor-parallel run, or the one-process reference run.

``python -m tests.engine.multihost_worker PORT RANK`` joins two processes at 127.0.0.1:PORT
as process RANK (each with ``XLA_FLAGS=--xla_force_host_platform_device_count=2``; tp = 4
over the two), loads a safetensors folder and dummy weights onto the mesh, then serves
``tp_worker.workload`` and a 300-token prompt on tiny Qwen3-Next (NEXTN, extra_buffer_lazy,
radix cache), then a request with penalties and one constrained by a regex (their token-count
seeds and grammar masks are device writes too): process 0 schedules, process 1 follows.
``python -m tests.engine.multihost_worker reference`` (four devices, one process) serves the
same at tp = 1 and loads the same folder and dummy weights at tp = 4. Each prints one JSON
line.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

from lazyspec.config import EngineConfig
from lazyspec.engine import multihost
from lazyspec.engine.engine import Engine
from lazyspec.models import load_model
from lazyspec.testing.char_tokenizer import char_tokenizer
from lazyspec.testing.collector import quiet_collector
from tests.engine import tp_worker
from tests.engine.tp_worker import tiny, workload
from tests.models.tiny_qwen import config_dict, write_checkpoint

TP = 4
NNODES = 2
# the tiny engine of tp_worker's runs; warm-up on, so the followers compile as process 0 does
SETTINGS = dict(tp_worker.SETTINGS, speculative_algorithm="NEXTN", context_length=384)


def write_folder(where: Path) -> Path:
    config = config_dict(
        "moe", num_nextn_predict_layers=1, linear_num_key_heads=4, linear_num_value_heads=8
    )
    write_checkpoint(where, config, seed=1)
    return where


def block_digests(params) -> dict[str, str]:
    """A digest of every block this process holds, keyed by param path and block index."""
    digests = {}
    for path, array in jax.tree.leaves_with_path(params):
        for shard in array.addressable_shards:
            index = [(s.start, s.stop) for s in shard.index]
            key = f"{jax.tree_util.keystr(path)}{index}"
            digests[key] = hashlib.sha1(np.asarray(shard.data).tobytes()).hexdigest()
    return digests


def loading(folder: Path, mesh_kw: dict) -> dict:
    """Blocks read straight from the file onto the mesh that differ from the whole tensor's
    slice (none expected), the number of blocks checked, and the dummy weights' digests."""
    whole = load_model(folder)
    engine = Engine(model_path=str(folder), skip_warmup=True, max_total_tokens=256, **mesh_kw)
    errors, num_blocks = [], 0
    for (path, want), got in zip(
        jax.tree.leaves_with_path(whole.params), jax.tree.leaves(engine.runner.params)
    ):
        for shard in got.addressable_shards:
            num_blocks += 1
            if not np.array_equal(np.asarray(want)[shard.index], np.asarray(shard.data)):
                errors.append(f"{jax.tree_util.keystr(path)}{shard.index}: values differ")
    dummy = load_model(folder, load_format="dummy", place=engine.sharding.sharding)
    return {"errors": errors, "num_blocks": num_blocks, "dummy": block_digests(dummy.params)}


def long_prompt(engine: Engine) -> list:
    """A prompt past the updates a batch carries: its admission sends a table chunk too."""
    chunks = []
    runner_update = engine.runner.update_table
    engine.runner.update_table = lambda updates: (chunks.append(1), runner_update(updates))
    prompt = [int(t) for t in np.random.default_rng(1).integers(3, 128, size=300)]
    params = {"max_new_tokens": 4, "ignore_eos": True}
    result = engine.generate(input_ids=prompt, sampling_params=params)
    engine.check_integrity()
    engine.runner.update_table = runner_update
    return [result["output_ids"], result["meta_info"]["cached_tokens"], len(chunks)]


REGEX = r"[a-f]{2,5}-[0-9]{3}"
PENALTIES = {"repetition_penalty": 1.5, "frequency_penalty": 1.0, "presence_penalty": 0.5}


def sampled_extras(engine: Engine) -> dict:
    """One prompt served plain, with penalties and under ``REGEX``: output ids of each."""
    prompt = [int(t) for t in np.random.default_rng(2).integers(3, 98, size=24)]
    plain = {"max_new_tokens": 16, "ignore_eos": True}
    outputs = {}
    for name, params in (
        ("plain", plain),
        ("penalties", dict(plain, **PENALTIES)),
        ("regex", {"max_new_tokens": 16, "regex": REGEX}),
    ):
        outputs[name] = engine.generate(input_ids=prompt, sampling_params=params)["output_ids"]
    engine.check_integrity()
    return outputs


def serve(mesh_kw: dict, warmup: bool = True) -> dict:
    model = tiny("qwen3_next")
    model.tokenizer = char_tokenizer()
    engine = Engine(model=model, **SETTINGS, skip_warmup=not warmup, **mesh_kw)
    compiled = engine.num_compiled()
    if not engine.config.is_leader:
        num_calls = engine.follow()
        return {"num_calls": num_calls, "num_compiled": engine.num_compiled()}
    outputs = workload(engine) + [long_prompt(engine)]
    extras = sampled_extras(engine)
    engine.shutdown()
    return {
        "outputs": outputs,
        "extras": extras,
        "num_compiled_warm": compiled,
        "num_compiled": engine.num_compiled(),
        "num_sent": engine.broadcast.num_sent if engine.broadcast else 0,
        "mesh_processes": sorted({d.process_index for d in engine.sharding.mesh.devices.flat}),
    }


def two_process(port: int, rank: int) -> dict:
    mesh_kw = dict(tp_size=TP, nnodes=NNODES, node_rank=rank, dist_init_addr=f"127.0.0.1:{port}")
    multihost.initialize(EngineConfig(**mesh_kw))  # before the tiny model touches a device
    with tempfile.TemporaryDirectory() as folder:
        report = {"loading": loading(write_folder(Path(folder)), mesh_kw)}
    report["serve"] = serve(mesh_kw)
    return report


def reference() -> dict:
    with tempfile.TemporaryDirectory() as folder:
        report = {"loading": loading(write_folder(Path(folder)), {"tp_size": TP})}
    # the reference's outputs alone are compared: it compiles only the programs it serves
    report["serve"] = serve({"tp_size": 1}, warmup=False)
    return report


if __name__ == "__main__":
    quiet_collector()  # as the suite's own processes (tests/conftest.py)
    if sys.argv[1] == "reference":
        print(json.dumps(reference()))
    else:
        print(json.dumps(two_process(int(sys.argv[1]), int(sys.argv[2]))))
