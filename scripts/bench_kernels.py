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
import dataclasses
import importlib.util
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

try:
    import lazyspec.kernels  # noqa: E402,F401  (installed package)
except ImportError:
    import conftest  # noqa: E402,F401  (maps kernels/ to lazyspec.kernels in a source checkout)
from jax.experimental import pallas as pl  # noqa: E402
from lazyspec.kernels import (  # noqa: E402
    backend, conv_update, gdn_chunked, mamba2_chunked, recurrence, state_scatter, state_update,
)

COLUMNS = ("kernel", "model", "B", "T", "impl", "tiles", "check", "time us", "MB moved",
           "GB/s", "% copy")
SCATTER_LAYERS = 4


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    mixer: str  # "gdn" | "mamba2"
    heads: int
    d_a: int  # GDN d_k, Mamba2 head dim P
    d_b: int  # GDN d_v, Mamba2 state N
    groups: int  # Mamba2 B/C groups (unused by GDN)
    channels: int  # conv channels
    state_tiles: tuple
    conv_tiles: tuple
    scatter_tiles: tuple


def models(smoke: bool) -> list[Model]:
    if smoke:
        return [Model("tiny-gdn", "gdn", 4, 16, 16, 1, 24, ({"block_heads": 2, "block_value": 8},),
                      ({"block_channels": 8},), ({"block_rows": 8, "block_channels": 8},)),
                Model("tiny-mamba2", "mamba2", 4, 8, 16, 2, 40, ({"block_value": 4},),
                      ({"block_channels": 8},), ({"block_rows": 4, "block_channels": 8},))]
    conv = ({"block_channels": 256},)
    scatter = ({"block_rows": 8, "block_channels": 2048},)
    gdn, mamba2 = backend.DEFAULT_STATE_TILES["gdn"], backend.DEFAULT_STATE_TILES["mamba2"]
    return [Model("qwen3-next-80b", "gdn", 32, 128, 128, 1, 8192,
                  (gdn, {"block_value": 32, "num_warps": 4}), conv, scatter),
            Model("nemotron-h-8b", "mamba2", 128, 64, 128, 8, 10240,
                  (mamba2, {"block_value": 16, "num_warps": 4}), conv, scatter)]


@dataclasses.dataclass
class Bench:
    """One kernel at one shape. ``make_args()`` builds fresh device inputs; ``fn(impl, tiles)``
    returns a function of them giving a tuple of arrays; ``thread`` maps output index -> the
    (donated) argument it replaces on the next call."""

    kernel: str
    bytes_moved: int
    make_args: Callable[[], tuple]
    fn: Callable[[str, dict], Callable]
    thread: dict
    slot_arg: int  # the argument holding the slot (or destination) vector
    slot_sets: jax.Array  # [R, B]: call i of a timed chain uses slot_sets[i % R]
    reference: tuple | None = None  # the reference form's outputs on make_args(), once computed
    impls: tuple[str, str] = ("pallas", "xla")  # (checked candidate, reference)


def log(message: str) -> None:
    print(message, flush=True)


def nbytes(*arrays) -> int:
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in arrays)


def normal(key, shape, dtype=jnp.float32, scale=1.0):
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


POOL_BYTES = 1 << 29  # pools of at least 512 MiB (~8x the H200's L2) for timed chains
SLOT_SETS = 8


def slots_for(key, batch: int, slot_bytes: int, smoke: bool = False) -> tuple[int, jax.Array]:
    """(number of slots, [SLOT_SETS, batch] distinct non-null slot sets). The pool holds at
    least 2 * batch + 1 slots and POOL_BYTES, so consecutive calls of a timed chain touch
    different slots and the pool does not fit in the L2."""
    num_slots = 2 * batch + 1 if smoke else max(2 * batch + 1, -(-POOL_BYTES // slot_bytes))
    keys = jax.random.split(key, SLOT_SETS)
    sets = [jax.random.permutation(k, num_slots)[:batch] + 1 for k in keys]
    return num_slots, jnp.stack(sets).astype(jnp.int32)


def pallas_options(interpret: bool, tiles: dict) -> dict:
    tiles = dict(tiles)
    warps, stages = tiles.pop("num_warps", 4), tiles.pop("num_stages", 1)
    params = None if interpret else backend.pallas_compiler_params(num_warps=warps,
                                                                   num_stages=stages)
    return {**tiles, "interpret": interpret, "compiler_params": params}


def token_inputs(model: Model, keys, batch: int, tokens: int):
    """Random per-token inputs of the model's mixer (keys[1..6]): bf16 activations, float32
    gates, normalised GDN keys/queries, negative Mamba2 A."""
    shape, bf16 = (batch, tokens, model.heads), jnp.bfloat16
    if model.mixer == "gdn":
        unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
        return state_update.GdnTokens(
            q=(unit(normal(keys[1], shape + (model.d_a,))) / model.d_a**0.5).astype(bf16),
            k=unit(normal(keys[2], shape + (model.d_a,))).astype(bf16),
            v=normal(keys[3], shape + (model.d_b,), bf16),
            g=-jax.nn.softplus(normal(keys[4], shape)), beta=jax.nn.sigmoid(normal(keys[5], shape)))
    group_shape = (batch, tokens, model.groups, model.d_b)
    return state_update.Mamba2Tokens(
        x=normal(keys[1], shape + (model.d_a,), bf16), b=normal(keys[2], group_shape, bf16),
        c=normal(keys[3], group_shape, bf16), dt=jax.nn.softplus(normal(keys[4], shape)),
        a=-jnp.exp(normal(keys[5], (model.heads,))), d=normal(keys[6], (model.heads,)))


def state_bench(model: Model, batch: int, tokens: int, opts) -> Bench:
    mode = "decode" if tokens == 1 else "verify"
    keys = jax.random.split(jax.random.key(batch * 10 + tokens), 8)
    state_bytes = model.heads * model.d_a * model.d_b * 4
    num_slots, slot_sets = slots_for(keys[0], batch, state_bytes, opts.smoke)
    slot, interpret = slot_sets[0], opts.interpret
    tokens_in = token_inputs(model, keys, batch, tokens)
    if model.mixer == "gdn":
        pallas, xla, out = (state_update.gdn_state_update_pallas,
                            state_update.gdn_state_update_xla, tokens_in.v)
    else:
        pallas, xla, out = (state_update.mamba2_state_update_pallas,
                            state_update.mamba2_state_update_xla, tokens_in.x)
    pool_shape = (num_slots + 1, model.heads, model.d_a, model.d_b)
    moved = batch * state_bytes * (1 + tokens) + nbytes(slot, out, *jax.tree.leaves(tokens_in))

    def fn(impl, tiles):
        def run(pool, slot, tokens_in):
            if impl == "xla":
                r = xla(pool, slot, tokens_in, mode=mode)
            else:
                r = pallas(pool, slot, tokens_in, mode=mode, **pallas_options(interpret, tiles))
            return (r.outputs, r.pool) if mode == "decode" else (r.outputs, r.step_states)
        return run

    make = lambda: (normal(keys[7], pool_shape, scale=0.1), slot, tokens_in)  # noqa: E731
    return Bench(model.mixer, moved, make, fn, {1: 0} if mode == "decode" else {}, 1,
                 slot_sets)


def pattern_copy(pool: jax.Array, slot: jax.Array, *, along_last: bool, block_value: int,
                 block_heads: int = 1, evict_last: bool = False, interpret: bool = False,
                 compiler_params=None) -> jax.Array:
    """``pool[slot[b], heads, tile] += 1`` in place (rows on slot 0 write nothing) over the
    decode kernels' grid (row, head tile, value tile) and tile: [d_a, block_value] (GDN, ``along_last``)
    or [block_value, d_b] (Mamba2), loaded with the same ``load_state``."""
    heads, rows, cols = pool.shape[1:]
    tiles = (cols if along_last else rows) // block_value

    def pattern_copy_kernel(slot_ref, _pool, pool_ref):
        slot = slot_ref[pl.program_id(0)]
        head = pl.ds(pl.program_id(1) * block_heads, block_heads)
        part = pl.ds(pl.program_id(2) * block_value, block_value)
        idx = (slot, head, slice(None), part) if along_last else (slot, head, part, slice(None))
        tile = state_update.load_state(pool_ref, idx, evict_last)

        @pl.when(slot != 0)
        def _write():
            pool_ref[idx] = tile + 1.0

    return pl.pallas_call(
        pattern_copy_kernel, grid=(slot.shape[0], heads // block_heads, tiles),
        in_specs=[pl.BlockSpec(), pl.BlockSpec()], out_specs=pl.BlockSpec(),
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype), input_output_aliases={1: 0},
        interpret=interpret, compiler_params=compiler_params)(slot, pool)


def ceiling_bench(model: Model, batch: int, tokens: int, opts) -> Bench:
    """``pattern_copy`` of the decode state traffic (2 state units a row) against an XLA
    in-place add on the same slots."""
    keys = jax.random.split(jax.random.key(batch * 10 + 7), 2)
    state_bytes = model.heads * model.d_a * model.d_b * 4
    num_slots, slot_sets = slots_for(keys[0], batch, state_bytes, opts.smoke)
    pool_shape = (num_slots + 1, model.heads, model.d_a, model.d_b)

    def fn(impl, tiles):
        if impl == "xla":
            return lambda pool, slot: (pool.at[jnp.where(slot != 0, slot, pool.shape[0])].add(
                1.0, mode="drop"),)
        return lambda pool, slot: (pattern_copy(pool, slot, along_last=model.mixer == "gdn",
                                                **pallas_options(opts.interpret, tiles)),)

    make = lambda: (normal(keys[1], pool_shape, scale=0.1), slot_sets[0])  # noqa: E731
    return Bench("copy-" + model.mixer, 2 * batch * state_bytes, make, fn, {0: 0}, 1, slot_sets)


def chunk_bench(model: Model, batch: int, tokens: int, opts) -> Bench:
    """Prefill of ``tokens`` per row from slot states, ragged (row b's real length is drawn
    from [tokens / 2, tokens]): the chunked XLA form ("chunked": outputs, final state and the
    state after every chunk) against the token-by-token scan ("scan"). Bytes moved: inputs,
    initial states, outputs, final and chunk states."""
    keys = jax.random.split(jax.random.key(batch * 10 + tokens + 3), 9)
    state_bytes = model.heads * model.d_a * model.d_b * 4
    num_slots, slot_sets = slots_for(keys[0], batch, state_bytes, opts.smoke)
    tokens_in = token_inputs(model, keys, batch, tokens)
    num_valid = jax.random.randint(keys[8], (batch,), tokens // 2, tokens + 1)
    chunk = opts.chunk_size
    gdn = model.mixer == "gdn"
    if gdn:
        per_row = (tokens_in.q, tokens_in.k, tokens_in.v, tokens_in.g, tokens_in.beta)
        shared, out = (), tokens_in.v
    else:
        per_row = (tokens_in.x, tokens_in.b, tokens_in.c, tokens_in.dt)
        shared, out = (tokens_in.a, tokens_in.d), tokens_in.x
    chunk_states = batch * (tokens // chunk) * state_bytes
    moved = (2 * batch * state_bytes + chunk_states + 2 * nbytes(out)
             + nbytes(*jax.tree.leaves(tokens_in)))
    chunked_form = gdn_chunked.gdn_chunked if gdn else mamba2_chunked.mamba2_chunked
    scan_form = recurrence.gdn_scan if gdn else recurrence.mamba2_scan
    axes = (0,) * (1 + len(per_row)) + (None,) * len(shared) + (0,)

    def fn(impl, tiles):
        def run(pool, slot, per_row, shared, num_valid):
            h0 = pool[slot].astype(jnp.float32)
            inputs = [x.astype(jnp.float32) for x in per_row + shared]
            valid = jnp.arange(tokens)[None, :] < num_valid[:, None]
            if impl == "chunked":
                form = lambda *a: chunked_form(*a, chunk_size=chunk)  # noqa: E731
                outs, final, chunks = jax.vmap(form, in_axes=axes)(h0, *inputs, num_valid)
            else:
                scan = lambda *a: scan_by_chunks(scan_form, chunk, len(per_row), *a)  # noqa: E731
                outs, final, chunks = jax.vmap(scan, in_axes=axes)(h0, *inputs, valid)
            return jnp.where(valid[:, :, None, None], outs, 0.0), final, chunks
        return run

    pool_shape = (num_slots + 1, model.heads, model.d_a, model.d_b)
    make = lambda: (normal(keys[7], pool_shape, scale=0.1),  # noqa: E731
                    slot_sets[0], per_row, shared, num_valid)
    return Bench("chunk-" + model.mixer, int(moved), make, fn, {}, 1, slot_sets,
                 impls=("chunked", "scan"))


def scan_by_chunks(scan_form, chunk: int, num_per_token: int, h0, *args):
    """``scan_form`` (one row: h0, per-token inputs, shared inputs, valid) run chunk by chunk
    with only the state at each chunk end kept: (outputs, final state, the state after each
    of the first T // chunk chunks). The whole-sequence scan keeps the state after every
    token (8 GiB a row for GDN at 4096 tokens)."""
    per_token, shared, valid = args[:num_per_token], args[num_per_token:-1], args[-1]
    tokens = valid.shape[0]
    num_chunks = -(-tokens // chunk)
    pad = num_chunks * chunk - tokens

    def split(x):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape((num_chunks, chunk) + x.shape[1:])

    def body(h, xs):
        outs, h, _ = scan_form(h, *xs[:-1], *shared, xs[-1])
        return h, (outs, h)

    final, (outs, ends) = jax.lax.scan(body, h0, [split(x) for x in per_token] + [split(valid)])
    outs = outs.reshape((num_chunks * chunk,) + outs.shape[2:])[:tokens]
    return outs, final, ends[: tokens // chunk]


def conv_bench(model: Model, batch: int, tokens: int, opts) -> Bench:
    mode = "decode" if tokens == 1 else "verify"
    keys = jax.random.split(jax.random.key(batch * 10 + tokens + 1), 5)
    window_bytes = model.channels * 3 * 2
    num_slots, slot_sets = slots_for(keys[0], batch, window_bytes, opts.smoke)
    slot, interpret = slot_sets[0], opts.interpret
    x = normal(keys[1], (batch, tokens, model.channels), jnp.bfloat16)
    weight, bias = normal(keys[2], (model.channels, 4)), normal(keys[3], (model.channels,))
    moved = batch * window_bytes * (1 + tokens) + 2 * nbytes(x) + nbytes(slot, weight, bias)

    def fn(impl, tiles):
        def run(pool, slot, x, weight, bias):
            if impl == "xla":
                r = conv_update.conv_update_xla(pool, slot, x, weight, bias, mode=mode)
            else:
                r = conv_update.conv_update_pallas(pool, slot, x, weight, bias, mode=mode,
                                                   **pallas_options(interpret, tiles))
            return (r.outputs, r.pool) if mode == "decode" else (r.outputs, r.step_windows)
        return run

    pool_shape = (num_slots + 1, model.channels, 3)
    make = lambda: (normal(keys[4], pool_shape, jnp.bfloat16), slot, x, weight, bias)  # noqa: E731
    return Bench("conv", moved, make, fn, {1: 0} if mode == "decode" else {}, 1, slot_sets)


def scatter_bench(model: Model, batch: int, tokens: int, opts) -> Bench:
    keys = jax.random.split(jax.random.key(batch * 10 + tokens + 2), 6)
    state, conv = (model.heads, model.d_a, model.d_b), (model.channels, 3)
    layers, interpret = SCATTER_LAYERS, opts.interpret
    slot_bytes = layers * (np.prod(state) * 4 + np.prod(conv) * 2)
    num_slots, dst_sets = slots_for(keys[0], batch, int(slot_bytes), opts.smoke)
    dst = dst_sets[0]
    step = jax.random.randint(keys[1], (batch,), 0, tokens).astype(jnp.int32)
    moved = 2 * batch * layers * (np.prod(state) * 4 + np.prod(conv) * 2)

    def make():
        return (normal(keys[2], (layers, num_slots + 1) + state),
                normal(keys[3], (layers, num_slots + 1) + conv, jnp.bfloat16),
                normal(keys[4], (layers, batch, tokens) + state),
                normal(keys[5], (layers, batch, tokens) + conv, jnp.bfloat16), dst, step)

    def fn(impl, tiles):
        if impl == "xla":
            return state_scatter.state_scatter_xla
        return lambda *args: state_scatter.state_scatter_pallas(
            *args, **pallas_options(interpret, tiles))

    return Bench("scatter", int(moved), make, fn, {0: 0, 1: 1}, 4, dst_sets)


def check(bench: Bench, tiles: dict) -> str:
    """Worst error of the candidate's outputs (Pallas; the chunked form for prefill) vs the
    reference form's (XLA; the scan), each relative to that output's max; "MISMATCH" past
    1e-2 for bf16 outputs (one rounding) or 1e-4 for float32. The reference result is
    computed once per bench (the inputs are the same for every call)."""
    candidate, reference = bench.impls
    args = bench.make_args()
    got = jax.jit(bench.fn(candidate, tiles))(*args)
    if bench.reference is None:
        bench.reference = jax.jit(bench.fn(reference, {}))(*bench.make_args())
    worst, bad = 0.0, False
    for g, w in zip(got, bench.reference):
        tol = 1e-2 if w.dtype == jnp.bfloat16 else 1e-4
        error = max_abs_diff(g, w) / max(max_abs_diff(w, jnp.zeros((), w.dtype)), 1e-30)
        worst, bad = max(worst, error), bad or not error <= tol
    return f"{'MISMATCH' if bad else 'ok'} {worst:.1e}"


@jax.jit
def _max_abs_diff(a: jax.Array, b: jax.Array) -> jax.Array:
    diff = jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))
    return jnp.where(jnp.all(jnp.isfinite(diff)), jnp.max(diff), jnp.inf)  # max drops NaN on CPU


def max_abs_diff(a: jax.Array, b: jax.Array) -> float:
    """max |a - b| in float32, slice by slice along the first axis (a few-GiB pool or scratch
    must not need float32 temporaries of its whole size); inf where anything is not finite."""
    if a.ndim == 0 or a.size < (1 << 26):
        return float(_max_abs_diff(a, b))
    b = jnp.broadcast_to(b, a.shape)
    return max(max_abs_diff(a[i], b[i]) for i in range(a.shape[0]))


def time_calls(run: Callable[[], object], iters: int, warmup: int) -> float:
    """Median seconds of ``run()``; run must block until its result is ready."""
    for _ in range(warmup):
        run()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return float(np.median(samples))


CHAIN_CALLS = (2, 10)


def chain_seconds(make_chain: Callable[[int], Callable[[], None]], iters: int,
                  warmup: int) -> float:
    """Device seconds per call: chains of n1 and n2 back-to-back calls (CHAIN_CALLS) are
    timed (median of ``iters`` runs each, every run ending in a device sync), and the
    difference of the medians over n2 - n1 cancels dispatch, launch and sync costs."""
    n1, n2 = CHAIN_CALLS
    medians = [time_calls(make_chain(n), iters, warmup) for n in (n1, n2)]
    return (medians[1] - medians[0]) / (n2 - n1)


def jax_chain(bench: Bench, impl: str, tiles: dict, calls: int) -> Callable[[], None]:
    """One jitted program of ``calls`` launches: call i uses slot set i % R, threaded outputs
    (in-place pools) feed the next call, and one element of every other output goes into a
    sink so that no launch is dead code. The arguments are donated and carried over."""
    one = bench.fn(impl, tiles)

    def many(args, slot_sets):
        args, sink = list(args), jnp.zeros((), jnp.float32)
        for i in range(calls):
            args[bench.slot_arg] = slot_sets[i % slot_sets.shape[0]]
            outs = one(*args)
            for out_index, arg_index in bench.thread.items():
                args[arg_index] = outs[out_index]
            for out_index, out in enumerate(outs):
                if out_index not in bench.thread:
                    sink = sink + out.reshape(-1)[0].astype(jnp.float32)
        return tuple(args), sink

    many = jax.jit(many, donate_argnums=0)
    fresh = jax.tree.map(lambda a: jnp.array(a, copy=True), bench.make_args())  # donated
    state = {"args": fresh}

    def run():
        state["args"], sink = many(state["args"], bench.slot_sets)
        sink.block_until_ready()

    return run


def xla_add_one_seconds(num_bytes: int, iters: int, warmup: int) -> float:
    """Median seconds of a jitted ``x + 1`` over ``num_bytes`` of float32."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    add_one = jax.jit(lambda a: a + 1.0)
    return time_calls(lambda: add_one(x).block_until_ready(), iters, warmup)


def copy_bandwidths(num_bytes: int, iters: int, warmup: int) -> dict[str, float]:
    """GB/s (bytes read + written) of a device-to-device copy through torch (cudaMemcpy;
    when torch sees a GPU) and of XLA's ``x + 1`` over ``num_bytes`` of float32."""
    results = {"xla x+1": 2 * num_bytes / xla_add_one_seconds(num_bytes, iters, warmup) / 1e9}
    try:
        import torch

        if torch.cuda.is_available():
            src = torch.ones(num_bytes // 4, device="cuda")
            dst = torch.empty_like(src)
            results["torch copy_"] = 2 * num_bytes / torch_event_seconds(
                lambda: dst.copy_(src), iters, warmup) / 1e9
            del src, dst
            torch.cuda.empty_cache()
    except ImportError:
        pass
    return results


# ---------------------------------------------------------------- peers (torch / Triton)


def torch_event_seconds(fn: Callable[[], object], iters: int, warmup: int,
                        calls: int = 10) -> float:
    """Median over ``iters`` of CUDA-event time for ``calls`` eager calls, per call."""
    import torch

    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / calls)
    return float(np.median(samples))


def torch_chain(make_call: Callable[[int], Callable[[], object]],
                calls: int) -> Callable[[], None]:
    """``calls`` calls (call i made by ``make_call(i)``) captured in one CUDA graph; run()
    replays it and synchronises. Falls back to eager calls if capture fails."""
    import torch

    fns = [make_call(i) for i in range(calls)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:  # compile and autotune outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in fns:
                fn()
    except Exception as error:  # some Python-side checks are not capturable
        log(f"  CUDA graph capture failed ({type(error).__name__}); timing eager calls")
        torch.cuda.synchronize()

        def eager():
            for fn in fns:
                fn()
            torch.cuda.synchronize()
        return eager

    def replay():
        graph.replay()
        torch.cuda.synchronize()
    return replay


def torch_seconds(make_call: Callable[[int], Callable[[], object]], iters: int,
                  warmup: int) -> float:
    """Device seconds per call of a torch function, by ``chain_seconds`` over CUDA graphs."""
    return chain_seconds(lambda n: torch_chain(make_call, n), iters, warmup)


def fla_seconds(model: Model, batch: int, tokens: int, iters: int, warmup: int) -> float:
    """flash-linear-attention's fused recurrent GDN; reads the state, writes the final one
    (call i reads initial state i % R, so the L2 holds none of them)."""
    import torch
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    shape, dev = (batch, tokens, model.heads), "cuda"
    q = torch.nn.functional.normalize(torch.randn(*shape, model.d_a, device=dev), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(*shape, model.d_a, device=dev), dim=-1)
    v = torch.randn(*shape, model.d_b, device=dev, dtype=torch.bfloat16)
    g = -torch.nn.functional.softplus(torch.randn(*shape, device=dev))
    beta = torch.sigmoid(torch.randn(*shape, device=dev))
    q, k = (q / model.d_a**0.5).bfloat16(), k.bfloat16()
    states = [torch.randn(batch, model.heads, model.d_a, model.d_b, device=dev) * 0.1
              for _ in range(SLOT_SETS)]
    return torch_seconds(lambda i: (lambda: fused_recurrent_gated_delta_rule(
        q, k, v, g, beta, scale=1.0, initial_state=states[i % SLOT_SETS],
        output_final_state=True)), iters, warmup)


def mamba_ssm_seconds(model: Model, batch: int, tokens: int, iters: int, warmup: int) -> float:
    """mamba_ssm's selective_state_update (one token, in place on a pool by slot index; dt,
    A and dt_bias tied across the head dim as SGLang calls it)."""
    import torch
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update

    if tokens != 1:
        raise ValueError("selective_state_update takes one token per call")
    dev, h, p, n = "cuda", model.heads, model.d_a, model.d_b
    num_slots = max(2 * batch + 1, -(-POOL_BYTES // (h * p * n * 4)))
    pool = torch.randn(num_slots + 1, h, p, n, device=dev) * 0.1
    slot_sets = [(torch.randperm(num_slots, device=dev)[:batch] + 1).to(torch.int32)
                 for _ in range(SLOT_SETS)]
    x = torch.randn(batch, h, p, device=dev, dtype=torch.bfloat16)
    dt = torch.nn.functional.softplus(torch.randn(batch, h, device=dev))
    dt = dt[:, :, None].expand(-1, -1, p)
    dt_bias = torch.zeros(h, device=dev)[:, None].expand(-1, p)
    a = -torch.rand(h, device=dev)[:, None, None].expand(-1, p, n)
    b, c = (torch.randn(batch, model.groups, n, device=dev, dtype=torch.bfloat16) for _ in "bc")
    d = torch.randn(h, device=dev)[:, None].expand(-1, p)
    return torch_seconds(lambda i: (lambda: selective_state_update(
        pool, x, dt, a, b, c, D=d, dt_bias=dt_bias,
        state_batch_indices=slot_sets[i % SLOT_SETS])), iters, warmup)


EXTERNAL = {  # mixer -> (row label, package to find, timing function)
    "gdn": ("fla fused_recurrent (final state only)", "fla", fla_seconds),
    "mamba2": ("mamba_ssm selective_state_update", "mamba_ssm", mamba_ssm_seconds)}


# ---------------------------------------------------------------- driver


class Table:
    """Markdown rows, rewritten to ``path`` after every row so a partial run leaves a file."""

    def __init__(self, path: Path, header: str):
        self.path, self.header, self.rows = path, header, []

    def add(self, row: dict) -> None:
        log("  " + "  ".join(f"{c}={row.get(c, '')}" for c in COLUMNS))
        self.rows.append("| " + " | ".join(str(row.get(c, "")) for c in COLUMNS) + " |")
        lines = [self.header, "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        self.path.write_text("\n".join(lines + self.rows) + "\n")


def measure(row: dict, moved: int, copy_gbs: float, seconds_fn: Callable[[], float]) -> dict:
    """Fill the timing columns of ``row``; an error becomes the row's check column."""
    try:
        seconds = seconds_fn()
        gbs = moved / seconds / 1e9
        row.update({"time us": f"{seconds * 1e6:.1f}", "MB moved": f"{moved / 1e6:.2f}",
                    "GB/s": f"{gbs:.1f}", "% copy": f"{100 * gbs / copy_gbs:.1f}"})
    except Exception as error:  # one failing kernel must not end the run
        traceback.print_exc(limit=4)
        row["check"] = f"error: {type(error).__name__}: {(str(error).splitlines() or [''])[0][:100]}"
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
        table.add(measure(row, 2 * batch * state_bytes, opts.copy_gbs,
                          lambda: peer_seconds(model, batch, tokens, opts)))
        return
    builder, tile_list = {"state": (state_bench, model.state_tiles),
                          "ceiling": (ceiling_bench, model.state_tiles),
                          "chunk": (chunk_bench, ({},)),
                          "conv": (conv_bench, model.conv_tiles),
                          "scatter": (scatter_bench, model.scatter_tiles)}[kind]
    tile_list = opts.tiles.get("state" if kind == "ceiling" else kind, tile_list)
    try:
        bench = builder(model, batch, tokens, opts)
    except Exception as error:
        traceback.print_exc(limit=4)
        table.add({**base, "kernel": kind, "check": f"error building inputs: {error}"[:120]})
        return
    candidate, reference = bench.impls
    for impl, tiles in [(candidate, t) for t in tile_list] + [(reference, {})]:
        row = {**base, "kernel": bench.kernel, "impl": impl,
               "tiles": ",".join(f"{k}={v}" for k, v in tiles.items()) or "-"}
        if impl == candidate:
            try:
                row["check"] = check(bench, tiles)
            except Exception as error:
                traceback.print_exc(limit=4)
                row["check"] = f"check error: {type(error).__name__}"
        table.add(measure(row, bench.bytes_moved, opts.copy_gbs, lambda: chain_seconds(
            lambda n: jax_chain(bench, impl, tiles, n), opts.iters, opts.warmup)))


def peer_seconds(model: Model, batch: int, tokens: int, opts) -> float:
    """Time a peer kernel in a child process (``--peer``), so that a fault in it (an illegal
    address poisons the CUDA context) cannot end this run."""
    command = [sys.executable, str(Path(__file__).resolve()), "--peer",
               f"{model.name},{batch},{tokens}", "--iters", str(opts.iters),
               "--warmup", str(opts.warmup)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    for line in done.stdout.splitlines():
        if line.startswith("PEER_SECONDS "):
            return float(line.split()[1])
    lines = (done.stderr or done.stdout or "no output").strip().splitlines()
    raise RuntimeError(f"peer exited {done.returncode}: {lines[-1][:100]}")


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
    parser.add_argument("--kernels", default="state,ceiling,chunk,conv,scatter,external",
                        help="comma list of state, ceiling (the decode traffic alone), chunk "
                             "(prefill forms), conv, scatter, external")
    parser.add_argument("--prefill-len", type=int, default=None,
                        help="tokens per row of the chunk benchmark (default 4096)")
    parser.add_argument("--prefill-batches", default=None,
                        help="comma list of rows for the chunk benchmark (default 1,8)")
    parser.add_argument("--chunk-size", type=int, default=None,
                        help="chunk of the chunked prefill forms (default 64)")
    parser.add_argument("--models", default=None, help="comma list of model names")
    parser.add_argument("--batches", default=None, help="comma list (default 1,16,64,256)")
    parser.add_argument("--tokens", default=None, help="comma list (default 1,4)")
    parser.add_argument("--tiles", action="append", default=[], metavar="KIND:SPEC",
                        help="replace the Pallas tile list of a kernel kind (state, also "
                             "used by ceiling; conv, scatter) for every model, e.g. 'state:block_value=64,num_warps=4;"
                             "block_value=32,num_warps=8,num_stages=2'; repeatable")
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
        raise ValueError(f"--tiles wants KIND:k=v,...;k=v,... with KIND state|conv|scatter, "
                         f"got {spec!r}")
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
    log(f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
        f"interpret={opts.interpret}")
    copies = copy_bandwidths((1 << 22) if opts.smoke else (2 << 30), opts.iters, opts.warmup)
    opts.copy_gbs = max(copies.values())
    copy_text = ", ".join(f"{name} {gbs:.1f}" for name, gbs in copies.items())
    log(f"copy bandwidth (GB/s): {copy_text}; using {opts.copy_gbs:.1f}")
    table = Table(opts.out, (
        f"# Kernel benchmark\n\ndevice {device.device_kind} ({jax.default_backend()}), jax "
        f"{jax.__version__}, interpret={opts.interpret}; copy bandwidth {opts.copy_gbs:.1f} "
        f"GB/s (the best of: {copy_text}); per-call device time from chains of "
        f"{CHAIN_CALLS[0]} and {CHAIN_CALLS[1]} calls (median of {opts.iters} after "
        f"{opts.warmup} each); T=1 decode (in place), "
        f"T>1 verify (every step to scratch); chunk: prefill of T tokens per row (chunk size "
        f"{opts.chunk_size}), the chunked XLA form checked against the scan; scatter over "
        f"{SCATTER_LAYERS} layers; check = max |pallas - xla| / max |xla| over every output."))
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
