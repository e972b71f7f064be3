"""Benchmark the recurrent-state kernels (Pallas vs XLA vs peers) and write a markdown table.

Per kernel, model shape, batch B and token count T (T = 1: decode, in-place pool write;
T > 1: verify, state after every token to scratch) it first checks the Pallas result against
the XLA form (vmapped ``recurrence`` scans, float32 dots) on the device, every output
element, then times both. Device time per call is the difference of the median times of
chains of 2 and 10 launches inside one jitted program (``chain_seconds``), so dispatch,
launch and sync costs cancel; call i of a chain uses slot set i % 8 of a pool of at least
512 MiB, so the L2 holds no state between calls. It reports the bytes that must move (state
read once and written once per written step, plus inputs and outputs), achieved GB/s, and
that as a fraction of the copy bandwidth measured in the same run (the larger of torch's
device-to-device ``copy_`` and XLA's ``x + 1``).

    python scripts/bench_kernels.py --out bench.md           # on a GPU
    python scripts/bench_kernels.py --smoke --out smoke.md   # CPU: tiny shapes, interpret

The ``ceiling`` kind times the decode kernels' memory traffic alone (``pattern_copy``: each
state tile read, incremented and written back in place, over the same grid, tiles and cache
hint as the state update), the bandwidth the update could reach in this lowering.

The ``chunk`` kind times prefill instead: T tokens per row from slot states, ragged rows,
the chunked XLA forms (``gdn_chunked`` / ``mamba2_chunked``: outputs, final state and the
state after every chunk) checked against and timed beside the token-by-token scans.

Shapes: Qwen3-Next-80B GDN at TP1 (32 value heads, d_k = d_v = 128, conv 8192 channels) and
Nemotron-H-8B Mamba2 (128 heads, head dim 64, state 128, 8 groups, conv 10240 channels;
from its published config). The scatter runs over 4 layers (time scales with layers).
Peers, timed when they import (each in a child process, over CUDA graphs of the same
chains): flash-linear-attention's ``fused_recurrent_gated_delta_rule`` (``fla-core``) and
mamba_ssm's ``selective_state_update`` (T = 1 only). A failing case prints its error and
the run goes on.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for torch

import jax

from lazyspec.bench.kernel_cases import (
    SCATTER_LAYERS,
    Model,
    ceiling_bench,
    chunk_bench,
    conv_bench,
    models,
    scatter_bench,
    state_bench,
)
from lazyspec.bench.kernel_timing import (
    CHAIN_CALLS,
    EXTERNAL,
    chain_seconds,
    check,
    copy_bandwidths,
    jax_chain,
    log,
)

COLUMNS = (
    "kernel",
    "model",
    "B",
    "T",
    "impl",
    "tiles",
    "check",
    "time us",
    "MB moved",
    "GB/s",
    "% copy",
)


# ---------------------------------------------------------------- driver


class Table:
    """Markdown rows, rewritten to ``path`` after every row so a partial run leaves a file.

    A row with an ``error`` (the whole message of a failed kernel or peer) gets a numbered
    note: its check cell names the note, and the file lists every note's full text under the
    table."""

    def __init__(self, path: Path, header: str):
        self.path, self.header, self.rows, self.errors = path, header, [], []

    def add(self, row: dict) -> None:
        error = row.pop("error", None)
        if error is not None:
            self.errors.append(error)
            first_line = (error.splitlines() or [""])[0]
            row["check"] = f"error E{len(self.errors)}: {first_line[:100]}"
        log("  " + "  ".join(f"{c}={row.get(c, '')}" for c in COLUMNS))
        self.rows.append("| " + " | ".join(str(row.get(c, "")) for c in COLUMNS) + " |")
        lines = [self.header, "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        notes = []
        for n, text in enumerate(self.errors, 1):
            notes += ["", f"E{n}:", "", "```", text.rstrip(), "```"]
        self.path.write_text("\n".join(lines + self.rows + notes) + "\n")


def measure(row: dict, moved: int, copy_gbs: float, seconds_fn: Callable[[], float]) -> dict:
    """Fill the timing columns of ``row``; an error becomes the row's ``error`` (its whole
    message; ``Table.add`` notes it)."""
    try:
        seconds = seconds_fn()
        gbs = moved / seconds / 1e9
        row.update(
            {
                "time us": f"{seconds * 1e6:.1f}",
                "MB moved": f"{moved / 1e6:.2f}",
                "GB/s": f"{gbs:.1f}",
                "% copy": f"{100 * gbs / copy_gbs:.1f}",
            }
        )
    except Exception as error:  # one failing kernel must not end the run
        traceback.print_exc(limit=4)
        row["error"] = f"{type(error).__name__}: {error}"
    return row


def run_shape(kind: str, model: Model, batch: int, tokens: int, opts, table: Table) -> None:
    base = {"model": model.name, "B": batch, "T": tokens}
    if kind == "external":
        label, package, _ = EXTERNAL[model.mixer]
        if importlib.util.find_spec(package) is None:
            log(f"  {package} is not installed: skipped")
            return
        if model.mixer == "mamba2" and tokens != 1:
            log("  selective_state_update takes one token per call: skipped")
            return
        state_bytes = model.heads * model.d_a * model.d_b * 4
        row = {**base, "kernel": model.mixer, "impl": label, "tiles": "-", "check": "timed only"}
        table.add(
            measure(
                row,
                2 * batch * state_bytes,
                opts.copy_gbs,
                lambda: peer_seconds(model, batch, tokens, opts),
            )
        )
        return
    builder, tile_list = {
        "state": (state_bench, model.state_tiles),
        "ceiling": (ceiling_bench, model.state_tiles),
        "chunk": (chunk_bench, ({},)),
        "conv": (conv_bench, model.conv_tiles),
        "scatter": (scatter_bench, model.scatter_tiles),
    }[kind]
    tile_list = opts.tiles.get("state" if kind == "ceiling" else kind, tile_list)
    try:
        bench = builder(model, batch, tokens, opts)
    except Exception as error:
        traceback.print_exc(limit=4)
        table.add({**base, "kernel": kind, "error": f"building inputs: {error!r}"})
        return
    candidate, reference = bench.impls
    for impl, tiles in [(candidate, t) for t in tile_list] + [(reference, {})]:
        row = {
            **base,
            "kernel": bench.kernel,
            "impl": impl,
            "tiles": ",".join(f"{k}={v}" for k, v in tiles.items()) or "-",
        }
        if impl == candidate:
            try:
                row["check"] = check(bench, tiles)
            except Exception as error:
                traceback.print_exc(limit=4)
                row["check"] = f"check error: {type(error).__name__}"
        table.add(
            measure(
                row,
                bench.bytes_moved,
                opts.copy_gbs,
                functools.partial(_chain_time, bench, impl, tiles, opts),
            )
        )


def _chain_time(bench, impl: str, tiles, opts) -> float:
    return chain_seconds(lambda n: jax_chain(bench, impl, tiles, n), opts.iters, opts.warmup)


def peer_seconds(model: Model, batch: int, tokens: int, opts) -> float:
    """Time a peer kernel in a child process (``--peer``), so that a fault in it (an illegal
    address poisons the CUDA context) cannot end this run."""
    command = [
        sys.executable,
        "-m",
        "lazyspec.bench.kernels",
        "--peer",
        f"{model.name},{batch},{tokens}",
        "--iters",
        str(opts.iters),
        "--warmup",
        str(opts.warmup),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    for line in done.stdout.splitlines():
        if line.startswith("PEER_SECONDS "):
            return float(line.split()[1])
    output = (done.stderr or done.stdout or "no output").strip()
    raise RuntimeError(f"peer exited {done.returncode}:\n{output}")


def run_peer(spec: str, opts) -> int:
    """The child side of ``peer_seconds``: prints PEER_SECONDS for model,batch,tokens."""
    name, batch, tokens = spec.split(",")
    model = next(m for m in models(False) if m.name == name)
    seconds_of = EXTERNAL[model.mixer][2]
    print(f"PEER_SECONDS {seconds_of(model, int(batch), int(tokens), opts.iters, opts.warmup)}")
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench_kernels.md"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU)")
    parser.add_argument("--iters", type=int, default=None, help="timed calls (default 50)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up calls (default 5)")
    parser.add_argument(
        "--kernels",
        default="state,ceiling,chunk,conv,scatter,external",
        help="comma list of state, ceiling (the decode traffic alone), chunk "
        "(prefill forms), conv, scatter, external",
    )
    parser.add_argument(
        "--prefill-len",
        type=int,
        default=None,
        help="tokens per row of the chunk benchmark (default 4096)",
    )
    parser.add_argument(
        "--prefill-batches",
        default=None,
        help="comma list of rows for the chunk benchmark (default 1,8)",
    )
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        help="chunk of the chunked prefill forms (default 64)",
    )
    parser.add_argument("--models", default=None, help="comma list of model names")
    parser.add_argument("--batches", default=None, help="comma list (default 1,16,64,256)")
    parser.add_argument("--tokens", default=None, help="comma list (default 1,4)")
    parser.add_argument(
        "--tiles",
        action="append",
        default=[],
        metavar="KIND:SPEC",
        help="replace the Pallas tile list of a kernel kind (state, also "
        "used by ceiling; conv, scatter) for every model, e.g. "
        "'state:block_value=64,num_warps=4;"
        "block_value=32,num_warps=8,evict_last=true'; repeatable",
    )
    parser.add_argument("--peer", default=None, help=argparse.SUPPRESS)  # child process
    args = parser.parse_args(argv)
    args.interpret = args.smoke or jax.default_backend() == "cpu"
    args.iters = args.iters or (3 if args.smoke else 50)
    args.warmup = args.warmup or (1 if args.smoke else 5)
    batches = args.batches or ("3" if args.smoke else "1,16,64,256")
    args.batches = [int(b) for b in batches.split(",")]
    args.tokens = [int(t) for t in (args.tokens or ("1,2" if args.smoke else "1,4")).split(",")]
    args.tiles = dict(parse_tiles(spec) for spec in args.tiles)
    args.prefill_len = args.prefill_len or (40 if args.smoke else 4096)
    prefill_batches = args.prefill_batches or ("2" if args.smoke else "1,8")
    args.prefill_batches = [int(b) for b in prefill_batches.split(",")]
    args.chunk_size = args.chunk_size or (16 if args.smoke else 64)
    return args


def parse_tiles(spec: str) -> tuple[str, tuple[dict, ...]]:
    """'state:block_value=64,num_warps=4;block_value=32' -> ("state", ({...}, {...}));
    values are ints (true/false for flags). ValueError names what is wrong."""
    kind, sep, body = spec.partition(":")
    if not sep or kind not in ("state", "conv", "scatter") or not body:
        raise ValueError(
            f"--tiles wants KIND:k=v,...;k=v,... with KIND state|conv|scatter, got {spec!r}"
        )
    tile_list = []
    for entry in body.split(";"):
        tiles = {}
        for item in entry.split(","):
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise ValueError(f"--tiles entry {item!r} in {spec!r} is not key=value")
            value = value.strip().lower()
            tiles[key.strip()] = value == "true" if value in ("true", "false") else int(value)
        tile_list.append(tiles)
    return kind, tuple(tile_list)


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.peer:
        return run_peer(opts.peer, opts)
    device = jax.devices()[0]
    log(
        f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
        f"interpret={opts.interpret}"
    )
    copies = copy_bandwidths((1 << 22) if opts.smoke else (2 << 30), opts.iters, opts.warmup)
    opts.copy_gbs = max(copies.values())
    copy_text = ", ".join(f"{name} {gbs:.1f}" for name, gbs in copies.items())
    log(f"copy bandwidth (GB/s): {copy_text}; using {opts.copy_gbs:.1f}")
    table = Table(
        opts.out,
        (
            f"# Kernel benchmark\n\ndevice {device.device_kind} ({jax.default_backend()}), jax "
            f"{jax.__version__}, interpret={opts.interpret}; copy bandwidth {opts.copy_gbs:.1f} "
            f"GB/s (the best of: {copy_text}); per-call device time from chains of "
            f"{CHAIN_CALLS[0]} and {CHAIN_CALLS[1]} calls (median of {opts.iters} after "
            f"{opts.warmup} each); T=1 decode (in place), "
            f"T>1 verify (every step to scratch); chunk: prefill of T tokens per row (chunk size "
            f"{opts.chunk_size}), the chunked XLA form checked against the scan; scatter over "
            f"{SCATTER_LAYERS} layers; check = max |pallas - xla| / max |xla| over every output."
        ),
    )
    kinds = [k for k in opts.kernels.split(",") if k]
    if opts.smoke or jax.default_backend() != "gpu":
        kinds = [k for k in kinds if k != "external"]  # torch kernels need CUDA
    for model in models(opts.smoke):
        if opts.models and model.name not in opts.models.split(","):
            continue
        for kind in kinds:
            prefill = kind == "chunk"
            token_list = {"chunk": [opts.prefill_len], "ceiling": [1]}.get(kind, opts.tokens)
            for batch in opts.prefill_batches if prefill else opts.batches:
                for tokens in token_list:
                    log(f"== {kind} {model.name} B={batch} T={tokens}")
                    with jax.default_matmul_precision("highest"):  # float32 dots in XLA forms
                        run_shape(kind, model, batch, tokens, opts, table)
    log(f"wrote {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
