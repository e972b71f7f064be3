"""Benchmark the routed MoE experts: the Pallas kernel vs ``grouped_experts`` vs dense.

Per model width and token count N it times three forms of the same routed-expert sum
(SwiGLU experts, bf16 weights, float32 result): ``moe_experts_pallas`` (each tile list),
``grouped_experts`` with ``lax.ragged_dot`` (the XLA dispatch: sort, grouped matmuls,
scatter-add) and a dense einsum over all experts (every expert's weights read, the weights
of unrouted ones zero). The kernel is first checked against ``grouped_experts`` on the
device (max |diff| / max |ref|). Device time per call is the difference of the median
times of chains of 2 and 10 calls in one jitted program (``kernel_timing.chain_seconds``);
call i of a chain takes routing i % 8 (top-k of random scores), so successive calls read
different experts where there are many. The floor is the routed experts' weight bytes
(distinct experts routed, mean over the routings) over the copy bandwidth measured in the
same run (bytes read + written, as ``bench_kernels``): "% floor" = floor / time.

``--timing profiler`` times each form by the profiler's kernel durations instead: 24
dispatched calls under ``jax.profiler.trace``, call i with routing i % 8 and weight copy
i % 4 (so no call finds its experts in L2), device time per call = the sum of the form's
kernels over the calls / 24; the kernel's rows also give its up and down launches apart
("up us", "down us"), which is what a tile sweep (``--tiles``) compares. Chains time a few
microseconds' launch with 10-30 us of spread between runs; kernel durations repeat within
about 1 %. Run it with XLA's command buffers off, where the profiler names each kernel
(the script stops otherwise).

    python benchmarks/tools/bench_moe.py --out moe.md          # on a GPU
    XLA_FLAGS=--xla_gpu_enable_command_buffer= python benchmarks/tools/bench_moe.py \
        --timing profiler \
        --models qwen3-next-64e --tokens 1,2,4 --tiles launch,32:128:128:4:3 --no-xla
    # the dispatch's "launch" row with a dispatch constant set (bench_engine's flag): here
    # the down product in its own launch at 1-2 tokens too
    ... --tiles launch --kernel-tuning moe.down_in_up_max_tokens=0
    python benchmarks/tools/bench_moe.py --smoke --out smoke.md  # CPU: tiny widths, interpret mode

Widths (transformers' configuration defaults, which are the named checkpoints'):
Qwen3-Next-80B-A3B (hidden 2048, 512 experts, top-10, expert intermediate 512), the same at
64 experts, and Qwen3.5-35B-A3B (hidden 2048, 256 experts, top-8, 512). Granite-4.0-H and
Nemotron-H are left out: transformers' defaults for those configs are not a released
checkpoint's widths.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for torch

import jax
import jax.numpy as jnp
import numpy as np

from lazyspec.bench.floor import device_ops
from lazyspec.bench.kernel_timing import (
    CHAIN_CALLS,
    chain_seconds,
    copy_bandwidths,
    log,
    max_abs_diff,
)
from lazyspec.bench.origin import code_line
from lazyspec.bench.tuning_flag import add_tuning_argument, tuned, tuning_lines
from lazyspec.kernels.backend import default_tuning
from lazyspec.kernels.common import pallas_compiler_params
from lazyspec.kernels.moe.dispatch import moe_launch
from lazyspec.kernels.moe.experts import moe_experts_pallas
from lazyspec.kernels.tuning import Tuning
from lazyspec.models.layers.moe import grouped_experts

ROUTINGS = 8
COLUMNS = (
    "model",
    "N",
    "impl",
    "tiles",
    "check",
    "time us",
    "routed MB",
    "floor us",
    "% floor",
    "up us",
    "down us",
)
PROFILED_CALLS, WEIGHT_COPIES = 24, 4


@dataclass(frozen=True)
class Width:
    name: str
    hidden: int
    num_experts: int
    top_k: int
    inner: int


WIDTHS = (
    Width("qwen3-next", 2048, 512, 10, 512),
    Width("qwen3-next-64e", 2048, 64, 10, 512),
    Width("qwen3.5-moe", 2048, 256, 8, 512),
)
SMOKE_WIDTHS = (Width("tiny", 64, 8, 2, 32),)
# the kernel's keyword arguments a row passes on; ``down_in_up``: the dispatch's folded form
# (``MoETuning.down_in_up_max_tokens``), carried by the "launch" rows (the routing is given,
# so ``route_in_up`` never applies here)
TILE_KEYS = (
    "block_rows",
    "block_inner",
    "block_out",
    "block_k",
    "block_k_down",
    "down_in_up",
)
LAUNCH = "launch"  # the dispatch's tiles for the row's token count (``moe_launch``)
FOLD = "fold:"  # a --tiles entry's prefix: the folded form (``down_in_up``)
_MOE = Tuning().moe
DEFAULT_MOE_TILES = {
    "block_rows": _MOE.block_rows,
    "block_inner": _MOE.block_inner,
    "block_out": _MOE.block_out,
    "block_k": _MOE.block_k,
    "num_warps": _MOE.num_warps,
    "num_stages": _MOE.num_stages,
}
KERNEL_TILES = (  # the dispatch's first
    LAUNCH,
    {**DEFAULT_MOE_TILES, "block_inner": 32},
    {**DEFAULT_MOE_TILES, "block_out": 64, "block_k": 64},
    {**DEFAULT_MOE_TILES, "num_warps": 8},
)
TILE_FIELDS = ("block_inner", "block_out", "block_k", "num_warps", "num_stages")
DOWN_FIELDS = ("block_k_down", "down_num_stages")  # optional: the down launch's own
SMOKE_TILES = ({"block_rows": 16, "block_inner": 16, "block_out": 32, "block_k": 16},)


def swiglu_ragged(stacks):
    gate, up, down = stacks

    def experts(xs, sizes):
        xs = xs.astype(up.dtype)
        g = jax.lax.ragged_dot(xs, gate, sizes)
        u = jax.lax.ragged_dot(xs, up, sizes)
        return jax.lax.ragged_dot(jax.nn.silu(g) * u, down, sizes)

    return experts


def grouped(x, weights, ids, stacks, tiles):
    return grouped_experts(x, weights, ids, stacks[0].shape[0], swiglu_ragged(stacks))


def dense(x, weights, ids, stacks, tiles):
    """Every expert on every token, weighted by the (mostly zero) dense routing weights."""
    gate, up, down = stacks
    xs = x.astype(up.dtype)
    dense_weights = jnp.sum(jax.nn.one_hot(ids, up.shape[0]) * weights[..., None], axis=1)
    g = jnp.einsum("nd,edi->eni", xs, gate, preferred_element_type=jnp.float32)
    u = jnp.einsum("nd,edi->eni", xs, up, preferred_element_type=jnp.float32)
    h = (jax.nn.silu(g) * u).astype(up.dtype)
    ys = jnp.einsum("eni,eio->eno", h, down, preferred_element_type=jnp.float32)
    return jnp.einsum("ne,eno->no", dense_weights, ys)


def kernel(x, weights, ids, stacks, tiles, interpret=False):
    gate, up, down = stacks
    params = pallas_compiler_params(
        num_warps=tiles.get("num_warps", 4), num_stages=tiles.get("num_stages", 1)
    )
    sizes = {k: tiles[k] for k in TILE_KEYS if k in tiles}
    if "down_num_stages" in tiles:
        sizes["down_compiler_params"] = pallas_compiler_params(
            num_warps=tiles.get("num_warps", 4), num_stages=tiles["down_num_stages"]
        )
    return moe_experts_pallas(
        x, weights, ids, up, down, gate, **sizes, interpret=interpret, compiler_params=params
    )


def make_inputs(width: Width, num_tokens: int, seed: int = 0):
    """x [N, d] bf16, routings (weights [R, N, k], ids [R, N, k]) and the bf16 stacks."""
    rng = np.random.default_rng(seed)
    scores = rng.standard_normal((ROUTINGS, num_tokens, width.num_experts))
    ids = np.argsort(-scores, axis=-1)[..., : width.top_k].astype(np.int32)
    weights = rng.random(ids.shape).astype(np.float32)
    keys = jax.random.split(jax.random.key(seed), 4)
    shapes = [(width.hidden, width.inner)] * 2 + [(width.inner, width.hidden)]
    stacks = tuple(
        (0.02 * jax.random.normal(k, (width.num_experts, *s), jnp.float32)).astype(jnp.bfloat16)
        for k, s in zip(keys[:3], shapes)
    )
    x = jax.random.normal(keys[3], (num_tokens, width.hidden), jnp.float32).astype(jnp.bfloat16)
    return x, jnp.asarray(weights), jnp.asarray(ids), stacks


def routed_bytes(width: Width, ids: np.ndarray) -> float:
    """Weight bytes of the distinct experts routed, mean over the routings (bf16, 3 stacks)."""
    per_expert = 3 * width.hidden * width.inner * 2
    distinct = [len(np.unique(np.asarray(ids[r]))) for r in range(ids.shape[0])]
    return float(np.mean(distinct)) * per_expert


def chain(fn, x, weights, ids, stacks, calls: int):
    """``calls`` calls in one jitted program, call i with routing i % R; one element of each
    result goes into a sink so that no call is dead code."""

    @jax.jit
    def many(x, weights, ids, stacks):
        sink = jnp.zeros((), jnp.float32)
        for i in range(calls):
            r = i % weights.shape[0]
            sink = sink + fn(x, weights[r], ids[r], stacks)[0, 0]
        return sink

    return lambda: many(x, weights, ids, stacks).block_until_ready()


def profiled_seconds(fn, x, weights, ids, copies, calls: int = PROFILED_CALLS):
    """(seconds per call, up seconds, down seconds) from the profiler's kernel durations
    over ``calls`` dispatched calls, call i with routing i % R and weight copy i % C; up and
    down are the kernel's two launches (0 for the XLA forms)."""

    def moe_call(x, weights, ids, stacks):
        return fn(x, weights, ids, stacks)

    args = [
        (x, weights[i % len(weights)], ids[i % len(ids)], copies[i % len(copies)])
        for i in range(calls)
    ]
    compiled = jax.jit(moe_call).lower(*args[0]).compile()  # once: its HLO names the scopes
    jax.block_until_ready([compiled(*a) for a in args])
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            jax.block_until_ready([compiled(*a) for a in args])
        ops = device_ops(trace_dir, compiled.as_text(), "moe_call")
    if not ops:
        raise RuntimeError("no kernels of the call in the trace")

    def part(name: str) -> float:
        return sum(op["s"] for op in ops if name in op["scope"]) / calls

    return sum(op["s"] for op in ops) / calls, part("moe_experts_up"), part("moe_experts_down")


def weight_copies(stacks, count: int):
    """``count`` stacks of the same values in distinct buffers (the first is ``stacks``)."""
    return [stacks] + [tuple(jnp.array(s, copy=True) for s in stacks) for _ in range(count - 1)]


def run_width(width: Width, num_tokens: int, opts, rows: list[dict]) -> None:
    x, weights, ids, stacks = make_inputs(width, num_tokens)
    moved = routed_bytes(width, np.asarray(ids))
    floor = moved / (opts.copy_gbs * 1e9)
    reference = jax.jit(lambda *a: grouped(*a, {}))(x, weights[0], ids[0], stacks)
    copies = weight_copies(stacks, WEIGHT_COPIES) if opts.timing == "profiler" else None
    impls = []
    for tiles in opts.tiles:
        if tiles == LAUNCH:
            launch = moe_launch(num_tokens, stacks[1], stacks[2], opts.interpret, opts.tuning)
            if launch is None:
                continue  # the dispatch runs the XLA form at this count
            tiles = {k: launch[k] for k in TILE_KEYS if launch.get(k)}
            moe = opts.tuning.moe
            folded = launch["down_in_up"]
            tiles["num_warps"] = moe.fold_num_warps if folded else moe.num_warps
            tiles["num_stages"] = moe.fold_num_stages if folded else moe.num_stages
        impls.append(
            ("pallas", functools.partial(kernel, tiles=tiles, interpret=opts.interpret), tiles)
        )
    if opts.xla:
        impls += [
            ("xla grouped_experts", functools.partial(grouped, tiles={}), {}),
            ("xla dense einsum", functools.partial(dense, tiles={}), {}),
        ]
    for impl, fn, tiles in impls:
        row = {
            "model": width.name,
            "N": num_tokens,
            "impl": impl,
            "tiles": ",".join(f"{k}={v}" for k, v in tiles.items()) or "-",
            "routed MB": f"{moved / 1e6:.2f}",
            "floor us": f"{floor * 1e6:.1f}",
        }
        try:
            got = jax.jit(fn)(x, weights[0], ids[0], stacks)
            error = max_abs_diff(got, reference) / max(
                max_abs_diff(reference, 0 * reference), 1e-30
            )
            row["check"] = f"{'ok' if error <= 2e-2 else 'MISMATCH'} {error:.1e}"
            if opts.timing == "profiler":
                seconds, up, down = profiled_seconds(fn, x, weights, ids, copies)
                if impl == "pallas":
                    if not up > 0.0:  # inside a command buffer the profiler names the buffer
                        raise RuntimeError("no named up launch in the trace: command buffers on?")
                    row["up us"], row["down us"] = f"{up * 1e6:.1f}", f"{down * 1e6:.1f}"
            else:
                make_chain = functools.partial(chain, fn, x, weights, ids, stacks)
                seconds = chain_seconds(make_chain, opts.iters, opts.warmup)
            row["time us"] = f"{seconds * 1e6:.1f}"
            row["% floor"] = f"{100 * floor / seconds:.1f}" if seconds > 0 else "-"
        except Exception as error:  # one failing form must not end the run
            row["check"] = f"error: {type(error).__name__}: {str(error).splitlines()[0][:100]}"
        log("  " + "  ".join(f"{c}={row.get(c, '')}" for c in COLUMNS))
        rows.append(row)


def write_table(path: Path, header: str, rows: list[dict]) -> None:
    lines = [header, "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in COLUMNS) + " |" for r in rows]
    path.write_text("\n".join(lines) + "\n")


def parse_tiles(text: str) -> list:
    """``--tiles``: 'launch' or five integers per entry (TILE_FIELDS, block_rows 16), or
    seven with the down launch's own block_k and stages (DOWN_FIELDS); an entry prefixed
    ``fold:`` runs the folded form (``down_in_up``: one launch, the down product inside it;
    block_out is then its down chunk), the dispatch's form up to
    ``MoETuning.down_in_up_max_tokens`` tokens."""
    tiles: list = []
    fields = TILE_FIELDS + DOWN_FIELDS
    for entry in text.split(","):
        if entry == LAUNCH:
            tiles.append(LAUNCH)
            continue
        fold = entry.startswith(FOLD)
        values = entry.removeprefix(FOLD).split(":")
        if len(values) not in (len(TILE_FIELDS), len(fields)) or not all(
            v.isdigit() for v in values
        ):
            raise SystemExit(
                f"--tiles entry {entry!r}: 'launch' or {':'.join(TILE_FIELDS)}[:"
                f"{':'.join(DOWN_FIELDS)}]"
            )
        if fold and len(values) != len(TILE_FIELDS):
            raise SystemExit(f"--tiles entry {entry!r}: a folded entry has no down launch")
        tiles.append(
            {"block_rows": 16}
            | dict(zip(fields, map(int, values)))
            | ({"down_in_up": True} if fold else {})
        )
    return tiles


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench_moe.md"))
    parser.add_argument("--smoke", action="store_true", help="tiny widths, interpret mode (CPU)")
    parser.add_argument("--tokens", default=None, help="comma list (default 1,16,64,256)")
    parser.add_argument("--models", default=None, help="comma list of width names")
    parser.add_argument("--iters", type=int, default=None, help="timed runs (default 30)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up runs (default 3)")
    parser.add_argument(
        "--timing",
        choices=("chain", "profiler"),
        default="chain",
        help="device time per call: chains of calls, or the profiler's kernel durations",
    )
    parser.add_argument(
        "--tiles",
        default=None,
        help="comma list of kernel tiles, each 'launch' (the dispatch's for the token count) "
        "or block_inner:block_out:block_k:num_warps:num_stages[:block_k_down:down_num_stages] "
        "(prefix fold: for the folded form) (default: the built-in list)",
    )
    parser.add_argument("--no-xla", dest="xla", action="store_false", help="the kernel only")
    add_tuning_argument(parser)
    args = parser.parse_args(argv)
    args.interpret = args.smoke or jax.default_backend() == "cpu"
    args.tokens = [
        int(n) for n in (args.tokens or ("1,3" if args.smoke else "1,16,64,256")).split(",")
    ]
    args.iters = args.iters or (2 if args.smoke else 30)
    args.warmup = args.warmup or (1 if args.smoke else 3)
    args.tiles = (
        parse_tiles(args.tiles) if args.tiles else (SMOKE_TILES if args.smoke else KERNEL_TILES)
    )
    widths = SMOKE_WIDTHS if args.smoke else WIDTHS
    args.widths = [w for w in widths if not args.models or w.name in args.models.split(",")]
    return args


def main(argv=None) -> int:
    opts = parse_args(argv)
    origin = code_line()  # before any timing: one tree's code, or a clear error
    log(origin)
    switches = tuning_lines(opts.kernel_tuning)
    opts.tuning = tuned(default_tuning(), opts.kernel_tuning)
    for line in switches:
        log(line)
    device = jax.devices()[0]
    log(f"device: {device.device_kind} ({jax.default_backend()}), interpret={opts.interpret}")
    copies = copy_bandwidths((1 << 22) if opts.smoke else (2 << 30), opts.iters, opts.warmup)
    opts.copy_gbs = max(copies.values())
    copy_text = ", ".join(f"{name} {gbs:.1f}" for name, gbs in copies.items())
    log(f"copy bandwidth (GB/s): {copy_text}; using {opts.copy_gbs:.1f}")
    timing = (
        f"per-call device time from the profiler's kernel durations of {PROFILED_CALLS} calls "
        f"({WEIGHT_COPIES} weight copies)"
        if opts.timing == "profiler"
        else f"per-call device time from chains of {CHAIN_CALLS[0]} and {CHAIN_CALLS[1]} calls "
        f"(median of {opts.iters} after {opts.warmup})"
    )
    header = (
        f"# Routed MoE experts\n\ndevice {device.device_kind} ({jax.default_backend()}), jax "
        f"{jax.__version__}, interpret={opts.interpret}; copy bandwidth {opts.copy_gbs:.1f} GB/s "
        f"(the best of: {copy_text}); {timing}; routed MB: "
        f"weights of the distinct experts routed (mean of {ROUTINGS} random routings); floor: "
        "those bytes at the copy bandwidth; check: max |form - grouped_experts| / max |ref|."
        f"\n\n{origin}" + "".join(f"\n\n{line}" for line in switches)
    )
    rows: list[dict] = []
    for width in opts.widths:
        for num_tokens in opts.tokens:
            log(f"{width.name} N={num_tokens}")
            run_width(width, num_tokens, opts, rows)
            write_table(opts.out, header, rows)
    bad = [r for r in rows if not str(r.get("check", "")).startswith("ok")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
