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

    python scripts/bench_moe.py --out moe.md          # on a GPU
    python scripts/bench_moe.py --smoke --out smoke.md  # CPU: tiny widths, interpret mode

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
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for torch

import jax
import jax.numpy as jnp
import numpy as np

from lazyspec.bench.kernel_timing import (
    CHAIN_CALLS,
    chain_seconds,
    copy_bandwidths,
    log,
    max_abs_diff,
)
from lazyspec.kernels.backend import DEFAULT_MOE_TILES, pallas_compiler_params
from lazyspec.kernels.moe_experts import moe_experts_pallas
from lazyspec.models.layers.moe import grouped_experts

ROUTINGS = 8
COLUMNS = ("model", "N", "impl", "tiles", "check", "time us", "routed MB", "floor us", "% floor")


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
TILE_KEYS = ("block_rows", "block_inner", "block_out", "block_k")
KERNEL_TILES = (  # the dispatch's defaults first
    DEFAULT_MOE_TILES,
    {**DEFAULT_MOE_TILES, "block_inner": 64},
    {**DEFAULT_MOE_TILES, "block_out": 64, "block_k": 64},
    {**DEFAULT_MOE_TILES, "num_warps": 8},
)
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


def run_width(width: Width, num_tokens: int, opts, rows: list[dict]) -> None:
    x, weights, ids, stacks = make_inputs(width, num_tokens)
    moved = routed_bytes(width, np.asarray(ids))
    floor = moved / (opts.copy_gbs * 1e9)
    reference = jax.jit(lambda *a: grouped(*a, {}))(x, weights[0], ids[0], stacks)
    impls = [
        ("pallas", functools.partial(kernel, tiles=t, interpret=opts.interpret), t)
        for t in opts.tiles
    ]
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


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench_moe.md"))
    parser.add_argument("--smoke", action="store_true", help="tiny widths, interpret mode (CPU)")
    parser.add_argument("--tokens", default=None, help="comma list (default 1,16,64,256)")
    parser.add_argument("--models", default=None, help="comma list of width names")
    parser.add_argument("--iters", type=int, default=None, help="timed runs (default 30)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up runs (default 3)")
    args = parser.parse_args(argv)
    args.interpret = args.smoke or jax.default_backend() == "cpu"
    args.tokens = [
        int(n) for n in (args.tokens or ("1,3" if args.smoke else "1,16,64,256")).split(",")
    ]
    args.iters = args.iters or (2 if args.smoke else 30)
    args.warmup = args.warmup or (1 if args.smoke else 3)
    args.tiles = SMOKE_TILES if args.smoke else KERNEL_TILES
    widths = SMOKE_WIDTHS if args.smoke else WIDTHS
    args.widths = [w for w in widths if not args.models or w.name in args.models.split(",")]
    return args


def main(argv=None) -> int:
    opts = parse_args(argv)
    device = jax.devices()[0]
    log(f"device: {device.device_kind} ({jax.default_backend()}), interpret={opts.interpret}")
    copies = copy_bandwidths((1 << 22) if opts.smoke else (2 << 30), opts.iters, opts.warmup)
    opts.copy_gbs = max(copies.values())
    copy_text = ", ".join(f"{name} {gbs:.1f}" for name, gbs in copies.items())
    log(f"copy bandwidth (GB/s): {copy_text}; using {opts.copy_gbs:.1f}")
    header = (
        f"# Routed MoE experts\n\ndevice {device.device_kind} ({jax.default_backend()}), jax "
        f"{jax.__version__}, interpret={opts.interpret}; copy bandwidth {opts.copy_gbs:.1f} GB/s "
        f"(the best of: {copy_text}); per-call device time from chains of {CHAIN_CALLS[0]} and "
        f"{CHAIN_CALLS[1]} calls (median of {opts.iters} after {opts.warmup}); routed MB: "
        f"weights of the distinct experts routed (mean of {ROUTINGS} random routings); floor: "
        "those bytes at the copy bandwidth; check: max |form - grouped_experts| / max |ref|."
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
