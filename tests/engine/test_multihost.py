"""Tensor parallelism over two processes (``jax.distributed`` on 127.0.0.1, gloo).

tp = 4 over two CPU processes of two devices each serves the tokens and cached tokens of a
one-process tp = 1 run (Qwen3-Next with NEXTN speculation, extra_buffer_lazy, the radix
cache, two two-turn conversations, a prompt long enough to send a request-table chunk, and
requests with penalties and a regex);
process 1 makes every device call process 0 makes and compiles the same programs; a
safetensors folder and dummy weights load block for block as in one process. Plus the
flags' checks.

The runs are subprocesses (``multihost_worker.py``) with timeouts, so a hang fails the test.
Every run compiles with XLA's CPU backend optimisations off (the same flags in all three):
compilation is most of their time.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from lazyspec.config import EngineConfig
from lazyspec.engine.sharding import make_mesh
from lazyspec.testing.serve_process import free_port
from tests.engine.device_runs import ROOT, cpu_devices_env, last_json_line, run_on_cpu_devices

TIMEOUT_S = 400


def _two_processes() -> list[dict]:
    """Both processes' reports; a failure or a hang (past ``TIMEOUT_S``) fails the test."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.engine.multihost_worker", port, str(rank)],
            cwd=ROOT,
            env=cpu_devices_env(2),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = []
    try:
        for rank, proc in enumerate(procs):
            try:
                stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"process {rank} of the two-process run hung past {TIMEOUT_S} s")
            assert proc.returncode == 0, f"process {rank}: {stderr[-4000:]}"
            outputs.append(last_json_line(stdout))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return outputs


@pytest.fixture(scope="module")
def reports() -> dict:
    leader, follower = _two_processes()
    reference = run_on_cpu_devices(
        ["-m", "tests.engine.multihost_worker", "reference"], 4, TIMEOUT_S
    )
    return {"leader": leader, "follower": follower, "reference": reference}


pytestmark = pytest.mark.slow


def test_two_processes_serve_the_tokens_and_cached_tokens_of_one(reports):
    served = reports["leader"]["serve"]
    base = reports["reference"]["serve"]["outputs"]
    *turns, (_, _, num_table_chunks) = base
    assert num_table_chunks > 0  # the long prompt's table updates went as a chunk too
    assert any(cached > 0 for _, cached in turns)  # turn 2 hits the radix cache
    assert len({tuple(ids) for ids, *_ in base}) == len(base)  # outputs differ per request
    assert served["mesh_processes"] == [0, 1]  # the mesh really spans both processes
    assert served["outputs"] == base


def test_penalties_and_grammars_run_across_processes(reports):
    """Token-count seeds and grammar masks reach every process: the outputs equal one
    process's, the penalties change the plain output, and the regex output matches."""
    from lazyspec.testing.char_tokenizer import char_tokenizer
    from tests.engine.multihost_worker import REGEX

    served, base = reports["leader"]["serve"]["extras"], reports["reference"]["serve"]["extras"]
    assert served == base
    assert served["penalties"] != served["plain"]
    assert served["regex"][-1] == 2  # ended by the grammar's stop token
    assert re.fullmatch(REGEX, char_tokenizer().decode(served["regex"][:-1]))


def test_process_1_makes_every_call_of_process_0(reports):
    leader, follower = reports["leader"]["serve"], reports["follower"]["serve"]
    assert leader["num_sent"] > 0
    assert follower["num_calls"] == leader["num_sent"]
    assert follower["num_compiled"] == leader["num_compiled"]  # one compile sequence
    assert leader["num_compiled_warm"] > 0  # warm-up ran through the broadcast


def test_checkpoint_blocks_load_onto_a_mesh_of_two_processes(reports):
    loads = [reports[name]["loading"] for name in ("leader", "follower", "reference")]
    assert [load["errors"] for load in loads] == [[], [], []]
    # each process reads the blocks of its two devices: half of one process's four
    assert loads[0]["num_blocks"] == loads[1]["num_blocks"] > 0
    assert loads[0]["num_blocks"] + loads[1]["num_blocks"] == loads[2]["num_blocks"]


def test_dummy_weights_draw_the_blocks_of_one_process(reports):
    ours = reports["leader"]["loading"]["dummy"]
    theirs = reports["follower"]["loading"]["dummy"]
    shared = ours.keys() & theirs.keys()  # replicated blocks, held by both
    assert shared and all(ours[key] == theirs[key] for key in shared)
    assert {**ours, **theirs} == reports["reference"]["loading"]["dummy"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(nnodes=0), "nnodes=0 must be a positive integer"),
        (dict(nnodes=2, node_rank=2, tp_size=2), r"node_rank=2 must be in \[0, nnodes=2\)"),
        (dict(node_rank=-1), r"node_rank=-1 must be in \[0, nnodes=1\)"),
        (
            dict(nnodes=2, tp_size=3, dist_init_addr="h:1"),
            "tp_size=3 is not a multiple of nnodes=2",
        ),
        (dict(nnodes=2, tp_size=2), "dist_init_addr=None: nnodes=2 needs the coordinator"),
        (dict(nnodes=2, tp_size=2, dist_init_addr="h"), "dist_init_addr='h': nnodes=2"),
    ],
)
def test_process_flags_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_a_mesh_of_more_processes_than_jax_runs_is_refused():
    EngineConfig(nnodes=2, node_rank=1, tp_size=4, dist_init_addr="127.0.0.1:1234")
    with pytest.raises(ValueError, match="nnodes=2, but jax runs 1 processes"):
        make_mesh(2, nnodes=2)


def test_serve_has_the_process_flags():
    from lazyspec.server.launch import build_parser, engine_kwargs

    args = build_parser().parse_args(
        ["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:5000"]
    )
    kwargs = engine_kwargs(args)
    assert (kwargs["nnodes"], kwargs["node_rank"], kwargs["dist_init_addr"]) == (
        2,
        1,
        "10.0.0.1:5000",
    )
