"""The bytes-floor accounting and the profile categories of lazyspec.bench.floor."""

import gzip
import json
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from lazyspec.bench.floor import (
    category,
    device_breakdown,
    device_ops,
    device_spans,
    expected_routed_experts,
    op_scopes,
    step_floor_bytes,
    touched_weight_bytes,
)


def test_expected_routed_experts_matches_a_simulation():
    rng = np.random.default_rng(0)
    for experts, top_k, tokens in [(64, 10, 1), (64, 10, 16), (256, 8, 64), (8, 2, 3)]:
        counts = [
            len({e for _ in range(tokens) for e in rng.choice(experts, top_k, replace=False)})
            for _ in range(400)
        ]
        assert expected_routed_experts(experts, top_k, tokens) == pytest.approx(
            np.mean(counts), rel=0.03
        )
    assert expected_routed_experts(64, 10, 0) == 0.0
    assert expected_routed_experts(64, 10, 1) == pytest.approx(10.0)


def _params(tied: bool):
    leaf = lambda *shape: jax.ShapeDtypeStruct(shape, np.float32)  # noqa: E731
    params = {
        "embed_tokens": leaf(100, 8),
        "layers": [
            {
                "mlp": {
                    "experts": {"gate_proj": leaf(4, 8, 2), "down_proj": leaf(4, 2, 8)},
                    "shared_expert": {"up_proj": {"weight": leaf(8, 2)}},
                }
            },
            {"mixer": {"experts_up": leaf(4, 8, 3), "in_proj": {"weight": leaf(8, 16)}}},
        ],
    }
    if not tied:
        params["lm_head"] = {"weight": leaf(8, 100)}
    return params


def test_touched_weights_count_routed_experts_and_embedding_rows():
    experts = 4 * (8 * 2 + 2 * 8 + 8 * 3) * 4  # every expert stack, in bytes
    others = (8 * 2 + 8 * 16) * 4
    routed = expected_routed_experts(4, 2, 3) / 4
    untied = touched_weight_bytes(_params(tied=False), 4, 2, 3)
    assert untied == pytest.approx(experts * routed + others + 3 * 8 * 4 + 8 * 100 * 4)
    # a tied embedding is the head: the whole table is read
    tied = touched_weight_bytes(_params(tied=True), 4, 2, 3)
    assert tied == pytest.approx(experts * routed + others + 100 * 8 * 4)
    # without experts in the config every leaf counts whole
    dense = touched_weight_bytes(_params(tied=False), 0, 0, 3)
    assert dense == pytest.approx(experts + others + 3 * 8 * 4 + 8 * 100 * 4)


def test_step_floor_adds_state_and_kv():
    cfg = SimpleNamespace(arch=SimpleNamespace(moe=SimpleNamespace(num_experts=4, top_k=2)))
    floor = step_floor_bytes(
        _params(tied=False),
        cfg,
        rows=3,
        positions=2,
        mean_context=10,
        slot_bytes=1000,
        kv_bytes_per_token=64,
        mtp_kv_bytes_per_token=16,
    )
    assert floor.weights == pytest.approx(touched_weight_bytes(_params(tied=False), 4, 2, 6))
    assert floor.state == 2 * 3 * 1000
    assert floor.kv == 3 * (10 + 2) * (64 + 16)
    assert floor.total == pytest.approx(floor.weights + floor.state + floor.kv)


def test_categories_follow_scopes():
    assert category("jit(decode_step)/target_verify/layer_3/attention/dot_general") == "attention"
    assert category("jit(decode_step)/draft_extend/mtp_layer/moe/ragged_dot") == "draft"
    assert category("jit(decode_step)/target_verify/layer_0/moe/mlp/dot") == "moe"
    assert category("jit(decode_step)/target_verify/layer_0/add") == "other"
    assert category("") == "other"


def test_profile_breakdown_of_a_jitted_function(tmp_path):
    @jax.jit
    def step(x):
        with jax.named_scope("attention"):
            y = jax.numpy.sin(x) @ x
        with jax.named_scope("moe"):
            return jax.numpy.cos(y) @ y

    x = jax.numpy.ones((128, 128))
    hlo = step.lower(x).compile().as_text()
    scopes = op_scopes(hlo)
    assert {category(s) for s in scopes.values()} >= {"attention", "moe"}
    step(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        for _ in range(3):
            step(x).block_until_ready()
    seconds = device_breakdown(tmp_path, hlo, "step")
    assert seconds.get("attention", 0) > 0 and seconds.get("moe", 0) > 0
    # the same events op by op: each ran once per call, the longest first, same total
    ops = device_ops(tmp_path, hlo, "step")
    assert {r["category"] for r in ops} >= {"attention", "moe"}
    assert all(r["count"] % 3 == 0 for r in ops)
    assert [r["s"] for r in ops] == sorted((r["s"] for r in ops), reverse=True)
    assert sum(r["s"] for r in ops) == pytest.approx(sum(seconds.values()))
    spans = device_spans(tmp_path, "step", 3)
    assert len(spans) == 3 and all(s["span"] > 0 and s["busy"] > 0 for s in spans)
    assert sum(s["busy"] for s in spans) == pytest.approx(sum(seconds.values()))


def _write_trace(folder, events):
    """A perfetto trace as ``jax.profiler.trace`` leaves it: one GPU stream, one host thread."""
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
    ]
    path = folder / "plugins" / "profile" / "run" / "perfetto_trace.json.gz"
    path.parent.mkdir(parents=True)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": meta + events}, f)


def _op(ts, dur, op="fusion", module="jit_decode_step", pid=1):
    args = {"hlo_module": module, "hlo_op": op}
    return {"ph": "X", "pid": pid, "ts": ts, "dur": dur, "name": op, "args": args}


def test_device_spans_cut_the_calls_and_keep_the_gaps(tmp_path):
    events = [
        _op(0, 20),  # call 1: 0-20, 12-15 (threads of a CPU overlap): span 20 us, busy 23
        _op(12, 3),
        _op(100, 10),  # call 2: 100-110, 115-130: span 30 us, busy 25 (the file's order differs)
        _op(5, 1, pid=2),  # the launch on a host thread: not device time
        _op(50, 30, module="jit_other"),  # another program between the calls
        _op(115, 15),
    ]
    _write_trace(tmp_path, [events[2], events[0], events[5], events[3], events[4], events[1]])
    spans = device_spans(tmp_path, "decode_step", 2)
    assert [s["span"] for s in spans] == pytest.approx([20e-6, 30e-6])
    assert [s["busy"] for s in spans] == pytest.approx([23e-6, 25e-6])
    with pytest.raises(ValueError, match="are not 3 calls"):
        device_spans(tmp_path, "decode_step", 3)


def test_device_spans_cut_calls_of_uneven_length_where_their_first_op_starts(tmp_path):
    """A conditional runs other ops in some calls: the calls are cut where the run's first
    op starts again, not into equal runs (7 ops in 3 calls would not divide)."""
    events = [
        _op(0, 5, op="copy"),  # call 1: 0-25, three ops
        _op(6, 4),
        _op(12, 13, op="select"),
        _op(100, 5, op="copy"),  # call 2: 100-112, two ops (the branch not taken)
        _op(106, 6),
        _op(200, 5, op="copy"),  # call 3: 200-230, two ops
        _op(210, 20, op="select"),
    ]
    _write_trace(tmp_path, events[::-1])
    spans = device_spans(tmp_path, "decode_step", 3)
    assert [s["span"] for s in spans] == pytest.approx([25e-6, 12e-6, 30e-6])
    assert [s["busy"] for s in spans] == pytest.approx([22e-6, 11e-6, 25e-6])
