"""The cases of ``bench_kernels.py``: model shapes, and for each kernel kind a ``Bench`` (fresh
device inputs, the candidate and reference functions, the slot sets a timed chain rotates
through, the bytes that must move)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from lazyspec.kernels import common
from lazyspec.kernels.gdn import chunked as gdn_chunked
from lazyspec.kernels.gdn import reference as gdn_reference
from lazyspec.kernels.gdn import update as gdn_update
from lazyspec.kernels.mamba2 import chunked as mamba2_chunked
from lazyspec.kernels.mamba2 import reference as mamba2_reference
from lazyspec.kernels.mamba2 import update as mamba2_update
from lazyspec.kernels.state import conv as conv_update
from lazyspec.kernels.state import scatter as state_scatter
from lazyspec.kernels.state import update_common as state_update
from lazyspec.kernels.tuning import Tuning

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
        return [
            Model(
                "tiny-gdn",
                "gdn",
                4,
                16,
                16,
                1,
                24,
                ({"block_heads": 2, "block_value": 8},),
                ({"block_channels": 8},),
                ({"block_rows": 8, "block_channels": 8},),
            ),
            Model(
                "tiny-mamba2",
                "mamba2",
                4,
                8,
                16,
                2,
                40,
                ({"block_value": 4},),
                ({"block_channels": 8},),
                ({"block_rows": 4, "block_channels": 8},),
            ),
        ]
    conv = ({"block_channels": 256},)
    scatter = ({"block_rows": 8, "block_channels": 2048},)
    tuning = Tuning()
    gdn, mamba2 = (
        {"block_value": r.block_value, "num_warps": r.num_warps, "evict_last": r.evict_last}
        for r in (tuning.gdn, tuning.mamba2)
    )
    return [
        Model(
            "qwen3-next-80b",
            "gdn",
            32,
            128,
            128,
            1,
            8192,
            (gdn, {"block_value": 32, "num_warps": 4}),
            conv,
            scatter,
        ),
        Model(
            "nemotron-h-8b",
            "mamba2",
            128,
            64,
            128,
            8,
            10240,
            (mamba2, {"block_value": 16, "num_warps": 4}),
            conv,
            scatter,
        ),
    ]


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


def pallas_options(interpret: bool, tiles: dict) -> tuple[dict, dict]:
    """(the kernel's tile arguments, its launch options) of a ``--tiles`` entry: its warps
    and stages go to the Triton compiler params."""
    tiles = dict(tiles)
    warps, stages = tiles.pop("num_warps", 4), tiles.pop("num_stages", 1)
    params = (
        None if interpret else common.pallas_compiler_params(num_warps=warps, num_stages=stages)
    )
    return tiles, {"interpret": interpret, "compiler_params": params}


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
            g=-jax.nn.softplus(normal(keys[4], shape)),
            beta=jax.nn.sigmoid(normal(keys[5], shape)),
        )
    group_shape = (batch, tokens, model.groups, model.d_b)
    return state_update.Mamba2Tokens(
        x=normal(keys[1], shape + (model.d_a,), bf16),
        b=normal(keys[2], group_shape, bf16),
        c=normal(keys[3], group_shape, bf16),
        dt=jax.nn.softplus(normal(keys[4], shape)),
        a=-jnp.exp(normal(keys[5], (model.heads,))),
        d=normal(keys[6], (model.heads,)),
    )


def state_bench(model: Model, batch: int, tokens: int, opts) -> Bench:
    mode = "decode" if tokens == 1 else "verify"
    keys = jax.random.split(jax.random.key(batch * 10 + tokens), 8)
    state_bytes = model.heads * model.d_a * model.d_b * 4
    num_slots, slot_sets = slots_for(keys[0], batch, state_bytes, opts.smoke)
    slot, interpret = slot_sets[0], opts.interpret
    tokens_in = token_inputs(model, keys, batch, tokens)
    if model.mixer == "gdn":
        pallas, xla, out = (
            gdn_update.gdn_state_update_pallas,
            gdn_update.gdn_state_update_xla,
            tokens_in.v,
        )
    else:
        pallas, xla, out = (
            mamba2_update.mamba2_state_update_pallas,
            mamba2_update.mamba2_state_update_xla,
            tokens_in.x,
        )
    pool_shape = (num_slots + 1, model.heads, model.d_a, model.d_b)
    moved = batch * state_bytes * (1 + tokens) + nbytes(slot, out, *jax.tree.leaves(tokens_in))

    def fn(impl, tiles):
        def run(pool, slot, tokens_in):
            if impl == "xla":
                r = xla(pool, slot, tokens_in, mode=mode)
            else:
                kernel_tiles, launch = pallas_options(interpret, tiles)
                update_tiles = state_update.UpdateTiles(**kernel_tiles)
                r = pallas(pool, slot, tokens_in, mode=mode, tiles=update_tiles, **launch)
            return (r.outputs, r.pool) if mode == "decode" else (r.outputs, r.step_states)

        return run

    make = lambda: (normal(keys[7], pool_shape, scale=0.1), slot, tokens_in)  # noqa: E731
    return Bench(model.mixer, moved, make, fn, {1: 0} if mode == "decode" else {}, 1, slot_sets)


def pattern_copy(
    pool: jax.Array,
    slot: jax.Array,
    *,
    along_last: bool,
    tiles: state_update.UpdateTiles,
    interpret: bool = False,
    compiler_params=None,
) -> jax.Array:
    """``pool[slot[b], heads, tile] += 1`` in place (rows on slot 0 write nothing) over the
    decode kernels' grid (row, head tile, value tile) and tile: [d_a, block_value] (GDN,
    ``along_last``) or [block_value, d_b] (Mamba2), loaded with the same ``load_state``
    (``tiles`` as the update's; ``block_value`` set)."""
    heads, rows, cols = pool.shape[1:]
    block_heads, block_value = tiles.block_heads, tiles.block_value
    num_tiles = (cols if along_last else rows) // block_value

    def pattern_copy_kernel(slot_ref, _pool, pool_ref):
        slot = slot_ref[pl.program_id(0)]
        head = pl.ds(pl.program_id(1) * block_heads, block_heads)
        part = pl.ds(pl.program_id(2) * block_value, block_value)
        idx = (slot, head, slice(None), part) if along_last else (slot, head, part, slice(None))
        tile = state_update.load_state(pool_ref, idx, tiles.evict_last)

        @pl.when(slot != 0)
        def _write():
            pool_ref[idx] = tile + 1.0

    return pl.pallas_call(
        pattern_copy_kernel,
        grid=(slot.shape[0], heads // block_heads, num_tiles),
        in_specs=[pl.BlockSpec(), pl.BlockSpec()],
        out_specs=pl.BlockSpec(),
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        input_output_aliases={1: 0},
        interpret=interpret,
        compiler_params=compiler_params,
    )(slot, pool)


def ceiling_bench(model: Model, batch: int, tokens: int, opts) -> Bench:
    """``pattern_copy`` of the decode state traffic (2 state units a row) against an XLA
    in-place add on the same slots."""
    keys = jax.random.split(jax.random.key(batch * 10 + 7), 2)
    state_bytes = model.heads * model.d_a * model.d_b * 4
    num_slots, slot_sets = slots_for(keys[0], batch, state_bytes, opts.smoke)
    pool_shape = (num_slots + 1, model.heads, model.d_a, model.d_b)

    def fn(impl, tiles):
        if impl == "xla":
            return lambda pool, slot: (
                pool.at[jnp.where(slot != 0, slot, pool.shape[0])].add(1.0, mode="drop"),
            )
        kernel_tiles, launch = pallas_options(opts.interpret, tiles)
        update_tiles = state_update.UpdateTiles(**kernel_tiles)
        along_last = model.mixer == "gdn"
        return lambda pool, slot: (
            pattern_copy(pool, slot, along_last=along_last, tiles=update_tiles, **launch),
        )

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
    moved = (
        2 * batch * state_bytes
        + chunk_states
        + 2 * nbytes(out)
        + nbytes(*jax.tree.leaves(tokens_in))
    )
    chunked_form = gdn_chunked.gdn_chunked if gdn else mamba2_chunked.mamba2_chunked
    scan_form = gdn_reference.gdn_scan if gdn else mamba2_reference.mamba2_scan
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

    def make():
        return normal(keys[7], pool_shape, scale=0.1), slot_sets[0], per_row, shared, num_valid

    return Bench(
        "chunk-" + model.mixer, int(moved), make, fn, {}, 1, slot_sets, impls=("chunked", "scan")
    )


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
            options = conv_update.ConvOptions(mode)
            if impl == "xla":
                r = conv_update.conv_update_xla(pool, slot, x, weight, bias, options=options)
            else:
                kernel_tiles, launch = pallas_options(interpret, tiles)
                r = conv_update.conv_update_pallas(
                    pool, slot, x, weight, bias, options=options, **kernel_tiles, **launch
                )
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
        return (
            normal(keys[2], (layers, num_slots + 1) + state),
            normal(keys[3], (layers, num_slots + 1) + conv, jnp.bfloat16),
            normal(keys[4], (layers, batch, tokens) + state),
            normal(keys[5], (layers, batch, tokens) + conv, jnp.bfloat16),
            dst,
            step,
        )

    def fn(impl, tiles):
        if impl == "xla":
            return state_scatter.state_scatter_xla
        kernel_tiles, launch = pallas_options(interpret, tiles)
        blocks = state_scatter.PoolBlocks(**kernel_tiles)
        return lambda *args: state_scatter.state_scatter_pallas(*args, blocks=blocks, **launch)

    return Bench("scatter", int(moved), make, fn, {0: 0, 1: 1}, 4, dst_sets)
