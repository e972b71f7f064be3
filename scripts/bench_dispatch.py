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

``--program-layout`` also prints how XLA laid the widest decode step out for the host to
run (read from the compiled program's optimized HLO): the command buffers with their
commands, and the entry's operations outside them, by opcode (each a launch of its own;
conditionals and while loops also wait on the host).

    python scripts/bench_dispatch.py --preset qwen3_next_moe --batches 1,16 --count-updates
    python scripts/bench_dispatch.py --preset qwen3_next_moe --batches 1 --program-layout
    python scripts/bench_dispatch.py --preset tiny --backends xla --batches 1   # CPU smoke
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

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


def reference_rows(commands: int, calls: int) -> list[dict]:
    """The reference program, its argument donated and written in place, then returning a
    fresh output each call."""
    import jax
    import jax.numpy as jnp

    def rounds(x):
        for i in range(commands):
            x = x * 0.999 + jnp.sum(x) * 1e-6 + i
        return x

    rows = []
    for name, donate in (("in place", True), ("fresh output", False)):
        step = jax.jit(rounds, donate_argnums=(0,) if donate else ())
        held = {"x": jnp.ones((4096,), jnp.float32)}

        def call(step=step, donate=donate, held=held):
            out = step(held["x"])
            if donate:
                held["x"] = out
            return out

        for idle in (True, False):
            label = f"reference ({commands} rounds), {name}, {'idle' if idle else 'chained'}"
            _phase(label)
            rows.append({"what": label, "ms": 1e3 * _timed_calls(call, calls, idle)})
    return rows


def decode_rows(model, args, batch: int) -> list[dict]:
    """The engine's widest decode step at ``batch`` requests, idle and chained, called as one
    program and as two copies in turn (``runner.InTurn``)."""
    import bench_engine as be

    from lazyspec.engine.runner import InTurn

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
        runner, packed, programs = engine.runner, recorder.batch, recorder.jitted.programs
        if args.program_layout:
            hlo = be._compiled_decode(runner, runner.params, runner.pools, packed).as_text()
            layout = program_layout(hlo)
            outside = ", ".join(f"{op} {n}" for op, n in sorted(layout["outside"].items()))
            print(
                f"{args.preset} {backend} decode, batch {batch}: "
                f"{len(layout['command_buffers'])} command buffers "
                f"(commands {layout['command_buffers']}); outside them: {outside or 'none'}",
                flush=True,
            )
        for copies in (1, 2):
            step = InTurn(programs[:copies])

            def call(runner=runner, packed=packed, step=step):
                out, runner.pools = step(runner.params, runner.pools, packed)
                return out

            for idle in (True, False):
                mode = "idle" if idle else "chained"
                label = f"{args.preset} {backend} decode, batch {batch}, {copies} in turn, {mode}"
                _phase(label)
                rows.append({"what": label, "ms": 1e3 * _timed_calls(call, args.calls, idle)})
    return rows


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
        "--count-updates",
        action="store_true",
        help="run in a child process with XLA's command-buffer log on and count its updates",
    )
    p.add_argument(
        "--program-layout",
        action="store_true",
        help="print the decode step's command buffers and the operations outside them",
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.count_updates and not args.child:
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="command_buffer_thunk=3")
        argv = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--count-updates"]
        child = subprocess.run(
            [sys.executable, __file__, *argv, "--child"],
            env=env,
            capture_output=True,
            text=True,
        )
        if child.returncode != 0:
            sys.stderr.write(child.stderr[-4000:])
            raise SystemExit(f"the measuring child process failed ({child.returncode})")
        updates = count_updates(child.stderr, args.calls)
        print(child.stdout, end="")
        print("\n| phase | command-buffer updates per call | changed allocations per update |")
        print("|---|---|---|")
        for name, (per_call, allocs) in updates.items():
            print(f"| {name} | {per_call:.2f} | {allocs:.0f} |")
        if not any(per_call for per_call, _ in updates.values()):
            print("\n(no command-buffer updates logged: n/a on this backend, or none happened)")
        return
    import jax
    from bench_engine import build_model

    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    rows = reference_rows(args.ref_commands, args.calls)
    model = build_model(args.preset, args.dtype)
    for batch in (int(b) for b in args.batches.split(",")):
        rows += decode_rows(model, args, batch)
    print("\n| phase | median dispatch (host ms) |")
    print("|---|---|")
    for row in rows:
        print(f"| {row['what']} | {row['ms']:.3f} |")


if __name__ == "__main__":
    main()
