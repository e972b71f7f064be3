"""Benchmark decode attention over the KV pools: the paged Pallas kernel against the masked jnp
form, cuDNN (``jax.nn.dot_product_attention`` on contiguous K/V) and torch's
``scaled_dot_product_attention`` (in a child process), with the KV bytes each call must read
and the copy bandwidth measured in the same run; writes a markdown table (and a plot when
matplotlib is there).

Shapes are Qwen3-Next's attention (16 query heads, 2 kv heads, head dim 256, bf16), one query
token per row (decode), every row at the full context. The pool holds each row's context in
its own rows (``table[b, c] = 1 + b * C + c``; row 0 is the sink), so the contiguous forms
see the same K/V. "jnp@max" is the jnp form over a table as wide as the largest context of
the run (the rest pointing at the sink), as the engine's table is sized by its configured
maximum context: its cost follows that width, the kernel's the context. The kernel runs as
the engine's ``Kernels`` give it. ``--smoke`` is tiny and runs the kernel in interpret mode
(CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave memory to torch

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from lazyspec.bench.kernel_timing import (  # noqa: E402
    chain_seconds,
    copy_bandwidths,
    log,
    max_abs_diff,
    time_calls,
)
from lazyspec.kernels.attention import paged as pa  # noqa: E402
from lazyspec.kernels.attention.inputs import PagedInputs  # noqa: E402
from lazyspec.kernels.backend import kernels_for  # noqa: E402


@dataclass(frozen=True)
class Shape:
    """One case: ``batch`` rows of ``context`` positions, one query token each."""

    batch: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def kv_bytes(self) -> int:
        """K and V bytes a call must read (bf16): every row's whole context."""
        return 2 * self.batch * self.context * self.num_kv_heads * self.head_dim * 2

    @property
    def dims(self) -> tuple[int, int, int, int, int]:
        """(batch, context, num_heads, num_kv_heads, head_dim)."""
        return self.batch, self.context, self.num_heads, self.num_kv_heads, self.head_dim


def make_inputs(shape: Shape, table_len: int, seed: int = 0) -> dict[str, jax.Array]:
    """q, the pools, the table, ctx_len and positions of a decode step at full context, and
    the table padded with the sink row to ``table_len`` ("wide_table")."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    b, c, hq, hkv, d = shape.dims
    pool_shape = (b * c + 1, hkv, d)
    table = (1 + jnp.arange(b * c, dtype=jnp.int32)).reshape(b, c)
    return {
        "q": jax.random.normal(keys[0], (b, 1, hq, d), jnp.bfloat16),
        "k_pool": jax.random.normal(keys[1], pool_shape, jnp.bfloat16),
        "v_pool": jax.random.normal(keys[2], pool_shape, jnp.bfloat16),
        "table": table,
        "wide_table": jnp.pad(table, ((0, 0), (0, table_len - c))),
        "ctx_len": jnp.full((b,), c, jnp.int32),
        "positions": jnp.full((b, 1), c - 1, jnp.int32),
    }


def attention_fns(shape: Shape) -> dict:
    """name -> fn(q, inputs) -> out [B, 1, Hq, D]; the contiguous forms view the pool rows
    1.. as ``[B, C, Hkv, D]``."""
    scale = shape.head_dim**-0.5
    kernel = kernels_for("pallas").paged_attention

    def paged(q, x, table):
        return PagedInputs(q, x["k_pool"], x["v_pool"], x[table], x["ctx_len"], x["positions"])

    def pallas(q, x):
        return kernel(paged(q, x, "wide_table"), scale)

    def jnp_form(q, x, table="table"):
        return pa.paged_attention_reference(paged(q, x, table), scale)

    def cudnn(q, x):
        lead = (shape.batch, shape.context, shape.num_kv_heads, shape.head_dim)
        k, v = (x[name][1:].reshape(lead) for name in ("k_pool", "v_pool"))
        return jax.nn.dot_product_attention(
            q, k, v, scale=scale, key_value_seq_lengths=x["ctx_len"], implementation="cudnn"
        )

    fns = {"pallas": pallas, "jnp": jnp_form}
    fns["jnp@max"] = lambda q, x: jnp_form(q, x, "wide_table")
    if jax.default_backend() == "gpu":
        fns["cudnn"] = cudnn
    return fns


def jax_seconds(fn, inputs: dict, iters: int, warmup: int) -> float:
    """Device seconds per call by ``chain_seconds``: each call's output is the next call's
    query (a chain no compiler can shorten), one program per chain length."""

    def make_chain(calls: int):
        def many(q, x):
            for _ in range(calls):
                q = fn(q, x)
            return q

        many = jax.jit(many)
        return lambda: many(inputs["q"], inputs).block_until_ready()

    return chain_seconds(make_chain, iters, warmup)


def torch_seconds_in_child(shape: Shape, iters: int, warmup: int) -> float:
    """torch SDPA on contiguous K/V ``[B, Hkv, C, D]`` (GQA) timed in a child process, so that
    its memory and any fault stay out of this one."""
    command = [
        sys.executable,
        "-m",
        "lazyspec.bench.attention",
        "--peer",
        json.dumps(shape.__dict__),
        "--iters",
        str(iters),
        "--warmup",
        str(warmup),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    for line in done.stdout.splitlines():
        if line.startswith("PEER_SECONDS "):
            return float(line.split()[1])
    lines = (done.stderr or done.stdout or "no output").strip().splitlines()
    raise RuntimeError(f"torch child exited {done.returncode}: {lines[-1][:100]}")


def run_peer(spec: str, iters: int, warmup: int) -> int:
    """The child side of ``torch_seconds_in_child``: prints PEER_SECONDS."""
    import torch
    import torch.nn.functional as F

    shape = Shape(**json.loads(spec))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    b, c, hq, hkv, d = shape.dims
    q = torch.randn(b, hq, 1, d, device=device, dtype=torch.bfloat16)
    k = torch.randn(b, hkv, c, d, device=device, dtype=torch.bfloat16)
    v = torch.randn(b, hkv, c, d, device=device, dtype=torch.bfloat16)
    call = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    if device == "cuda":
        from lazyspec.bench.kernel_timing import torch_seconds

        seconds = torch_seconds(lambda i: call, iters, warmup)
    else:
        seconds = time_calls(call, iters, warmup)
    print(f"PEER_SECONDS {seconds}")
    return 0


def check(fns: dict, inputs: dict) -> str:
    """max |pallas - jnp| / max |jnp| on these inputs ("MISMATCH" past 1e-2, bf16); the
    kernel reads the wide table, the jnp form the exact one."""
    got = jax.jit(fns["pallas"])(inputs["q"], inputs)
    want = jax.jit(fns["jnp"])(inputs["q"], inputs)
    error = max_abs_diff(got, want) / max(max_abs_diff(want, jnp.zeros((), want.dtype)), 1e-30)
    return f"{'ok' if error <= 1e-2 else 'MISMATCH'} {error:.1e}"


def bench_shape(shape: Shape, table_len: int, opts) -> dict:
    """Seconds per call of every form (None where it failed), and the check."""
    inputs = make_inputs(shape, table_len)
    fns = attention_fns(shape)
    result = {"check": check(fns, inputs)}
    for name, fn in fns.items():
        if name == "jnp@max" and table_len == shape.context:
            result[name] = result["jnp"]  # the same program
            continue
        try:
            result[name] = jax_seconds(fn, inputs, opts.iters, opts.warmup)
        except Exception as error:  # a form that does not apply here (cuDNN limits, memory)
            log(f"  {name}: {type(error).__name__}: {str(error)[:120]}")
            result[name] = None
    del inputs
    if opts.torch:
        try:
            result["torch"] = torch_seconds_in_child(shape, opts.iters, opts.warmup)
        except Exception as error:
            log(f"  torch: {error}")
            result["torch"] = None
    return result


FORMS = ("pallas", "jnp", "jnp@max", "cudnn", "torch")


def table_lines(rows: list[tuple[Shape, dict]], copy_gbs: float) -> list[str]:
    """The markdown table: time per form, and the kernel's GB/s and share of the copy."""
    head = "| context | batch | KV MB | check | " + " | ".join(f"{f} us" for f in FORMS)
    lines = [head + " | pallas GB/s | pallas / copy |", "|" + "---|" * (len(FORMS) + 6)]
    for shape, result in rows:
        times = [result.get(f) for f in FORMS]
        cells = ["n/a" if t is None else f"{t * 1e6:.1f}" for t in times]
        pallas = result.get("pallas")
        gbs = shape.kv_bytes / pallas / 1e9 if pallas else None
        share = "n/a" if gbs is None else f"{gbs / copy_gbs:.0%}"
        lines.append(
            f"| {shape.context} | {shape.batch} | {shape.kv_bytes / 1e6:.1f} | {result['check']} "
            f"| {' | '.join(cells)} | {'n/a' if gbs is None else f'{gbs:.0f}'} | {share} |"
        )
    return lines


def plot(rows: list[tuple[Shape, dict]], path: Path) -> None:
    """Time per call against context, one panel per batch (skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    batches = sorted({shape.batch for shape, _ in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        mine = [(s, r) for s, r in rows if s.batch == batch]
        for form in FORMS:
            points = [(s.context, r[form] * 1e6) for s, r in mine if r.get(form)]
            if points:
                ax.plot(*zip(*points), marker="o", label=form)
        ax.set(xscale="log", yscale="log", xlabel="context", ylabel="us per call")
        ax.set_title(f"decode attention, batch {batch}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench_attention.md"))
    parser.add_argument("--plot", type=Path, default=None, help="PNG (default: --out's stem)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU)")
    parser.add_argument("--contexts", default=None, help="comma list (default 4096,32768,131072)")
    parser.add_argument("--batches", default=None, help="comma list (default 1,16)")
    parser.add_argument("--iters", type=int, default=None, help="timed runs (default 20)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up runs (default 3)")
    parser.add_argument("--no-torch", dest="torch", action="store_false", help="skip torch")
    parser.add_argument("--peer", default=None, help=argparse.SUPPRESS)  # child process
    args = parser.parse_args(argv)
    args.interpret = jax.default_backend() == "cpu"  # the dispatch interprets there
    args.iters = args.iters or (2 if args.smoke else 20)
    args.warmup = args.warmup or (1 if args.smoke else 3)
    contexts = args.contexts or ("100" if args.smoke else "4096,32768,131072")
    args.contexts = [int(c) for c in contexts.split(",")]
    args.batches = [int(b) for b in (args.batches or ("2" if args.smoke else "1,16")).split(",")]
    args.plot = args.plot or args.out.with_suffix(".png")
    return args


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.peer:
        return run_peer(opts.peer, opts.iters, opts.warmup)
    heads = (4, 2, 64) if opts.smoke else (16, 2, 256)
    device = jax.devices()[0]
    copies = copy_bandwidths((1 << 22) if opts.smoke else (2 << 30), opts.iters, opts.warmup)
    copy_gbs = max(copies.values())
    copy_text = ", ".join(f"{name} {gbs:.1f}" for name, gbs in copies.items())
    log(f"device {device.device_kind}; copy bandwidth (GB/s): {copy_text}")
    rows = []
    for context in opts.contexts:
        for batch in opts.batches:
            shape = Shape(batch, context, *heads)
            log(f"context {context}, batch {batch}")
            rows.append((shape, bench_shape(shape, max(opts.contexts), opts)))
    lines = [
        "# Decode attention",
        "",
        f"device {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
        f"interpret={opts.interpret}; heads {heads[0]} q / {heads[1]} kv, head dim {heads[2]}, "
        f"bf16, one query per row at full context; copy bandwidth {copy_gbs:.1f} GB/s (best "
        f"of: {copy_text}); us = device time per call (chains of calls; torch: CUDA graphs); "
        "check = max |pallas - jnp| / max |jnp|; n/a = the form failed or does not apply.",
        "",
        *table_lines(rows, copy_gbs),
    ]
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text("\n".join(lines) + "\n")
    log("\n".join(lines))
    plot(rows, opts.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
