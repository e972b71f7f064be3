"""``scripts/bench_switches.py``: settings in turn with the defaults first every round, the
verdict "shorter in every round", settings refused before any run, and on CPU a real run of
the tiny preset and a failing one (its error kept in the table, exit status 1)."""

from __future__ import annotations

import pytest

TINY = ["--preset", "tiny", "--backends", "xla", "--batches", "1", "--output-len", "4"]
TINY += ["--copy-mib", "4"]


def _row(batch: int, device_ms: float, spec: str = "-") -> dict:
    return {
        "backend": "pallas",
        "batch": batch,
        "spec": spec,
        "device_ms": device_ms,
        "busy_ms": device_ms,
        "kernels": 100,
        "floor_ms": 0.5,
        "pct_device": 50.0,
        "loop_ms": device_ms,
    }


def test_plan_runs_the_defaults_first_every_round(load_script):
    bench = load_script("bench_switches")
    a, b = bench.Setting("a", ("backend.X=1",)), bench.Setting("b", ("backend.Y=0",))
    names = [(r, s.name) for r, s in bench.plan([a, b], 2)]
    assert names == [(1, "defaults"), (1, "a"), (1, "b"), (2, "defaults"), (2, "a"), (2, "b")]


def test_a_setting_is_shorter_only_if_shorter_in_every_round(load_script):
    bench = load_script("bench_switches")
    base, a, b, c = (bench.Setting(n) for n in ("defaults", "a", "b", "c"))
    runs = [
        bench.Run(1, base, 0, [_row(1, 1.000), _row(16, 2.0)]),
        bench.Run(1, a, 0, [_row(1, 0.990), _row(16, 1.9)]),
        bench.Run(1, b, 0, [_row(1, 0.980)]),
        bench.Run(1, c, 0, [_row(1, 0.950)]),
        bench.Run(2, base, 0, [_row(1, 1.010), _row(16, 2.0)]),
        bench.Run(2, a, 0, [_row(1, 1.005), _row(16, 2.1)]),
        bench.Run(2, b, 0, [_row(1, 1.020)]),
        bench.Run(2, c, 1, [], "boom"),  # round 2 failed: no verdict of "shorter"
    ]
    got = bench.compare(runs)
    key1, key16 = ("pallas", 1, "-"), ("pallas", 16, "-")
    assert got[("a", key1)]["shorter"] and not got[("a", key16)]["shorter"]
    assert got[("a", key1)]["deltas"] == pytest.approx({1: -0.010, 2: -0.005})
    assert not got[("b", key1)]["shorter"]  # shorter in round 1 only
    assert not got[("c", key1)]["shorter"] and list(got[("c", key1)]["deltas"]) == [1]
    text = bench.table(runs, "# t")
    assert "| a | pallas, 1, - | -10.0, -5.0 | yes |" in text
    assert "| b | pallas, 1, - | -20.0, +10.0 | no |" in text
    assert "failed (exit status 1): boom" in text


@pytest.mark.parametrize(
    "text, message",
    [
        ("a", "expected NAME="),
        ("=backend.MOE_DOWN_IN_UP_ZERO_UNUSED=1", "expected NAME="),
        ("defaults=backend.MOE_DOWN_IN_UP_ZERO_UNUSED=1", "baseline"),
        ("a=backend.NO_SUCH_SWITCH=1", "not an int or bool constant"),
        ("a=backend.MOE_DOWN_IN_UP_ZERO_UNUSED=yes", "is not an integer"),
    ],
)
def test_a_bad_setting_is_refused_before_any_run(text, message, load_script):
    bench = load_script("bench_switches")
    with pytest.raises(SystemExit, match=message):
        bench.parse_setting(text)


def test_engine_rows_leave_the_peer_out(load_script):
    bench = load_script("bench_switches")
    stdout = "\n".join(
        [
            "code: lazyspec ...",
            "{'preset': 'tiny', 'backend': 'xla', 'batch': 1, 'spec': '-', 'host_ms': {}, "
            "'device_ms': 0.5}",
            "{'preset': 'tiny', 'backend': 'transformers 5', 'batch': 1, 'alone_ms': nan}",
        ]
    )
    assert bench.engine_rows(stdout) == [
        {
            "preset": "tiny",
            "backend": "xla",
            "batch": 1,
            "spec": "-",
            "host_ms": {},
            "device_ms": 0.5,
        }
    ]


def test_the_table_names_the_cards_the_runs_were_lent(load_script):
    """Each run's "device: ..." line (``bench_engine.py``) is kept; the table names every
    card once, in the order met (a call lent two machines shows both)."""
    bench = load_script("bench_switches")
    assert bench.device_of("code: x\ndevice: NVIDIA H200 (gpu), jax 0.11.2\n{}") == (
        "NVIDIA H200 (gpu), jax 0.11.2"
    )
    assert bench.device_of("code: x\n") == ""
    cards = ["NVIDIA H100 80GB HBM3 (gpu), jax 0.11.2", "NVIDIA H200 (gpu), jax 0.11.2"]
    runs = [
        bench.Run(1, bench.Setting(bench.DEFAULTS), 0, [_row(1, 1.0)], device=cards[0]),
        bench.Run(1, bench.Setting("a"), 0, [_row(1, 0.9)], device=cards[1]),
        bench.Run(2, bench.Setting(bench.DEFAULTS), 0, [_row(1, 1.0)], device=cards[0]),
    ]
    text = bench.table(runs, "# head")
    assert f"\nDevice: {cards[0]}; {cards[1]}.\n" in text


def test_runs_on_cpu_and_keeps_a_failed_runs_error(tmp_path, load_script, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    bench = load_script("bench_switches")
    out = tmp_path / "switches.md"
    setting = "apart=backend.MLP_OUTPUT_IN_NEXT_NORM=0"
    argv = ["--rounds", "1", "--setting", setting, "--out", str(out)]
    checked = argv + ["--checks", "residual_norm", "--check-args=--smoke", "--"]
    assert bench.main(checked + TINY + ["--prompt-len", "64"]) == 0
    argv.append("--")
    lines = [line for line in out.read_text().splitlines() if line.startswith("| 1 |")]
    assert [line.split("|")[2].strip() for line in lines] == ["defaults", "apart"]
    assert "\nDevice: cpu (cpu), jax " in out.read_text()  # the card the runs were lent
    assert "backend.MLP_OUTPUT_IN_NEXT_NORM=0" in lines[1]
    cells = [c.strip() for c in lines[1].strip("|").split("|")]
    assert int(cells[5]) > 0 and float(cells[6]) > 0 and cells[9].endswith(" %")
    verdict = [line for line in out.read_text().splitlines() if line.startswith("| apart |")]
    assert len(verdict) == 1 and verdict[0].endswith("| yes |"), verdict  # the check passed
    # a prompt the engine refuses: every run fails, each with its error in the table
    assert bench.main(argv + TINY + ["--prompt-len", "16"]) == 1
    text = out.read_text()
    assert text.count("failed (exit status 1)") == 2 and "must be a multiple of" in text


def test_the_verdict_says_whether_each_settings_check_passed(tmp_path, load_script, monkeypatch):
    """With ``--checks`` every setting's ``check_kernels.py`` runs first with its switches
    and the extra arguments; a failed check is a "no" in the verdict, its output follows
    the table, and the script exits 1 though every run succeeded."""
    bench = load_script("bench_switches")
    calls = []

    def check_one(setting, checks, extra, timeout):
        calls.append((setting.name, setting.switches, checks, extra))
        return (
            bench.Check(1, "| moe | 1 token | FAILED: 3e-1 |")
            if setting.name == "b"
            else bench.Check(0)
        )

    def run_one(round_, setting, bench_args, profile, timeout):
        return bench.Run(round_, setting, 0, [_row(1, 0.9 if setting.name != "defaults" else 1.0)])

    monkeypatch.setattr(bench, "check_one", check_one)
    monkeypatch.setattr(bench, "run_one", run_one)
    out = tmp_path / "t.md"
    argv = ["--setting", "a=backend.MOE_DOWN_IN_UP_ZERO_UNUSED=1", "--out", str(out)]
    argv += ["--setting", "b=backend.MOE_ROUTE_IN_UP_MAX_TOKENS=0"]
    assert bench.main(argv + ["--checks", "moe", "--check-args=--smoke"]) == 1
    text = out.read_text()
    assert calls == [
        ("a", ("backend.MOE_DOWN_IN_UP_ZERO_UNUSED=1",), "moe", ["--smoke"]),
        ("b", ("backend.MOE_ROUTE_IN_UP_MAX_TOKENS=0",), "moe", ["--smoke"]),
    ]
    assert "| a | pallas, 1, - | -100.0, -100.0 | yes | yes |" in text
    assert "| b | pallas, 1, - | -100.0, -100.0 | yes | no |" in text
    assert "check_kernels.py with b (exit status 1): | moe | 1 token | FAILED" in text


def test_a_check_runs_check_kernels_with_the_settings_switches(load_script, monkeypatch):
    bench = load_script("bench_switches")
    seen = []

    def run(command, **kwargs):
        seen.append(command[1:])
        return bench.subprocess.CompletedProcess(command, 1, "| moe | x | FAILED |", "")

    monkeypatch.setattr(bench.subprocess, "run", run)
    setting = bench.Setting("a", ("backend.X=1", "backend.Y=0"))
    got = bench.check_one(setting, "moe,residual_norm", ["--smoke"], 10.0)
    assert got == bench.Check(1, "| moe | x | FAILED |")
    assert seen == [
        [
            str(bench.SCRIPTS / "check_kernels.py"),
            "--checks", "moe,residual_norm", "--smoke",
            "--kernel-switch", "backend.X=1", "--kernel-switch", "backend.Y=0",
        ]
    ]  # fmt: skip


def test_an_xla_flag_item_goes_to_that_settings_xla_flags(load_script, monkeypatch):
    """An item ``--xla_...`` is an XLA flag: the setting's runs and checks get it appended
    to ``XLA_FLAGS``; the defaults' processes inherit the environment as it is."""
    bench = load_script("bench_switches")
    text = "cublas=--xla_gpu_enable_triton_gemm=false,backend.MOE_DOWN_IN_UP_ZERO_UNUSED=1"
    setting = bench.parse_setting(text)
    assert setting.switches == ("backend.MOE_DOWN_IN_UP_ZERO_UNUSED=1",)
    assert setting.xla_flags == ("--xla_gpu_enable_triton_gemm=false",)
    for bad in ("a=--xla_", "a=--xla_gpu_x=1 --xla_gpu_y=2"):
        with pytest.raises(SystemExit, match="is not one XLA flag"):
            bench.parse_setting(bad)
    seen = []

    def run(command, **kwargs):
        env = kwargs.get("env")
        seen.append(command[1].rsplit("/", 1)[-1] + ": " + str(env and env["XLA_FLAGS"]))
        return bench.subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(bench.subprocess, "run", run)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
    for each in (setting, bench.Setting(bench.DEFAULTS)):
        bench.run_one(1, each, [], bench.Path("p"), 1.0)
        bench.check_one(each, "moe", [], 1.0)
    both = "--xla_gpu_enable_command_buffer= --xla_gpu_enable_triton_gemm=false"
    assert seen == [
        f"bench_engine.py: {both}",
        f"check_kernels.py: {both}",
        "bench_engine.py: None",
        "check_kernels.py: None",
    ]

    def late(command, **kwargs):  # a process past its time: a failed line, not a crash
        raise bench.subprocess.TimeoutExpired(command, 1.0, stderr=b"compiling...")

    monkeypatch.setattr(bench.subprocess, "run", late)
    run = bench.run_one(2, setting, [], bench.Path("p"), 1.0)
    assert (run.round, run.returncode, run.rows) == (2, -1, [])
    assert run.error.startswith("timed out after 1 s") and run.error.endswith("compiling...")
    assert bench.check_one(setting, "moe", [], 1.0) == bench.Check(-1, "timed out after 1 s")
    runs = [bench.Run(1, setting, 0, [_row(1, 1.0)])]
    assert f"| 1 | cublas | {setting.switches[0]}, {setting.xla_flags[0]} |" in bench.table(
        runs, "# t"
    )


def test_the_table_is_written_after_every_run(tmp_path, load_script, monkeypatch):
    """A call stopped part way (a device's time limit) keeps the runs it made: the out
    file holds every finished run before the next starts."""
    bench = load_script("bench_switches")
    out = tmp_path / "t.md"
    seen = []

    def run_one(round_, setting, bench_args, profile, timeout):
        text = out.read_text() if out.exists() else ""
        seen.append(sum(line.startswith(f"| {r} | ") for line in text.splitlines() for r in (1, 2)))
        return bench.Run(round_, setting, 0, [_row(1, 1.0)])

    monkeypatch.setattr(bench, "run_one", run_one)
    argv = ["--setting", "a=backend.MOE_DOWN_IN_UP_ZERO_UNUSED=1", "--out", str(out)]
    assert bench.main(argv) == 0
    assert seen == [0, 1, 2, 3]
