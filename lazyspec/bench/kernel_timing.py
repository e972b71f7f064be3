"""Checking and timing for ``bench_kernels.py``: the on-device check against the reference
form, device time per call from chains of launches (JAX programs and, for the peers, CUDA
graphs of torch calls), and the copy bandwidth the fractions are taken against."""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from lazyspec.bench.kernel_cases import POOL_BYTES, SLOT_SETS, Bench, Model


def log(message: str) -> None:
    print(message, flush=True)


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


def chain_seconds(
    make_chain: Callable[[int], Callable[[], None]], iters: int, warmup: int
) -> float:
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
            results["torch copy_"] = (
                2 * num_bytes / torch_event_seconds(lambda: dst.copy_(src), iters, warmup) / 1e9
            )
            del src, dst
            torch.cuda.empty_cache()
    except ImportError:
        pass
    return results


# ---------------------------------------------------------------- peers (torch / Triton)


def torch_event_seconds(
    fn: Callable[[], object], iters: int, warmup: int, calls: int = 10
) -> float:
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


def torch_chain(make_call: Callable[[int], Callable[[], object]], calls: int) -> Callable[[], None]:
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


def torch_seconds(
    make_call: Callable[[int], Callable[[], object]], iters: int, warmup: int
) -> float:
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
    states = [
        torch.randn(batch, model.heads, model.d_a, model.d_b, device=dev) * 0.1
        for _ in range(SLOT_SETS)
    ]
    return torch_seconds(
        lambda i: (
            lambda: fused_recurrent_gated_delta_rule(
                q,
                k,
                v,
                g,
                beta,
                scale=1.0,
                initial_state=states[i % SLOT_SETS],
                output_final_state=True,
            )
        ),
        iters,
        warmup,
    )


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
    slot_sets = [
        (torch.randperm(num_slots, device=dev)[:batch] + 1).to(torch.int32)
        for _ in range(SLOT_SETS)
    ]
    x = torch.randn(batch, h, p, device=dev, dtype=torch.bfloat16)
    dt = torch.nn.functional.softplus(torch.randn(batch, h, device=dev))
    dt = dt[:, :, None].expand(-1, -1, p)
    dt_bias = torch.zeros(h, device=dev)[:, None].expand(-1, p)
    a = -torch.rand(h, device=dev)[:, None, None].expand(-1, p, n)
    b, c = (torch.randn(batch, model.groups, n, device=dev, dtype=torch.bfloat16) for _ in "bc")
    d = torch.randn(h, device=dev)[:, None].expand(-1, p)
    return torch_seconds(
        lambda i: (
            lambda: selective_state_update(
                pool,
                x,
                dt,
                a,
                b,
                c,
                D=d,
                dt_bias=dt_bias,
                state_batch_indices=slot_sets[i % SLOT_SETS],
            )
        ),
        iters,
        warmup,
    )


EXTERNAL = {  # mixer -> (row label, package to find, timing function)
    "gdn": ("fla fused_recurrent (final state only)", "fla", fla_seconds),
    "mamba2": ("mamba_ssm selective_state_update", "mamba_ssm", mamba_ssm_seconds),
}
