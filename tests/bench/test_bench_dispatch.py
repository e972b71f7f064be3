"""``benchmarks/tools/bench_dispatch.py``: its count of XLA's command-buffer updates per timed phase
(read from the log lines XLA writes on a GPU), its reading of a program's command buffers
from XLA's dumped thunk sequence and from the optimized HLO, and a CPU run of the tiny
preset."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from lazyspec.testing.xla_flags import with_fast_compile

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "tools" / "bench_dispatch.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_dispatch", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _update_line(allocs: int) -> str:
    # the shape of XLA's log line (command_buffer_thunk, VLOG 3)
    return (
        "I1203 09:52:30.512244    1664 command_buffer_thunk.cc:336] [0] Create/Update command "
        "buffer by recoding command buffer cmd sequence after 1 executions since last update; "
        f"num_commands=268; updated_allocs={allocs}; is_first_record=false; needs_update=true"
    )


def test_updates_are_counted_per_phase():
    bench = _module()
    log = "\n".join(
        [
            _update_line(7),  # before any phase (compilation, warm-up): not counted
            bench.PHASE + "first",
            "I1203 09:52:30.512496    1664 command_buffer_thunk.cc:362] [0] Updated command "
            "buffer in 239 μs; num_commands=268",
            *[_update_line(10)] * 4,
            _update_line(12),
            bench.PHASE + "second",
            "some other line",
        ]
    )
    counts = bench.count_updates(log, calls=2)  # 2 timed + 3 untimed calls a phase
    assert counts == {"first": (1.0, 10.0), "second": (0.0, 0.0)}


# the shape of a GPU program's optimized HLO after XLA's command-buffer scheduling
_GPU_HLO = """HloModule jit_decode_step, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%fused_add (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  ROOT %add = f32[4]{0} add(f32[4]{0} %p0, f32[4]{0} %p0)
}

%command_buffer (p: f32[4]) -> (f32[4], s32[]) {
  %p = f32[4]{0} parameter(0)
  %fusion = f32[4]{0} fusion(f32[4]{0} %p), kind=kLoop, calls=%fused_add
  %cc.1 = f32[4]{0} custom-call(f32[4]{0} %fusion), custom_call_target="__gpu$xla.gpu.triton"
  %constant.2 = s32[] constant(0)
  ROOT %tuple = (f32[4]{0}, s32[]) tuple(f32[4]{0} %cc.1, s32[] %constant.2)
}

%command_buffer.1 (q: f32[4]) -> f32[4] {
  %q = f32[4]{0} parameter(0)
  ROOT %gemm = f32[4]{0} custom-call(f32[4]{0} %q), custom_call_target="__cublas$gemm"
}

ENTRY %main.9 (Arg_0.1: f32[4]) -> f32[4] {
  %Arg_0.1 = f32[4]{0} parameter(0)
  %call = (f32[4]{0}, s32[]) call(f32[4]{0} %Arg_0.1), to_apply=%command_buffer
  %gte = f32[4]{0} get-tuple-element((f32[4]{0}, s32[]) %call), index=0
  %gte.1 = s32[] get-tuple-element((f32[4]{0}, s32[]) %call), index=1
  %cond = f32[4]{0} conditional(s32[] %gte.1, f32[4]{0} %gte), branch_computations={%fused_add}
  %call.1 = f32[4]{0} call(f32[4]{0} %cond), to_apply=%command_buffer.1
  ROOT %copy = f32[4]{0} copy(f32[4]{0} %call.1)
}
"""


def test_program_layout_reads_command_buffers_and_the_rest():
    """Two command buffers (two commands, then one: parameters, constants and tuples launch
    nothing) and, outside them, the conditional and the copy."""
    layout = _module().program_layout(_GPU_HLO)
    assert layout == {"command_buffers": [2, 1], "outside": {"conditional": 1, "copy": 1}}


# the shape of XLA's dumped thunk sequence (``*thunk_sequence_after_thunk_passes.txt``):
# top-level thunks at the margin, a command buffer's commands indented below it
_THUNKS = """000: kCommandBuffer [source | sink]
    001: kCopy         [source        | next=002 (1)  ] kCopy
    002: kCustomKernel [prev=001 (1)  | next=003 (1)  ] loop_add_fusion grid: [1, 1, 1]
    003: kConditional  [prev=002 (1)  | sink          ]
        004: kCustomKernel [source | sink] branch_fusion grid: [1, 1, 1]
001: kCustomKernel [prev=000 (1) | next=002 (1)] sort_fusion grid: [1, 1, 1]
002: kCommandBuffer [source | sink]
    001: kGemm         [source        | sink          ] custom-call
003: kCopy [prev=002 (1) | sink] kCopy
"""


def test_thunk_layout_reads_command_buffers_and_the_rest():
    """Two command buffers (four commands, one of them nested in a conditional; then one)
    and, outside them, a kernel and a copy."""
    layout = _module().thunk_layout(_THUNKS)
    assert layout == {
        "command_buffers": [4, 1],
        "outside": {"kCustomKernel": 1, "kCopy": 1},
    }


def _run_tiny(*options: str) -> subprocess.CompletedProcess:
    """The script on the tiny preset (xla backend, float32, batch 1) with ``options``; it
    must succeed."""
    env = dict(os.environ, XLA_FLAGS=with_fast_compile(os.environ.get("XLA_FLAGS", "")))
    command = [sys.executable, str(SCRIPT), "--preset", "tiny", "--backends", "xla"]
    command += ["--dtype", "float32", "--batches", "1", *options]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_tiny_preset_runs_on_cpu():
    result = _run_tiny("--calls", "3", "--ref-commands", "4", "--count-updates", "--program-layout")
    rows = [line for line in result.stdout.splitlines() if line.startswith("| tiny xla decode")]
    # one program and two in turn, each idle and chained, in the timing and the update tables
    assert len(rows) == 8
    for copies in (1, 2):
        assert sum(f", {copies} in turn, " in row for row in rows) == 4, rows
    assert "n/a on this backend" in result.stdout
    # a CPU program has no command buffers (nor a thunk sequence dumped): every launch is
    # outside them, read from the optimized HLO
    layout = [line for line in result.stdout.splitlines() if "0 command buffers" in line]
    assert len(layout) == 1 and "outside them: " in layout[0] and " fusion " in layout[0]
    assert "(optimized HLO)" in layout[0]


def test_parent_only_options_are_not_passed_on():
    strip = _module()._parent_only
    argv = ["--batches", "1", "--count-updates", "--xla-flag-sets", "|--a=1", "--calls", "3"]
    assert strip(argv) == ["--batches", "1", "--calls", "3"]
    assert strip(["--xla-flag-sets=|--a=1", "--program-layout"]) == ["--program-layout"]


def test_reference_kinds_and_flag_sets_run_on_cpu():
    """Each set of XLA flags runs the whole measurement in its own child (the set named in
    its heading), with a reference program per kind asked for."""
    result = _run_tiny(
        "--calls",
        "2",
        "--ref-commands",
        "2",
        "--ref-kinds",
        ",".join(_module().REF_KINDS),
        "--xla-flag-sets",
        "|--xla_cpu_enable_fast_math=false",
    )
    out = result.stdout
    headings = [line for line in out.splitlines() if line.startswith("## XLA_FLAGS += ")]
    assert headings == [
        "## XLA_FLAGS += (nothing)",
        "## XLA_FLAGS += --xla_cpu_enable_fast_math=false",
    ]
    flags = [line for line in out.splitlines() if line.startswith("XLA_FLAGS: ")]
    assert len(flags) == 2 and "--xla_cpu_enable_fast_math=false" in flags[1], flags
    assert "--xla_cpu_enable_fast_math=false" not in flags[0]
    for kind in _module().REF_KINDS[1:]:
        rows = [line for line in out.splitlines() if line.startswith(f"| reference {kind} (2")]
        assert len(rows) == 4, (kind, rows)  # in place, idle and chained, in both children
    assert out.count("| tiny xla decode, batch 1, ") == 8


def test_host_event_totals_leave_the_device_out(tmp_path):
    import gzip
    import json

    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
        {"ph": "X", "pid": 1, "name": "cuGraphLaunch", "dur": 500.0},
        {"ph": "X", "pid": 1, "name": "cuGraphLaunch", "dur": 300.0},
        {"ph": "X", "pid": 1, "name": "ParseArguments", "dur": 40.0},
        {"ph": "X", "pid": 2, "name": "gemm_fusion_dot", "dur": 9.0},
        {"ph": "i", "pid": 1, "name": "marker"},
    ]
    folder = tmp_path / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    with gzip.open(folder / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    totals = _module().host_event_totals(tmp_path)
    assert totals == {"cuGraphLaunch": (2, 800.0), "ParseArguments": (1, 40.0)}


def test_host_profile_prints_the_host_events_on_cpu():
    result = _run_tiny("--calls", "4", "--ref-commands", "2", "--host-profile", "5")
    lines = result.stdout.splitlines()
    headings = [i for i, line in enumerate(lines) if line.startswith("host events of 5 calls")]
    assert len(headings) == 2  # two programs in turn, idle then chained
    assert "idle" in lines[headings[0]] and "chained" in lines[headings[1]]
    table = lines[headings[0] + 3 : headings[1]]
    assert any("decode_step" in line and line.startswith("| ") for line in table), table
    assert not any("profiler.py" in line for line in table)


def test_an_unknown_reference_kind_is_refused_before_any_run():
    command = [sys.executable, str(SCRIPT), "--ref-kinds", "fusion,bogus", "--xla-flag-sets", "|"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout[-2000:]
    assert "unknown --ref-kinds ['bogus']" in result.stderr
    assert "XLA_FLAGS" not in result.stdout  # no child process ran


def test_the_decode_phases_hand_the_words_as_the_engine_launch_does(monkeypatch):
    """Each timed decode call goes through ``Runner._input`` with the recorded batch's words,
    as ``Runner.launch`` does (placed first off a CPU), not past it."""
    import types

    from lazyspec.engine.runner import Runner

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # bench_engine
    monkeypatch.setenv("XLA_FLAGS", with_fast_compile(os.environ.get("XLA_FLAGS", "")))
    bench = _module()
    handed = []
    place = Runner._input

    def recording(self, array):
        handed.append(array)
        return place(self, array)

    monkeypatch.setattr(Runner, "_input", recording)
    from bench_engine import build_model

    args = types.SimpleNamespace(
        preset="tiny", dtype="float32", backends="xla", prompt_len=64, context=256, calls=1
    )
    args.program_layout, args.host_profile, args.split = False, 0, False
    rows = bench.decode_rows(build_model("tiny", "float32"), args, 1)
    assert len(rows) == 4  # one program and two in turn, idle and chained
    # the four phases' calls (3 untimed and 1 timed each), the last ones, handed the
    # recorded batch's words (serving handed them once before)
    timed = handed[-4 * (args.calls + 3) :]
    assert all(a is timed[0] for a in timed) and timed[0] is not handed[0], len(handed)
    assert sum(a is timed[0] for a in handed) == len(timed) + 1


def test_split_times_the_placement_and_the_arguments_apart():
    """``--split``: the words' placement alone, a no-op program taking every array the step
    takes (weights, pools, words), and one taking the words alone; each placing the words
    through ``Runner._input`` every call."""
    import types

    import numpy as np

    placed = []

    def place(words):
        placed.append(words)
        return words

    runner = types.SimpleNamespace(
        params={"w": np.ones((4, 4), np.float32), "b": np.zeros(4, np.float32)},
        pools=(np.zeros((2, 3), np.float32),),
        _input=place,
    )
    packed = types.SimpleNamespace(words=np.arange(8, dtype=np.int32))
    rows = _module().split_rows(runner, packed, "fake", calls=2)
    labels = [row["what"] for row in rows]
    assert labels == [
        f"fake: {part}, {mode}"
        for part in (
            "the words' placement alone",
            "a no-op program taking the step's 4 arrays",
            "a no-op program taking the words alone",
        )
        for mode in ("idle", "chained")
    ]
    assert all(row["ms"] >= 0 for row in rows)
    assert len(placed) == 6 * (2 + 3) and all(w is packed.words for w in placed)
