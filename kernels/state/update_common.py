"""What the GDN and Mamba2 recurrent state updates share (``gdn.update``, ``mamba2.update``,
their TPU layouts ``*.update_tpu``): the contract, the token records, the checks, the
Triton-layout pool access and launch, and the XLA forms' gather, scan and scatter.

Contract (both mixers, both forms). A batch of B rows with T new tokens each reads its
initial state from ``pool[slot[b]]`` (pool ``[num_slots + 1, H, d_a, d_b]``, one layer) and
runs the token-by-token recurrence of ``gdn.reference.gdn_scan`` /
``mamba2.reference.mamba2_scan`` in float32. ``slot[b] == 0`` marks a padding row: its
outputs are computed from slot 0 like any row's (the Pallas kernels' ``skip_padding``, in
decode: from a zero state, slot 0 not read), and nothing is ever written to slot 0 (so
verify, which writes no slot, may use slot 0 for real data). Real rows must name distinct
slots in decode. Two modes:
  decode  the state after the last token is written back into ``pool[slot[b]]`` in place
          (the Pallas form aliases the pool; donate it under jit to avoid a copy);
  verify  the pool is only read; the state after every token goes to
          ``step_states [B, T, H, d_a, d_b]`` (row-indexed scratch for the commit).
Outputs are ``[B, T, H, d_v]`` (GDN) or ``[B, T, H, P]`` (Mamba2) in the value dtype.
The Pallas GDN update also takes ``GdnConvTokens`` (the decode step's conv output and raw
gates, finished per head in the kernel; float32 outputs), which stand for ``GdnTokens``.
With ``layer=l`` the pool is the stacked pool of all recurrent layers (``[L, num_slots + 1,
H, d_a, d_b]``) and layer l's rows are read (and, in decode, written): the engine passes
its pools as they are, so no per-layer slice or per-row gather is copied out first.

Pallas layout: grid ``(row, head tile, value tile)``. The value axis is GDN's d_v (the state's
last axis) and Mamba2's head dim P (second-to-last): the update is independent per value
column, so a tile needs only its own columns. The slot id comes from a whole-array operand
(Triton lowering has no scalar prefetch) and indexes the whole-array pool ref inside the
kernel (aliased to the output in decode). Loads and stores are per token, so every moved
array is ``[block_heads, ...]``-shaped (Triton needs power-of-two sizes).

Backends: ``interpret=True`` anywhere (the tests, on CPU); NVIDIA GPUs through Triton
``CompilerParams`` (``common.pallas_compiler_params``; the tests lower to Triton IR on CPU).
Not for TPUs: Mosaic would stage the whole-array pool into VMEM. The TPU layout, with the
slot ids scalar-prefetched into the index maps, is ``update_tpu`` of each mixer (the dispatch
in ``state.dispatch`` picks it on a TPU).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pallas_triton

from lazyspec.kernels.common import check_tile, refuse_triton_shapes, whole
from lazyspec.kernels.norm.gated import GateLayout

MODES = ("decode", "verify")


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["z_source", "weight"],
    meta_fields=["layout", "eps", "dtype"],
)
@dataclasses.dataclass(frozen=True)
class OutputNorm:
    """The GDN output's gated RMSNorm, applied by the update kernel to each head's output
    row as it computes it (``norm.gated``'s contract and arithmetic, ``gated_rows``):
    ``z_source [B, T, C]`` holds head i's gate where ``layout`` says (Qwen3-Next's
    ``in_proj_qkvz`` output, read in place), ``weight [d]``, ``eps``; the outputs come out
    in ``dtype``, normed, in place of the float32 rows."""

    z_source: jax.Array
    weight: jax.Array
    layout: GateLayout
    eps: float
    dtype: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GdnTokens:
    """Prepared GDN inputs: q, k [B, T, H, d_k] (normalised, q scaled, repeated to H heads),
    v [B, T, H, d_v], g [B, T, H] (log decay), beta [B, T, H]."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    g: jax.Array
    beta: jax.Array


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["conv_out", "a", "b", "a_log", "dt_bias", "num_new", "norm"],
    meta_fields=["num_k_heads", "gates_per_key"],
)
@dataclasses.dataclass(frozen=True)
class GdnConvTokens:
    """GDN inputs as a decode step has them after its conv, finished per head inside the
    Pallas kernel (so the step runs no kernels of its own for them): ``conv_out [B, T,
    (2 * Hk + Hv) * d]`` float32, the q and k of ``num_k_heads`` key heads then the v of Hv
    value heads, every head d wide; ``a``, ``b [B, T, Hv]`` (the raw projections);
    ``a_log``, ``dt_bias [Hv]``; ``num_new [B]``. They stand for the ``GdnTokens`` with q, k
    L2-normed (``gdn.reference.l2_normalize``; q scaled by d ** -0.5), value head i reading key
    head i // (Hv / Hk), g = -exp(a_log) * softplus(a + dt_bias) and beta = sigmoid(b),
    both 0 from token ``num_new[b]`` on (``layers.gdn`` builds the same in jnp).
    ``gates_per_key`` (``grouped``): a and b are both the gate projection as Qwen3-Next's
    ``in_proj_ba`` gives it, ``[B, T, 2 * Hv]`` grouped per key head (the b of its Hv / Hk
    value heads, then their a), which the kernel reads in place (no slices). ``norm``: the
    output's gated norm in the kernel too (``OutputNorm``; a program then holds a whole
    head: one head a tile, the value tile the head's width)."""

    conv_out: jax.Array
    a: jax.Array
    b: jax.Array
    a_log: jax.Array
    dt_bias: jax.Array
    num_new: jax.Array
    num_k_heads: int
    gates_per_key: bool = False
    norm: OutputNorm | None = None

    @classmethod
    def grouped(cls, conv_out, ba, a_log, dt_bias, num_new, num_k_heads) -> GdnConvTokens:
        """The tokens with the gates as one projection grouped per key head (class doc)."""
        return cls(conv_out, ba, ba, a_log, dt_bias, num_new, num_k_heads, gates_per_key=True)

    @staticmethod
    def group_gates(b: jax.Array, a: jax.Array, num_k_heads: int) -> jax.Array:
        """The grouped projection ``[B, T, 2 * Hv]`` of gates b, a ``[B, T, Hv]`` (the
        layout ``grouped`` reads)."""
        per_key = lambda g: g.reshape(*g.shape[:-1], num_k_heads, -1)  # noqa: E731
        return jnp.concatenate([per_key(b), per_key(a)], axis=-1).reshape(*b.shape[:-1], -1)

    @property
    def num_v_heads(self) -> int:
        return self.a_log.shape[-1]

    @property
    def head_dim(self) -> int:
        return self.conv_out.shape[-1] // (2 * self.num_k_heads + self.num_v_heads)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mamba2Tokens:
    """Prepared Mamba2 inputs: x [B, T, H, P], b, c [B, T, G, N], dt [B, T, H] (after
    softplus and clamping), a [H] (negative), d [H]."""

    x: jax.Array
    b: jax.Array
    c: jax.Array
    dt: jax.Array
    a: jax.Array
    d: jax.Array


@dataclasses.dataclass(frozen=True)
class UpdateTiles:
    """How a Triton-layout update splits and loads its work: ``block_heads`` heads and
    ``block_value`` value columns a program (None: the whole value axis); in decode,
    ``evict_last`` (the state load keeps its lines in L2, ``load_state``) and
    ``skip_padding`` (a padding row, slot 0, reads a zero state instead of slot 0's, not
    reading its bytes; its outputs, discarded, follow from zeros). Both apply to decode
    only."""

    block_heads: int = 1
    block_value: int | None = None
    evict_last: bool = False
    skip_padding: bool = False

    def for_launch(self, mode: str, block_heads: int, block_value: int) -> UpdateTiles:
        """These tiles as a launch in ``mode`` runs them: the checked tile sizes, the
        decode-only loads off in verify."""
        decode = mode == "decode"
        return UpdateTiles(
            block_heads, block_value, self.evict_last and decode, self.skip_padding and decode
        )


DEFAULT_UPDATE_TILES = UpdateTiles()  # a head and the whole value axis a program, plain loads


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StateUpdateResult:
    """outputs [B, T, H, d_v | P]; pool: the updated pool (decode) or None (verify);
    step_states: [B, T, H, d_a, d_b] state after every token (verify) or None (decode)."""

    outputs: jax.Array
    pool: jax.Array | None
    step_states: jax.Array | None


# ---------------------------------------------------------------- shared checks and specs


def check_mode(mode: str) -> None:
    """Raise ValueError unless mode is "decode" or "verify"."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def check_pool(
    pool: jax.Array, slot: jax.Array, state_shape: tuple[int, ...], layer: int | None = None
) -> None:
    """ValueError unless pool is ``[S+1, *state_shape]`` (``[L, S+1, *state_shape]`` with
    ``0 <= layer < L`` when a layer is given) and slot a 1-D integer vector."""
    lead = 1 if layer is None else 2
    if pool.ndim != 3 + lead or pool.shape[lead:] != state_shape:
        raise ValueError(
            f"pool shape {pool.shape} does not match state {state_shape}"
            f"{'' if layer is None else ' with a leading layer axis'}"
        )
    if layer is not None and not 0 <= layer < pool.shape[0]:
        raise ValueError(f"layer={layer} is outside the pool's {pool.shape[0]} layers")
    if slot.ndim != 1 or not jnp.issubdtype(slot.dtype, jnp.integer):
        raise ValueError(f"slot must be a 1-D integer array, got {slot.shape} {slot.dtype}")


def launch_tiles(
    pool: jax.Array,
    slot: jax.Array,
    state_shape: tuple[int, int, int],
    layer: int | None,
    mode: str,
    tiles: UpdateTiles,
    triton_error: Callable[[tuple[int, ...], UpdateTiles], str | None],
    interpret: bool,
    *,
    value_axis: int,
) -> UpdateTiles:
    """The checks of a Triton-layout update's launch, then ``tiles`` as it runs them
    (``UpdateTiles.for_launch``): the pool against ``state_shape`` (``check_pool``), the
    tiles against the heads and the value axis ``state_shape[value_axis]`` (``check_tile``)
    and, compiled, the shapes Triton cannot lower (``triton_error(state_shape, tiles)``), each
    a ValueError."""
    check_pool(pool, slot, state_shape, layer)
    block_heads = check_tile("block_heads", state_shape[0], tiles.block_heads)
    block_value = check_tile("block_value", state_shape[value_axis], tiles.block_value)
    refuse_triton_shapes(interpret, triton_error(state_shape, tiles))
    return tiles.for_launch(mode, block_heads, block_value)


def load_state(pool_ref, idx: tuple, evict_last: bool, live: jax.Array | None = None) -> jax.Array:
    """The state tile ``pool_ref[idx]``. ``evict_last`` asks the cache to keep its lines, so
    that decode's write-back of the same tile finds them in L2 (Mamba2 on an H200: 3-8
    points more of the copy bandwidth, BENCHMARKS.md). ``live`` (a scalar bool) given: where
    it is false the tile is zeros and its bytes are not read (a masked load)."""
    if not evict_last and live is None:
        return pool_ref[idx]
    view = pool_ref.at[idx]
    options = {"eviction_policy": "evict_last"} if evict_last else {}
    if live is not None:
        options.update(mask=jnp.full(view.shape, live), other=0)
    return pallas_triton.load(view, **options)


def load_tile(pool_ref, tile: tuple, slot, tiles: UpdateTiles) -> jax.Array:
    """Pool tile ``tile`` of row ``slot`` in float32, loaded as ``tiles`` say
    (``load_state``; with ``skip_padding`` a padding row, slot 0, reads zeros)."""
    live = slot != 0 if tiles.skip_padding else None
    return load_state(pool_ref, tile, tiles.evict_last, live).astype(jnp.float32)


def scan_tokens(step, h: jax.Array, mode: str, slot, tile: tuple, out_ref, state_ref) -> None:
    """The update kernels' loop over the T tokens of a block from the state tile ``h``:
    ``step(t, h) -> (h, out)``, each output into ``out_ref[t]``; verify writes each step's
    state into ``state_ref[t]``, decode the final state back into pool tile ``tile``
    (``state_ref`` is the aliased pool) unless the row is padding (slot 0)."""
    for t in range(out_ref.shape[0]):
        h, out = step(t, h)
        out_ref[t] = out.astype(out_ref.dtype)
        if mode == "verify":
            state_ref[t] = h.astype(state_ref.dtype)
    if mode == "decode":

        @pl.when(slot != 0)
        def _write_back():
            state_ref[tile] = h.astype(state_ref.dtype)


def pool_index(layer: int | None, slot, *tile) -> tuple:
    """The index of a state tile of row ``slot`` in the pool ref (of ``layer`` when given)."""
    # the layer as an int32 scalar: a Python int in a ref view (``.at``) does not lower
    return ((slot,) if layer is None else (jnp.int32(layer), slot)) + tile


def state_output(
    mode: str,
    pool: jax.Array,
    out_like: jax.Array,
    decode_spec: pl.BlockSpec,
    verify_spec: pl.BlockSpec,
) -> tuple[jax.ShapeDtypeStruct, pl.BlockSpec]:
    """Shape and spec of an update kernel's state output: the (aliased) pool in decode, the
    ``[B, T, *state]`` step states in verify."""
    if mode == "decode":
        return jax.ShapeDtypeStruct(pool.shape, pool.dtype), decode_spec
    batch, num_tokens = out_like.shape[:2]
    steps = jax.ShapeDtypeStruct((batch, num_tokens) + pool.shape[-3:], pool.dtype)
    return steps, verify_spec


def update_result(mode: str, outputs: jax.Array, states: jax.Array) -> StateUpdateResult:
    """The result of a launch whose state output is ``state_output``'s."""
    if mode == "decode":
        return StateUpdateResult(outputs=outputs, pool=states, step_states=None)
    return StateUpdateResult(outputs=outputs, pool=None, step_states=states)


def run_update(
    kernel,
    mode: str,
    pool: jax.Array,
    grid: tuple[int, ...],
    in_specs: list,
    args: tuple,
    out_like: jax.Array,
    out_spec: pl.BlockSpec,
    steps_spec: pl.BlockSpec,
    options: dict[str, Any],
) -> StateUpdateResult:
    """Launch an update kernel whose refs are (*args, out, state): ``state`` is the pool (the
    last arg, aliased) in decode and the ``[B, T, *state]`` step states (``steps_spec``) in
    verify. ``options``: ``interpret`` and ``compiler_params``."""
    state_shape, state_spec = state_output(mode, pool, out_like, whole(), steps_spec)
    outputs, states = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=(out_spec, state_spec),
        out_shape=(jax.ShapeDtypeStruct(out_like.shape, out_like.dtype), state_shape),
        input_output_aliases={len(args) - 1: 1} if mode == "decode" else {},
        **options,
    )(*args)
    return update_result(mode, outputs, states)


# ---------------------------------------------------------------- XLA forms


def xla_update(
    scan,
    pool: jax.Array,
    slot: jax.Array,
    inputs: tuple[jax.Array, ...],
    *,
    mode: str,
    layer: int | None,
    out_dtype: Any,
) -> StateUpdateResult:
    """An XLA form's update: ``scan(states, *inputs)`` (a mixer's scan vmapped over the rows:
    (outputs, final states, step states)) from row b's state ``pool[slot[b]]`` (of ``layer``
    when given), the states and ``inputs`` in float32; the outputs in ``out_dtype``. Decode
    writes the final states back (``xla_write_back``), verify returns the step states in
    the pool's dtype. Pure."""
    f32 = [x.astype(jnp.float32) for x in inputs]
    rows = (pool if layer is None else pool[layer])[slot].astype(jnp.float32)
    outputs, final, states = scan(rows, *f32)
    outputs = outputs.astype(out_dtype)
    if mode == "decode":
        new_pool = xla_write_back(pool, slot, final, layer)
        return StateUpdateResult(outputs=outputs, pool=new_pool, step_states=None)
    return StateUpdateResult(outputs=outputs, pool=None, step_states=states.astype(pool.dtype))


def xla_write_back(
    pool: jax.Array, slot: jax.Array, final: jax.Array, layer: int | None
) -> jax.Array:
    """``pool`` (of ``layer`` when given) with row b's ``final[b]`` at ``slot[b]``, rounded
    to the pool's dtype; rows at slot 0 (padding) write nothing. Pure."""
    slots = pool.shape[0 if layer is None else 1]
    target = jnp.where(slot != 0, slot, slots)  # out of range: dropped
    index = target if layer is None else (layer, target)
    return pool.at[index].set(final.astype(pool.dtype), mode="drop")
