"""Dispatch switches timed against the defaults: ``bench_engine.py`` runs, settings in turn.

A dispatch constant of ``lazyspec.kernels`` (``backend.MOE_DOWN_IN_UP_ZERO_UNUSED``, ...)
applies when a step is traced, so each setting runs ``scripts/bench_engine.py`` in a
process of its own with its ``--kernel-switch`` items. Every round runs the defaults first,
then each ``--setting`` in the order given; ``--rounds`` rounds. The table has one line per
run and engine row (batch, kernels a token step, device step, kernels busy, floor, % of
floor, engine loop) and, per setting and row, its device step against the defaults' of the
same round in every round, and whether it was shorter in all of them: the rule the
dispatch constants in ``kernels/backend.py`` are set by (a switch goes on only where the
step is shorter in every round, and ``scripts/check_kernels.py`` passes with it). A run
that fails is a line of the table with its exit status and the end of its error output;
the script then exits 1. With ``--checks NAMES`` every setting first runs
``scripts/check_kernels.py --checks NAMES`` with its switches (``--check-args`` adds to
that command, e.g. ``--check-args=--smoke`` on a CPU), and the verdict says whether the
check passed. A setting's item that starts with ``--xla_`` is an XLA flag rather than a
constant: that setting's processes get it appended to ``XLA_FLAGS`` (a compiler option
timed the same way, e.g. cuBLAS for XLA's GEMMs). The table is written after every run, so
a call stopped part way keeps the runs it made, and names the card and jax version the runs
printed (``bench_engine.py``'s device line: a device call may be lent another card than
the one asked for).

Every run gets ``--profile`` (a folder of its own under ``--profile-root``): the device
step is the median span of a step's kernels, which on a GPU needs XLA's command buffers on
(the default) to be the step as served. The arguments after ``--`` go to every run
(default: the batch-1 decode step of the Qwen3-Next preset, as BENCHMARKS.md times it).

    python scripts/bench_switches.py --rounds 2 \\
        --setting zero=backend.MOE_DOWN_IN_UP_ZERO_UNUSED=1 \\
        --setting unfolded=backend.MOE_ROUTE_IN_UP_MAX_TOKENS=0,backend.MOE_DOWN_IN_UP_MAX_TOKENS=0
    python scripts/bench_switches.py --rounds 2 --setting cublas=--xla_gpu_enable_triton_gemm=false
    python scripts/bench_switches.py --rounds 1 --setting apart=backend.MLP_OUTPUT_IN_NEXT_NORM=0 \\
        -- --preset tiny --backends xla --batches 1 --prompt-len 64 --output-len 4   # CPU smoke
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lazyspec.bench.origin import DEVICE_PREFIX
from lazyspec.bench.switches import check_switches

SCRIPTS = Path(__file__).resolve().parent
DEFAULTS = "defaults"
DEFAULT_BENCH_ARGS = (
    "--preset", "qwen3_next_moe", "--batches", "1", "--output-len", "64",
    "--context", "1024", "--decode-steps", "2",
)  # fmt: skip
ERROR_TAIL = 2000  # characters of a failed run's error output kept in the table
XLA_FLAG_PREFIX = "--xla_"


@dataclasses.dataclass(frozen=True)
class Setting:
    """A name, the ``--kernel-switch`` items of one setting and the XLA flags its processes
    add to ``XLA_FLAGS`` (none of either: the defaults)."""

    name: str
    switches: tuple[str, ...] = ()
    xla_flags: tuple[str, ...] = ()

    def items(self) -> tuple[str, ...]:
        """The setting as given: its switches, then its XLA flags."""
        return self.switches + self.xla_flags

    def switch_args(self) -> list[str]:
        """The ``--kernel-switch`` arguments of a process with this setting."""
        return [arg for item in self.switches for arg in ("--kernel-switch", item)]

    def env(self) -> dict[str, str] | None:
        """The environment of this setting's processes: this one's with the XLA flags
        appended to ``XLA_FLAGS``, or None (inherit it) where it has none."""
        if not self.xla_flags:
            return None
        flags = " ".join([os.environ.get("XLA_FLAGS", ""), *self.xla_flags]).strip()
        return {**os.environ, "XLA_FLAGS": flags}


@dataclasses.dataclass
class Run:
    """One process: its round, setting, exit status, engine rows and error output's end."""

    round: int
    setting: Setting
    returncode: int
    rows: list[dict]
    error: str = ""
    seconds: float = 0.0
    device: str = ""  # bench_engine.py's "device: ..." line


@dataclasses.dataclass
class Check:
    """``check_kernels.py`` run with one setting's switches: its exit status, and the end
    of its output where it failed."""

    returncode: int
    error: str = ""


def parse_setting(text: str) -> Setting:
    """``NAME=ITEM[,ITEM...]``, an item ``MODULE.NAME=INT`` (a dispatch constant) or an XLA
    flag (``--xla_...``); SystemExit names what is wrong."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise SystemExit(f"--setting {text!r}: expected NAME=MODULE.NAME=INT[,...]")
    if name == DEFAULTS:
        raise SystemExit(f"--setting {text!r}: {DEFAULTS!r} is the baseline every round runs")
    items = rest.split(",")
    flags = tuple(item for item in items if item.startswith(XLA_FLAG_PREFIX))
    switches = tuple(item for item in items if not item.startswith(XLA_FLAG_PREFIX))
    for flag in flags:
        if len(flag) == len(XLA_FLAG_PREFIX) or any(c.isspace() for c in flag):
            raise SystemExit(f"--setting {text!r}: {flag!r} is not one XLA flag")
    try:  # before any run: a name that is no constant fails here, not in every process
        check_switches(list(switches))
    except ValueError as exc:
        raise SystemExit(f"--setting {text!r}: {exc}") from None
    return Setting(name, switches, flags)


def plan(settings: list[Setting], rounds: int) -> list[tuple[int, Setting]]:
    """The runs in order: each round the defaults, then every setting."""
    return [(r, s) for r in range(1, rounds + 1) for s in [Setting(DEFAULTS), *settings]]


def engine_rows(stdout: str) -> list[dict]:
    """The engine rows ``bench_engine.py`` prints (a dict a line; the transformers peer's
    rows, which have no host calls, are left out)."""
    rows = []
    for line in stdout.splitlines():
        if line.startswith("{'preset'"):
            row = ast.literal_eval(re.sub(r"\bnan\b", "None", line))
            if "host_ms" in row:
                rows.append(row)
    return rows


def run_script(name: str, args: list[str], setting: Setting, timeout: float):
    """``scripts/<name>`` run with ``args`` and the setting's switches and XLA flags, its
    output captured: (the completed process, or None where it ran past ``timeout``; the
    error output so far where it did; seconds)."""
    command = [sys.executable, str(SCRIPTS / name), *args, *setting.switch_args()]
    start = time.perf_counter()
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env=setting.env()
        )
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        return None, err, time.perf_counter() - start
    return done, "", time.perf_counter() - start


def run_one(round_: int, setting: Setting, bench_args: list[str], profile: Path, timeout: float):
    args = [*bench_args, "--profile", str(profile)]
    done, err, seconds = run_script("bench_engine.py", args, setting, timeout)
    if done is None:
        return Run(round_, setting, -1, [], f"timed out after {timeout:.0f} s\n{err}"[-ERROR_TAIL:])
    if done.returncode != 0:
        return Run(round_, setting, done.returncode, [], done.stderr[-ERROR_TAIL:], seconds)
    return Run(round_, setting, 0, engine_rows(done.stdout), "", seconds, device_of(done.stdout))


def device_of(stdout: str) -> str:
    """The card and jax version ``bench_engine.py`` printed ("device: ..."), or ""."""
    lines = [line for line in stdout.splitlines() if line.startswith(DEVICE_PREFIX)]
    return lines[0][len(DEVICE_PREFIX) :] if lines else ""


def check_one(setting: Setting, checks: str, extra: list[str], timeout: float) -> Check:
    done, _, _ = run_script("check_kernels.py", ["--checks", checks, *extra], setting, timeout)
    if done is None:
        return Check(-1, f"timed out after {timeout:.0f} s")
    output = done.stdout + done.stderr
    return Check(done.returncode, "" if done.returncode == 0 else output[-ERROR_TAIL:])


def row_key(row: dict) -> tuple:
    return row["backend"], row["batch"], row["spec"]


def step_ms(row: dict) -> float:
    return row["device_ms"]


def compare(runs: list[Run]) -> dict[tuple[str, tuple], dict]:
    """Per (setting, row key): the device step less the defaults' of the same round, each
    round, and whether it was shorter in every round (False where a round is missing)."""
    base = {}
    for r in runs:
        if r.setting.name == DEFAULTS:
            base.update({(r.round, row_key(row)): step_ms(row) for row in r.rows})
    rounds = sorted({r.round for r in runs})
    out: dict[tuple[str, tuple], dict] = {}
    for r in runs:
        if r.setting.name == DEFAULTS:
            continue
        for row in r.rows:
            entry = out.setdefault((r.setting.name, row_key(row)), {"deltas": {}})
            if (r.round, row_key(row)) in base:
                entry["deltas"][r.round] = step_ms(row) - base[(r.round, row_key(row))]
    for entry in out.values():
        deltas = entry["deltas"]
        entry["shorter"] = len(deltas) == len(rounds) and all(d < 0 for d in deltas.values())
    return out


def table(runs: list[Run], header: str, checks: dict[str, Check] | None = None) -> str:
    """The runs' lines and, per setting and row, the verdict; ``checks``: each setting's
    ``check_kernels.py`` run (a column of the verdict, and the failed ones' output)."""
    devices = list(dict.fromkeys(r.device for r in runs if r.device))
    lines = [header, ""]
    if devices:  # the card each figure is of (a call may be lent another than the one asked)
        lines += [f"Device: {'; '.join(devices)}.", ""]
    lines += [
        "| round | setting | switches | batch | spec | kernels a token step | device step ms "
        "| busy ms | floor ms | % of floor (device step) | engine loop ms/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        switches = ", ".join(r.setting.items()) or "-"
        if r.returncode != 0:
            error = " ".join(r.error.split()).replace("|", "\\|")
            lines.append(
                f"| {r.round} | {r.setting.name} | {switches} | failed (exit status "
                f"{r.returncode}): {error} | | | | | | | |"
            )
            continue
        for row in r.rows:
            lines.append(
                f"| {r.round} | {r.setting.name} | {switches} | {row['batch']} | {row['spec']} "
                f"| {row['kernels']:.0f} | {row['device_ms']:.3f} | {row['busy_ms']:.3f} "
                f"| {row['floor_ms']:.3f} | {row['pct_device']:.0f} % | {row['loop_ms']:.2f} |"
            )
    verdicts = compare(runs)
    if verdicts:
        check_head, check_rule = ("| check passed ", "---|") if checks is not None else ("", "")
        lines += [
            "",
            "| setting | backend, batch, spec | device step against the defaults, us, each round "
            "| shorter in every round " + check_head + "|",
            "|---|---|---|---|" + check_rule,
        ]
        for (name, key), entry in verdicts.items():
            deltas = ", ".join(f"{1e3 * d:+.1f}" for _, d in sorted(entry["deltas"].items()))
            yes = "yes" if entry["shorter"] else "no"
            cell = ""
            if checks is not None:
                cell = " yes |" if checks[name].returncode == 0 else " no |"
            lines.append(f"| {name} | {', '.join(map(str, key))} | {deltas} | {yes} |{cell}")
    for name, check in (checks or {}).items():
        if check.returncode != 0:
            error = " ".join(check.error.split())
            lines += ["", f"check_kernels.py with {name} (exit status {check.returncode}): {error}"]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = list(DEFAULT_BENCH_ARGS)
    if "--" in argv:
        at = argv.index("--")
        argv, bench_args = argv[:at], argv[at + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--setting",
        action="append",
        required=True,
        metavar="NAME=MODULE.NAME=INT[,...]",
        help="a setting timed against the defaults (repeatable); an item --xla_... is an XLA "
        "flag added to the setting's XLA_FLAGS",
    )
    parser.add_argument("--rounds", type=int, default=2, help="runs of every setting, in turn")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take")
    parser.add_argument("--profile-root", type=Path, default=None, help="default: a temp dir")
    parser.add_argument("--out", type=Path, default=Path("bench_switches.md"))
    parser.add_argument(
        "--checks",
        default=None,
        metavar="NAMES",
        help="run scripts/check_kernels.py --checks NAMES with each setting first",
    )
    parser.add_argument(
        "--check-args",
        default="",
        help="more arguments of that command (e.g. --check-args=--smoke)",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds} must be at least 1")
    for flag in ("--profile", "--kernel-switch"):
        if flag in bench_args:
            parser.error(f"{flag} after -- is this script's to set")
    args.settings = [parse_setting(text) for text in args.setting]
    names = [s.name for s in args.settings]
    if len(set(names)) != len(names):
        parser.error(f"setting names repeat: {names}")
    args.bench_args = bench_args
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    runs: list[Run] = []
    checks = None
    if args.checks:
        extra = shlex.split(args.check_args)
        checks = {}
        for setting in args.settings:
            checks[setting.name] = check_one(setting, args.checks, extra, args.timeout)
            verdict = "passed" if checks[setting.name].returncode == 0 else "failed"
            print(f"check_kernels.py --checks {args.checks}, {setting.name}: {verdict}", flush=True)
    header = (
        f"# Switches against the defaults\n\nbench_engine.py {' '.join(args.bench_args)} "
        f"(each run with --profile), {args.rounds} round(s), settings in turn; device step: "
        "the median span of a step's kernels."
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = args.profile_root or Path(tmp)
        todo = plan(args.settings, args.rounds)
        for i, (round_, setting) in enumerate(todo, 1):
            profile = root / f"{i:02d}-{setting.name}"
            run = run_one(round_, setting, args.bench_args, profile, args.timeout)
            runs.append(run)
            steps = ", ".join(f"{r['device_ms']:.3f} ms" for r in run.rows) or "no rows"
            status = f"{steps}" if run.returncode == 0 else f"failed ({run.returncode})"
            print(
                f"[{i}/{len(todo)}] round {round_}, {setting.name}: {status} ({run.seconds:.0f} s)",
                flush=True,
            )
            text = table(runs, header, checks)
            args.out.write_text(text)  # after every run: a stopped call keeps what it made
    print(text)
    checked = checks is None or all(c.returncode == 0 for c in checks.values())
    return 0 if checked and all(r.returncode == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
