"""Weight layouts of a few tokens' products: column strips against contiguous rows.

A decode step multiplies a few token rows by weights it reads once, so its products run at
the speed their weight reads stream. The routed-experts kernel and the dense layers keep
weights ``[in, out]`` (``x @ W``): a program computing ``block`` output columns reads a
strip of ``block`` columns, ``block * 2`` bytes of each row. Checkpoints store ``[out,
in]``: the same program then reads whole contiguous rows. This benchmark times one loop of
each form over the same bytes, so the layout question is answered before any stack changes.

Cases, each checked against a float32 reference (max |form - ref| / max |ref|):
- ``experts``: a SwiGLU up projection of ``--tokens`` token rows (in a 16-row tile, as the
  kernel's) through ``--experts-used`` of ``--experts`` experts (gate and up stacks),
  a program per (expert, column tile): ``[E, in, out]`` strips (the routed-experts
  kernel's layout and loop) and ``[E, out, in]`` rows. Call i reads expert set i % 24.
- ``dense``: one ``[in, out]`` product (by default a Qwen3-Next GDN ``in_proj_qkvz``,
  2048 -> 12288) in both layouts, by XLA's dot, by the Pallas loop, and by torch's
  ``F.linear`` (cuBLAS, the ``[out, in]`` layout) as the peer; four weight copies in turn.

Device time: the profiler's kernel durations over 24 dispatched calls (run with XLA's
command buffers off, where the profiler names each kernel); torch by chains of calls
captured in CUDA graphs, the difference of two chains' times. Floor: the weight bytes over
the copy bandwidth measured in the same run (torch ``copy_``, else XLA's ``x + 1``). A form
that does not compile or run is a row with no time and its error (the exit status is then
1, as for a form whose check fails).

    XLA_FLAGS=--xla_gpu_enable_command_buffer= python benchmarks/tools/bench_layout.py \
        --out layout.md
    # CPU: tiny widths, interpret mode
    python benchmarks/tools/bench_layout.py --smoke --out smoke.md
    # the dense case alone at GDN out_proj's / attention o_proj's shape
    python benchmarks/tools/bench_layout.py --cases dense --hidden 4096 --dense-out 2048 --out o.md
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for torch

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from lazyspec.bench.floor import device_ops
from lazyspec.bench.kernel_timing import copy_bandwidths, log, torch_seconds
from lazyspec.bench.origin import code_line
from lazyspec.kernels.common import pallas_compiler_params

ROWS = 16  # the row tile Triton's dots need; the tokens are its first rows
CALLS = 24
COPIES = 4
# (name, block columns, block_k, rows layout, warps, stages)
# the forms both sweeps time after their first (the expert kernel's own tiles)
SHARED_FORMS = (
    ("strips", 64, 256, False, 4, 3),
    ("strips", 128, 128, False, 4, 3),
    ("rows", 64, 128, True, 4, 3),
    ("rows", 64, 256, True, 4, 3),
)
EXPERT_FORMS = (
    ("strips (kernel's)", 64, 128, False, 4, 3),
    *SHARED_FORMS,
    ("rows", 64, 512, True, 4, 2),  # 3 stages ask 288 KiB of shared memory: Hopper has 227
    ("rows", 32, 256, True, 4, 3),
    ("rows", 64, 256, True, 8, 3),
)
DENSE_FORMS = (
    ("strips", 64, 128, False, 4, 3),
    *SHARED_FORMS,
    ("rows", 32, 512, True, 4, 3),
    ("rows", 64, 512, True, 4, 3),
    # narrow tiles: a product of few output columns (GDN out_proj, attention o_proj: 4096 ->
    # 2048) has few programs at 64 columns, where XLA splits the contraction instead
    ("rows", 16, 512, True, 4, 3),
    ("rows", 16, 1024, True, 4, 3),
    ("strips", 16, 256, False, 4, 3),
)


def _product(xs, w, rows_layout: bool):
    """``xs [R, k] @ block``: ``w`` is ``[k, n]`` (strips) or ``[n, k]`` (rows)."""
    dims = (((1,), (1,)), ((), ())) if rows_layout else (((1,), (0,)), ((), ()))
    return jax.lax.dot_general(xs, w, dims, preferred_element_type=jnp.float32)


def _expert_kernel(ids_ref, x_ref, gate_ref, up_ref, out_ref, *, block, block_k, rows_layout):
    expert = ids_ref[pl.program_id(0)]
    cols = pl.ds(pl.program_id(1) * block, block)

    def step(i, accs):
        chunk = pl.ds(i * block_k, block_k)
        xs = x_ref[:, chunk]
        blocks = (
            ref[expert, cols, chunk] if rows_layout else ref[expert, chunk, cols]
            for ref in (gate_ref, up_ref)
        )
        return tuple(acc + _product(xs, w, rows_layout) for acc, w in zip(accs, blocks))

    zeros = jnp.zeros((ROWS, block), jnp.float32)
    gate, up = jax.lax.fori_loop(0, x_ref.shape[1] // block_k, step, (zeros, zeros))
    out_ref[...] = (gate / (1.0 + jnp.exp(-gate)) * up).astype(out_ref.dtype)


def _dense_kernel(x_ref, w_ref, out_ref, *, block, block_k, rows_layout):
    cols = pl.ds(pl.program_id(0) * block, block)

    def step(i, acc):
        chunk = pl.ds(i * block_k, block_k)
        w = w_ref[cols, chunk] if rows_layout else w_ref[chunk, cols]
        return acc + _product(x_ref[:, chunk], w, rows_layout)

    acc = jax.lax.fori_loop(0, x_ref.shape[1] // block_k, step, jnp.zeros((ROWS, block)))
    out_ref[...] = acc.astype(out_ref.dtype)


def _options(opts, warps: int, stages: int) -> dict:
    params = None if opts.interpret else pallas_compiler_params("gpu", warps, stages)
    return {"interpret": opts.interpret, "compiler_params": params}


def expert_form(opts, block, block_k, rows_layout, warps, stages):
    width, used = opts.inner, opts.experts_used

    def pallas_experts(ids, x, gate, up):
        return pl.pallas_call(
            functools.partial(
                _expert_kernel, block=block, block_k=block_k, rows_layout=rows_layout
            ),
            grid=(used, width // block),
            out_specs=pl.BlockSpec((ROWS, block), lambda t, j: (t, j)),
            out_shape=jax.ShapeDtypeStruct((used * ROWS, width), jnp.bfloat16),
            name="layout_experts",
            **_options(opts, warps, stages),
        )(ids, x, gate, up)

    return pallas_experts


def dense_form(opts, block, block_k, rows_layout, warps, stages):
    def pallas_dense(x, w):
        return pl.pallas_call(
            functools.partial(_dense_kernel, block=block, block_k=block_k, rows_layout=rows_layout),
            grid=(opts.dense_out // block,),
            out_specs=pl.BlockSpec((ROWS, block), lambda j: (0, j)),
            out_shape=jax.ShapeDtypeStruct((ROWS, opts.dense_out), jnp.bfloat16),
            name="layout_dense",
            **_options(opts, warps, stages),
        )(x, w)

    return pallas_dense


def profiled_us(fn, calls: list[tuple]) -> float:
    """Microseconds a call: the profiler's kernel durations of ``fn`` over the calls."""
    compiled = jax.jit(fn).lower(*calls[0]).compile()
    jax.block_until_ready([compiled(*a) for a in calls])
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            jax.block_until_ready([compiled(*a) for a in calls])
        ops = device_ops(trace_dir, compiled.as_text(), fn.__name__)
    if not ops:
        raise RuntimeError(f"no kernels of {fn.__name__} in the trace: command buffers on?")
    return sum(op["s"] for op in ops) / len(calls) * 1e6


def relative_error(got, ref) -> float:
    got = np.asarray(jnp.asarray(got, jnp.float32))
    return float(np.max(np.abs(got - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


def tokens_tile(opts, width: int, key) -> jax.Array:
    rows = jax.random.normal(key, (opts.tokens, width), jnp.float32).astype(jnp.bfloat16)
    return jnp.zeros((ROWS, width), jnp.bfloat16).at[: opts.tokens].set(rows)


def row(case, form, tiles, us, moved, opts, check) -> dict:
    floor = moved / (opts.copy_gbs * 1e9) * 1e6
    return {
        "case": case,
        "form": form,
        "tiles": tiles,
        "us": us,
        "floor_us": floor,
        "gbs": moved / (us * 1e-6) / 1e9,
        "check": check,
    }


def failed_row(case, form, tiles, moved, opts, exc: Exception) -> dict:
    """A form that did not compile or run: a row with no time, the error's first line as
    its check (the whole message is in the log)."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    failed = row(case, form, tiles, float("nan"), moved, opts, "")
    failed["check"] = f"FAILED {type(exc).__name__}: {message}".replace("|", "/")
    return failed


def check_text(error: float, tol: float) -> str:
    return f"ok {error:.1e}" if error <= tol else f"MISMATCH {error:.1e}"


def run_experts(opts, rows: list[dict]) -> None:
    e, d, n, used = opts.experts, opts.hidden, opts.inner, opts.experts_used
    key = jax.random.key(0)
    gate, up = (
        (0.02 * jax.random.normal(jax.random.fold_in(key, i), (e, d, n))).astype(jnp.bfloat16)
        for i in (1, 2)
    )
    by_rows = tuple(jnp.swapaxes(w, 1, 2).copy() for w in (gate, up))
    x = tokens_tile(opts, d, jax.random.fold_in(key, 3))
    rng = np.random.default_rng(0)
    id_sets = [jnp.asarray(rng.permutation(e)[:used], jnp.int32) for _ in range(CALLS)]
    ids0 = np.asarray(id_sets[0])
    xf, gf, uf = (np.asarray(a, np.float32) for a in (x, gate, up))
    g, u = np.einsum("rd,edn->ern", xf, gf[ids0]), np.einsum("rd,edn->ern", xf, uf[ids0])
    ref = (g / (1.0 + np.exp(-g)) * u).reshape(used * ROWS, n)
    moved = 2 * used * d * n * 2
    for name, block, block_k, rows_layout, warps, stages in opts.expert_forms:
        fn = expert_form(opts, block, block_k, rows_layout, warps, stages)
        weights = by_rows if rows_layout else (gate, up)
        tiles = f"{block} cols, block_k {block_k}, {warps} warps, {stages} stages"
        label = f"{name} {'[E, out, in]' if rows_layout else '[E, in, out]'}"
        try:
            error = relative_error(jax.jit(fn)(id_sets[0], x, *weights), ref)
            us = profiled_us(fn, [(ids, x, *weights) for ids in id_sets])
        except Exception as exc:  # noqa: BLE001 - a form that fails to compile is a row
            log(f"experts {label} {tiles}: {type(exc).__name__}: {exc}")
            rows.append(failed_row("experts", label, tiles, moved, opts, exc))
            continue
        rows.append(row("experts", label, tiles, us, moved, opts, check_text(error, opts.tol)))
        log(f"experts {label} {tiles}: {us:.2f} us")


def run_dense(opts, rows: list[dict]) -> None:
    d, n = opts.hidden, opts.dense_out
    key = jax.random.key(1)
    ws = [
        (0.02 * jax.random.normal(jax.random.fold_in(key, i), (d, n))).astype(jnp.bfloat16)
        for i in range(COPIES)
    ]
    by_rows = [w.T.copy() for w in ws]
    x = tokens_tile(opts, d, jax.random.fold_in(key, 9))
    ref = np.asarray(x, np.float32) @ np.asarray(ws[0], np.float32)
    moved = d * n * 2

    def xla_strips(x, w):
        return jnp.dot(x, w, preferred_element_type=jnp.float32)

    def xla_rows(x, w):
        return jax.lax.dot_general(
            x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )

    forms = [
        ("XLA dot [in, out]", "", xla_strips, False),
        ("XLA dot [out, in]", "", xla_rows, True),
    ]
    for name, block, block_k, rows_layout, warps, stages in opts.dense_forms:
        label = f"Pallas {name} {'[out, in]' if rows_layout else '[in, out]'}"
        tiles = f"{block} cols, block_k {block_k}, {warps} warps, {stages} stages"
        forms.append(
            (
                label,
                tiles,
                dense_form(opts, block, block_k, rows_layout, warps, stages),
                rows_layout,
            )
        )
    for label, tiles, fn, rows_layout in forms:
        weights = by_rows if rows_layout else ws
        try:
            error = relative_error(jax.jit(fn)(x, weights[0]), ref)
            us = profiled_us(fn, [(x, weights[i % COPIES]) for i in range(CALLS)])
        except Exception as exc:  # noqa: BLE001
            log(f"dense {label} {tiles}: {type(exc).__name__}: {exc}")
            rows.append(failed_row("dense", label, tiles, moved, opts, exc))
            continue
        rows.append(row("dense", label, tiles, us, moved, opts, check_text(error, opts.tol)))
        log(f"dense {label} {tiles}: {us:.2f} us")
    peer = torch_linear(opts, x, ws, ref, moved)
    if peer is not None:
        rows.append(peer)


def torch_linear(opts, x, ws, ref, moved) -> dict | None:
    """The peer: torch's ``F.linear`` (cuBLAS) over ``[out, in]`` copies of the weights, the
    token rows only, timed as chains of calls in CUDA graphs (``torch_seconds``: the
    difference of two chains' times, so host dispatch and launch gaps do not count, as the
    profiler's kernel durations leave them out of the other rows); None without torch or a
    GPU."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None

    def on_gpu(a):
        return torch.from_numpy(np.asarray(a, np.float32)).to("cuda", torch.bfloat16)

    weights = [on_gpu(np.asarray(w, np.float32).T.copy()) for w in ws]
    tokens = on_gpu(np.asarray(x, np.float32)[: opts.tokens])
    got = torch.nn.functional.linear(tokens, weights[0]).float().cpu().numpy()
    error = relative_error(got, ref[: opts.tokens])

    def make_call(i):
        return functools.partial(torch.nn.functional.linear, tokens, weights[i % COPIES])

    us = torch_seconds(make_call, 10, 3) * 1e6
    form = "torch F.linear [out, in] (peer)"
    return row("dense", form, "", us, moved, opts, check_text(error, opts.tol))


def write_table(path: Path, header: str, rows: list[dict]) -> None:
    lines = [
        header,
        "",
        "| case | form | tiles | us | GB/s | floor us | % floor | check |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        timed = math.isfinite(r["us"])
        us, gbs = (f"{r['us']:.2f}", f"{r['gbs']:.0f}") if timed else ("-", "-")
        pct = f"{100 * r['floor_us'] / r['us']:.0f}" if timed else "-"
        lines.append(
            f"| {r['case']} | {r['form']} | {r['tiles']} | {us} | {gbs} | "
            f"{r['floor_us']:.2f} | {pct} | {r['check']} |"
        )
    path.write_text("\n".join(lines) + "\n")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench_layout.md"))
    parser.add_argument("--smoke", action="store_true", help="tiny widths, interpret mode (CPU)")
    parser.add_argument("--tokens", type=int, default=2, help="token rows (of the 16-row tile)")
    parser.add_argument("--experts", type=int, default=None, help="experts (default 64)")
    parser.add_argument("--experts-used", type=int, default=11, help="experts a call reads")
    parser.add_argument("--hidden", type=int, default=None, help="contraction (default 2048)")
    parser.add_argument("--inner", type=int, default=None, help="expert columns (default 512)")
    parser.add_argument("--dense-out", type=int, default=None, help="dense columns (12288)")
    parser.add_argument(
        "--cases",
        default="experts,dense",
        help="comma-separated cases to run: experts, dense (default both)",
    )
    args = parser.parse_args(argv)
    args.cases = [case for case in args.cases.split(",") if case]
    unknown = sorted(set(args.cases) - {"experts", "dense"})
    if unknown or not args.cases:
        parser.error(f"--cases takes experts and / or dense, not {', '.join(unknown) or 'none'}")
    args.interpret = args.smoke or jax.default_backend() == "cpu"
    small = args.interpret
    args.experts = args.experts or (8 if small else 64)
    args.experts_used = min(args.experts_used, args.experts) if not small else 3
    args.hidden = args.hidden or (256 if small else 2048)
    args.inner = args.inner or (128 if small else 512)
    args.dense_out = args.dense_out or (256 if small else 12288)
    args.tokens = min(max(args.tokens, 1), ROWS)
    args.tol = 2e-2  # bf16 inputs, float32 sums in another order

    def shrink(forms):  # every third form, tiles that divide the tiny widths
        return [(f[0], min(f[1], 64), min(f[2], 128), *f[3:]) for f in forms[::3]]

    args.expert_forms = shrink(EXPERT_FORMS) if small else EXPERT_FORMS
    args.dense_forms = shrink(DENSE_FORMS) if small else DENSE_FORMS
    return args


def main(argv=None) -> int:
    opts = parse_args(argv)
    origin = code_line()
    log(origin)
    device = jax.devices()[0]
    log(f"device: {device.device_kind} ({jax.default_backend()}), interpret={opts.interpret}")
    size = (1 << 22) if opts.interpret else (2 << 30)
    copies = copy_bandwidths(size, 3 if opts.interpret else 20, 1 if opts.interpret else 3)
    opts.copy_gbs = copies.get("torch copy_", max(copies.values()))
    copy_text = ", ".join(f"{name} {gbs:.1f}" for name, gbs in copies.items())
    log(f"copy bandwidth (GB/s): {copy_text}; using {opts.copy_gbs:.1f}")
    header = (
        f"# Weight layouts\n\ndevice {device.device_kind} ({jax.default_backend()}), jax "
        f"{jax.__version__}, interpret={opts.interpret}; {opts.tokens} token rows; experts: "
        f"{opts.experts_used} of {opts.experts}, {opts.hidden} -> {opts.inner} (gate and up); "
        f"dense: {opts.hidden} -> {opts.dense_out}; copy bandwidth {opts.copy_gbs:.1f} GB/s "
        f"({copy_text}); floor: the weight bytes at it; device time: the profiler's kernel "
        f"durations over {CALLS} calls (torch: chains of calls in CUDA graphs).\n\n{origin}"
    )
    rows: list[dict] = []
    expected = 0
    if "experts" in opts.cases:
        run_experts(opts, rows)
        write_table(opts.out, header, rows)
        expected += len(opts.expert_forms)
    if "dense" in opts.cases:
        run_dense(opts, rows)
        write_table(opts.out, header, rows)
        expected += len(opts.dense_forms) + 2
    bad = [r for r in rows if not r["check"].startswith("ok")]
    return 1 if bad or len([r for r in rows if "peer" not in r["form"]]) < expected else 0


if __name__ == "__main__":
    raise SystemExit(main())
