"""Host time of dispatching the decode step, and how often XLA re-records its command buffers.

The batch-1 engine loop is bound by the jitted decode step's dispatch (BENCHMARKS.md, "The
decode step's dispatch"): on a GPU, XLA runs the step as command buffers (CUDA graphs) and
updates every command that touches a buffer whose address changed since the last call,
which costs far more host time than launching an unchanged graph. For each batch size this
script serves a few requests (compiling the shapes), then calls the widest decode step
``--calls`` times, each with the device idle (``idle``: waits for the step before the next
call) and back to back (``chained``), and reports the median host time of the call, once
calling one program and once two copies of it in turn (``EngineConfig.decode_program_copies``).
Every call moves the same packed batch's words to the device afresh, as the engine loop does
each step (the step writes its outputs over them).

For scale, the same is timed for a reference program of ``--ref-commands`` small kernels
(reduce-and-add rounds over 4096 floats): with its argument donated and written in place
(every address unchanged from call to call) and with a fresh output per call (one buffer
moves). On a GPU, ``--count-updates`` runs the measurement in a child process with XLA's
command-buffer log on and adds, per timed phase, the updates per call and the changed
allocations per update. On a CPU there are no command buffers (the columns read n/a).

``--ref-kinds`` adds reference programs made of other kinds of rounds (a Pallas kernel
launched every round, a Pallas kernel of its own each round, a GEMV against a 2048 x 2048
bf16 weight), to see which kind of command makes a graph slow to launch.
``--split`` also times the parts of a decode call apart (``split_rows``): the words'
placement, a no-op program taking the step's arrays, and one taking the words alone; what
the decode call takes beyond them is its own launch.
``--xla-flag-sets 'A|B'`` runs the whole measurement once per set of XLA flags, each in a
child process with the set added to XLA_FLAGS (an empty set runs it as it is).

``--host-profile CALLS`` also profiles CALLS calls of the two programs in turn (idle and
chained) under the JAX profiler and prints the host's events by total time (on a GPU:
PjRt's execute, the command buffer's execute and update, the driver's ``cuGraphLaunch``).

``--program-layout`` also prints how XLA laid the widest decode step out for the host to
run: the command buffers with their commands, and the operations outside them, by kind
(each a launch of its own; conditionals and while loops also wait on the host). It runs
the measurement in a child process that has XLA dump its programs, and reads the thunk
sequence XLA runs (``*thunk_sequence_after_thunk_passes.txt``): current XLA forms command
buffers from thunks, after the HLO is final, so the optimized HLO shows none. Where no
thunk sequence is dumped (a CPU, or an XLA that forms them in the HLO) it reads the
optimized HLO instead; the line says which it read.

    python benchmarks/tools/bench_dispatch.py --preset qwen3_next_moe --batches 1,16 --count-updates
    python benchmarks/tools/bench_dispatch.py --preset qwen3_next_moe --batches 1 --program-layout
    python benchmarks/tools/bench_dispatch.py --batches 1 \
        --ref-kinds fusion,pallas,pallas_distinct,gemv \
        --xla-flag-sets '|--xla_gpu_enable_pdl=false --xla_gpu_enable_pdl_launch=false'
    python benchmarks/tools/bench_dispatch.py --preset tiny --backends xla --batches 1   # CPU smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

# bench_engine (its presets and model builder) is a user tool under scripts/
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

PHASE = "bench_dispatch phase: "  # printed to stderr before each timed phase
_UPDATE = re.compile(r"updated_allocs=(\d+)")
# an HLO instruction: [ROOT] %name = shape opcode(operands)..., the shape a token or a tuple
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?:\(.*?\)|\S+)\s+([\w\-]+)\(")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLEE = re.compile(r"(?:to_apply|calls)=%?([\w.\-]+)")
# operations that launch nothing: values passed along, not computed
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant"}


def program_layout(hlo: str) -> dict:
    """From an optimized HLO module's text: ``command_buffers`` (the commands of each
    command-buffer computation the entry calls, in order) and ``outside`` (opcode -> count of
    the entry's other operations that launch work)."""
    bodies: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        if (head := _COMPUTATION.match(line)) is not None:
            current = head.group(2)
            bodies[current] = []
            if head.group(1):
                entry = current
        elif line.strip() == "}":
            current = None
        elif current is not None:
            bodies[current].append(line)
    buffers, outside = [], {}
    for line in bodies.get(entry, []):
        match = _INSTRUCTION.match(line)
        if match is None or match.group(1) in _FREE:
            continue
        callee = _CALLEE.search(line)
        if match.group(1) == "call" and callee and "command_buffer" in callee.group(1):
            ops = [_INSTRUCTION.match(b) for b in bodies.get(callee.group(1), [])]
            buffers.append(sum(1 for op in ops if op is not None and op.group(1) not in _FREE))
        else:
            outside[match.group(1)] = outside.get(match.group(1), 0) + 1
    return {"command_buffers": buffers, "outside": outside}


# a thunk line of XLA's dumped thunk sequence: "001: kCopy   [...] ...", nested thunks indented
_THUNK = re.compile(r"^(\s*)\d+:\s+(k\w+)")


def thunk_layout(text: str) -> dict:
    """From a dumped thunk sequence (``*thunk_sequence_after_thunk_passes.txt``):
    ``command_buffers`` (the commands under each top-level command-buffer thunk, nested
    ones included) and ``outside`` (thunk kind -> count of the other top-level thunks)."""
    buffers, outside, inside = [], {}, False
    for line in text.splitlines():
        if (match := _THUNK.match(line)) is None:
            continue
        indent, kind = match.groups()
        if not indent:
            inside = kind == "kCommandBuffer"
            if inside:
                buffers.append(0)
            else:
                outside[kind] = outside.get(kind, 0) + 1
        elif inside:
            buffers[-1] += 1
    return {"command_buffers": buffers, "outside": outside}


def _latest_thunk_sequence(dump_dir: str | None) -> str | None:
    """The newest decode step's thunk sequence XLA dumped under ``dump_dir``, if any."""
    if not dump_dir:
        return None
    files = sorted(
        Path(dump_dir).glob("*decode_step*thunk_sequence_after_thunk_passes.txt"),
        key=lambda f: f.stat().st_mtime,
    )
    return files[-1].read_text() if files else None


def _timed_calls(call, calls: int, idle: bool) -> float:
    """Median host seconds of ``call()`` (which returns what to wait on) over ``calls`` calls
    after three untimed ones; ``idle``: wait for each call's result before the next."""
    import jax

    seconds, result = [], None
    for i in range(calls + 3):
        start = time.perf_counter()
        result = call()
        if i >= 3:
            seconds.append(time.perf_counter() - start)
        if idle:
            jax.block_until_ready(result)
    jax.block_until_ready(result)
    return float(np.median(seconds))


def _phase(name: str) -> None:
    print(PHASE + name, file=sys.stderr, flush=True)


def _timed_row(label: str, call, calls: int, idle: bool) -> dict:
    """The phase ``label`` (marked for ``--count-updates``): the median host ms of
    ``call`` (``_timed_calls``)."""
    _phase(label)
    return {"what": label, "ms": 1e3 * _timed_calls(call, calls, idle)}


def _round(kind: str):
    """One round of a reference program of ``kind`` (``REF_KINDS``): ``(x, w, i) -> x``
    over a [4096] float32 ``x`` and a [2048, 2048] bf16 ``w``."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    interpret = jax.default_backend() == "cpu"

    def pallas(x, constant):
        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] * 0.999 + constant

        shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return pl.pallas_call(kernel, out_shape=shape, interpret=interpret)(x)

    def gemv(x, w, i):
        y = jnp.dot(x[None, :2048].astype(w.dtype), w, preferred_element_type=jnp.float32)
        return x.at[:2048].add(y[0] * 1e-3)

    def gemm(x, w, i):  # 16 rows against a [2048, 256] slice: a Triton GEMM
        rows = jnp.broadcast_to(x[:2048], (16, 2048)).astype(w.dtype)
        return x + jnp.sum(jnp.dot(rows, w[:, :256], preferred_element_type=jnp.float32)) * 1e-9

    def top_k(x, w, i):  # the router's selection: 10 of 64
        values, _ = jax.lax.top_k(x[:64], 10)
        return x + jnp.sum(values) * 1e-6

    def softmax(x, w, i):  # a row softmax over 64 columns
        return x + jnp.sum(jax.nn.softmax(x[:1024].reshape(16, 64), axis=-1)[:, 0]) * 1e-6

    def scatter(x, w, i):  # 16 adds at indices read from x
        rows = (x[:16] > 0).astype(jnp.int32) * 7 + jnp.arange(16) * 3 + i % 7
        return x.at[rows].add(1e-6)

    def cond(x, w, i):  # a branch on a value read from x
        return jax.lax.cond(x[i % 16] > 0, lambda v: v * 0.999, lambda v: v * 1.001, x)

    return {
        "fusion": lambda x, w, i: x * 0.999 + jnp.sum(x) * 1e-6 + i,
        "pallas": lambda x, w, i: pallas(x, 1.0),  # one kernel, launched every round
        "pallas_distinct": lambda x, w, i: pallas(x, float(i)),  # a kernel of its own each
        "gemv": gemv,
        "gemm": gemm,
        "top_k": top_k,
        "softmax": softmax,
        "scatter": scatter,
        "cond": cond,
    }[kind]


# reference programs: rounds of one kind of command (``_round``)
REF_KINDS = (
    "fusion",
    "pallas",
    "pallas_distinct",
    "gemv",
    "gemm",
    "top_k",
    "softmax",
    "scatter",
    "cond",
)


def reference_rows(commands: int, calls: int, kinds: tuple[str, ...] = ("fusion",)) -> list[dict]:
    """The reference programs of ``commands`` rounds of each of ``kinds``, their argument
    donated and written in place; the first kind's also returning a fresh output each call."""
    import jax
    import jax.numpy as jnp

    weight = jnp.full((2048, 2048), 1e-3, jnp.bfloat16)
    rows = []
    for k, kind in enumerate(kinds):
        one_round = _round(kind)

        def rounds(x, w, one_round=one_round):
            for i in range(commands):
                x = one_round(x, w, i)
            return x

        ways = (("in place", True), ("fresh output", False)) if k == 0 else (("in place", True),)
        for name, donate in ways:
            step = jax.jit(rounds, donate_argnums=(0,) if donate else ())
            held = {"x": jnp.ones((4096,), jnp.float32)}

            def call(step=step, donate=donate, held=held):
                out = step(held["x"], weight)
                if donate:
                    held["x"] = out
                return out

            what = "reference" if kind == "fusion" else f"reference {kind}"
            for idle in (True, False):
                label = f"{what} ({commands} rounds), {name}, {'idle' if idle else 'chained'}"
                rows.append(_timed_row(label, call, calls, idle))
    return rows


def decode_rows(model, args, batch: int) -> list[dict]:
    """The engine's widest decode step at ``batch`` requests, idle and chained, called as one
    program and as two copies in turn (``step_calls.StepCalls``, the executables warm-up bound
    to the engine's); each call hands the step its words through ``Runner._input``, as the
    engine's launch does."""
    import bench_engine as be

    from lazyspec.engine.step_calls import StepCalls

    engine_args = types.SimpleNamespace(
        moe_runner_backend="auto",
        dtype=args.dtype,
        tp_size=1,
        prompt_len=args.prompt_len,
        context=args.context,
        page_size=1,
        spec_steps=3,
        decode_program_copies=2,
    )
    rows = []
    for backend in args.backends.split(","):
        engine, recorder = be.served_engine(model, backend, engine_args, batch, spec=False)
        runner, packed, decode = engine.runner, recorder.batch, recorder.jitted
        if args.program_layout:
            hlo = be._compiled_decode(runner, runner.params, runner.pools, packed).as_text()
            thunks = _latest_thunk_sequence(args.dump_dir)
            if thunks is not None:
                layout, source = thunk_layout(thunks), "thunk sequence"
            else:
                layout, source = program_layout(hlo), "optimized HLO"
            outside = ", ".join(f"{op} {n}" for op, n in sorted(layout["outside"].items()))
            print(
                f"{args.preset} {backend} decode, batch {batch} ({source}): "
                f"{len(layout['command_buffers'])} command buffers "
                f"(commands {layout['command_buffers']}); outside them: {outside or 'none'}",
                flush=True,
            )
        for copies in (1, 2):
            step = StepCalls(decode.jitted[:copies])
            step.compiled = {layout: bound[:copies] for layout, bound in decode.compiled.items()}

            def call(runner=runner, packed=packed, step=step):
                # the words as the engine's launch hands them (placed first off a CPU)
                words = runner._input(packed.words)
                batch = dataclasses.replace(packed, words=words)
                out, runner.pools = step(runner.params, runner.pools, batch)
                return out

            for idle in (True, False):
                mode = "idle" if idle else "chained"
                label = f"{args.preset} {backend} decode, batch {batch}, {copies} in turn, {mode}"
                rows.append(_timed_row(label, call, args.calls, idle))
                if args.host_profile and copies == 2:
                    _print_host_profile(label, call, args.host_profile, idle)
        if args.split:
            rows += split_rows(runner, packed, f"{args.preset} {backend} batch {batch}", args.calls)
    return rows


def split_rows(runner, packed, what: str, calls: int) -> list[dict]:
    """The parts of a decode call apart, idle and chained: the words' placement alone
    (``Runner._input``), a program that does nothing but take the step's arguments (its
    weights, pools and words placed, none donated), and one that takes the words placed
    alone. The second minus the third is what the step's argument count costs; what the
    decode call takes beyond the second is its own launch."""
    import jax

    def nothing(*arrays):
        return arrays[-1][:1] + 1

    taking = jax.jit(nothing)
    leaves = len(jax.tree.leaves((runner.params, runner.pools))) + 1
    parts = {
        "the words' placement alone": lambda: runner._input(packed.words),
        f"a no-op program taking the step's {leaves} arrays": lambda: taking(
            runner.params, runner.pools, runner._input(packed.words)
        ),
        "a no-op program taking the words alone": lambda: taking(runner._input(packed.words)),
    }
    return [
        _timed_row(f"{what}: {name}, {'idle' if idle else 'chained'}", call, calls, idle)
        for name, call in parts.items()
        for idle in (True, False)
    ]


def host_event_totals(trace_dir: str | Path) -> dict[str, tuple[int, float]]:
    """Name -> (count, total us) of the host's complete events in the perfetto trace under
    ``trace_dir`` (the device's streams left out)."""
    from lazyspec.bench.floor import trace_events

    events, devices = trace_events(trace_dir)
    totals: dict[str, tuple[int, float]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("pid") not in devices:
            count, total = totals.get(e["name"], (0, 0.0))
            totals[e["name"]] = (count + 1, total + float(e.get("dur", 0.0)))
    return totals


def _print_host_profile(label: str, call, calls: int, idle: bool, top: int = 30) -> None:
    """The host events of ``calls`` calls under the JAX profiler (after 3 untimed), the
    longest ``top`` by total time: count, total and per call. The profiler slows every
    call: read the shares, not the times."""
    import jax

    with tempfile.TemporaryDirectory(prefix="bench_dispatch_trace_") as trace_dir:
        for _ in range(3):
            jax.block_until_ready(call())
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            _timed_calls(call, calls - 3, idle)  # runs ``calls`` calls in all
        totals = host_event_totals(trace_dir)
    print(f"\nhost events of {calls} calls under the profiler: {label}")
    print("| event | count | total us | us per call |")
    print("|---|---|---|---|")
    own = ("$profiler.py", "$contextlib.py")  # the trace's own start and stop
    kept = {name: v for name, v in totals.items() if not name.startswith(own)}
    for name, (count, total) in sorted(kept.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"| {name[:90]} | {count} | {total:.0f} | {total / calls:.1f} |")


def count_updates(log: str, calls: int) -> dict[str, tuple[float, float]]:
    """Per phase of a child's stderr: (command-buffer updates per timed call, median changed
    allocations per update); phases run ``calls`` + 3 calls, all counted."""
    counts: dict[str, list[int]] = {}
    phase = None
    for line in log.splitlines():
        if line.startswith(PHASE):
            phase = line[len(PHASE) :].strip()
            counts[phase] = []
        elif phase is not None and (match := _UPDATE.search(line)):
            counts[phase].append(int(match.group(1)))
    return {
        name: (len(found) / (calls + 3), float(np.median(found)) if found else 0.0)
        for name, found in counts.items()
    }


def _print_updates(updates: dict[str, tuple[float, float]]) -> None:
    print("\n| phase | command-buffer updates per call | changed allocations per update |")
    print("|---|---|---|")
    for name, (per_call, allocs) in updates.items():
        print(f"| {name} | {per_call:.2f} | {allocs:.0f} |")
    if not any(per_call for per_call, _ in updates.values()):
        print("\n(no command-buffer updates logged: n/a on this backend, or none happened)")


def _parent_only(argv: list[str]) -> list[str]:
    """``argv`` without the options the parent process acts on."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--xla-flag-sets":
            skip = True
        elif a != "--count-updates" and not a.startswith("--xla-flag-sets="):
            kept.append(a)
    return kept


def _child(args, argv, dump_dir: str, flags: str = "") -> subprocess.CompletedProcess:
    """This script run again with ``--child``: with ``flags`` added to XLA_FLAGS, XLA's
    command-buffer log on (``--count-updates``) and XLA dumping its programs to
    ``dump_dir`` (``--program-layout``)."""
    env, extra = dict(os.environ), ["--child"]
    if args.count_updates:
        env.update(TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="command_buffer_thunk=3")
    if args.program_layout:
        flags += f" --xla_dump_to={dump_dir} --xla_dump_hlo_module_re=decode_step"
        extra += ["--dump-dir", dump_dir]
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}".strip()
    argv = _parent_only(argv if argv is not None else sys.argv[1:])
    child = subprocess.run(
        [sys.executable, __file__, *argv, *extra], env=env, capture_output=True, text=True
    )
    if child.returncode != 0:
        sys.stderr.write(child.stderr[-4000:])
        raise SystemExit(f"the measuring child process failed ({child.returncode})")
    return child


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3_next_moe")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--backends", default="pallas")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--calls", type=int, default=30, help="timed calls per phase")
    p.add_argument("--ref-commands", type=int, default=130)
    p.add_argument(
        "--ref-kinds",
        default="fusion",
        help=f"reference programs, one per kind of round ({', '.join(REF_KINDS)}), comma-separated",
    )
    p.add_argument(
        "--xla-flag-sets",
        default=None,
        help="'|'-separated sets of XLA flags: the whole measurement runs once per set, in a "
        "child process with the set added to XLA_FLAGS (an empty set: as it is)",
    )
    p.add_argument(
        "--count-updates",
        action="store_true",
        help="run in a child process with XLA's command-buffer log on and count its updates",
    )
    p.add_argument(
        "--split",
        action="store_true",
        help="also time the parts of a decode call apart: the words' placement, a no-op "
        "program taking the step's arrays, and one taking the words alone",
    )
    p.add_argument(
        "--program-layout",
        action="store_true",
        help="print the decode step's command buffers and the operations outside them",
    )
    p.add_argument(
        "--host-profile",
        type=int,
        default=0,
        metavar="CALLS",
        help="also profile CALLS calls of the two decode programs in turn (idle and chained) "
        "under the JAX profiler and print the host's events by total time",
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dump-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    kinds = tuple(args.ref_kinds.split(","))
    unknown = sorted(set(kinds) - set(REF_KINDS))
    if unknown:  # before any child process starts
        p.error(f"unknown --ref-kinds {unknown}; choose from {', '.join(REF_KINDS)}")
    flag_sets = args.xla_flag_sets.split("|") if args.xla_flag_sets is not None else None
    if (args.count_updates or args.program_layout or flag_sets) and not args.child:
        for flags in flag_sets or [""]:
            if flag_sets:
                print(f"\n## XLA_FLAGS += {flags.strip() or '(nothing)'}\n", flush=True)
            with tempfile.TemporaryDirectory(prefix="bench_dispatch_") as dump_dir:
                child = _child(args, argv, dump_dir, flags)
            print(child.stdout, end="", flush=True)
            if args.count_updates:
                _print_updates(count_updates(child.stderr, args.calls))
        return
    import jax
    from bench_engine import build_model

    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    if os.environ.get("XLA_FLAGS"):
        print(f"XLA_FLAGS: {os.environ['XLA_FLAGS']}", flush=True)
    rows = reference_rows(args.ref_commands, args.calls, kinds)
    model = build_model(args.preset, args.dtype)
    for batch in (int(b) for b in args.batches.split(",")):
        rows += decode_rows(model, args, batch)
    print("\n| phase | median dispatch (host ms) |")
    print("|---|---|")
    for row in rows:
        print(f"| {row['what']} | {row['ms']:.3f} |")


if __name__ == "__main__":
    main()
