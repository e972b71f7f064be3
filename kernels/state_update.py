"""T-step recurrent state update for a padded batch: GDN and Mamba2, Pallas and XLA forms.

Contract (both mixers, both forms). A batch of B rows with T new tokens each reads its
initial state from ``pool[slot[b]]`` (pool ``[num_slots + 1, H, d_a, d_b]``, one layer) and
runs the token-by-token recurrence of ``recurrence.gdn_scan`` / ``recurrence.mamba2_scan``
in float32. ``slot[b] == 0`` marks a padding row: its outputs are computed from slot 0 like
any row's (the Pallas kernels' ``skip_padding``, in decode: from a zero state, slot 0 not
read), and nothing is ever written to slot 0 (so verify, which writes no slot, may use
slot 0 for real data). Real rows must name distinct slots in decode. Two modes:
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
``CompilerParams`` (``backend.pallas_compiler_params``; the tests lower to Triton IR on CPU).
Not for TPUs: Mosaic would stage the whole-array pool into VMEM. The TPU layout, with the
slot ids scalar-prefetched into the index maps, is ``state_update_tpu`` (the dispatch in
``backend`` picks it on a TPU).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pallas_triton

from lazyspec.kernels import recurrence
from lazyspec.kernels.gated_norm import GateLayout, gated_rows

MODES = ("decode", "verify")


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["z_source", "weight"],
    meta_fields=["layout", "eps", "dtype"],
)
@dataclasses.dataclass(frozen=True)
class OutputNorm:
    """The GDN output's gated RMSNorm, applied by the update kernel to each head's output
    row as it computes it (``gated_norm``'s contract and arithmetic, ``gated_rows``):
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
    L2-normed (``recurrence.l2_normalize``; q scaled by d ** -0.5), value head i reading key
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StateUpdateResult:
    """outputs [B, T, H, d_v | P]; pool: the updated pool (decode) or None (verify);
    step_states: [B, T, H, d_a, d_b] state after every token (verify) or None (decode)."""

    outputs: jax.Array
    pool: jax.Array | None
    step_states: jax.Array | None


# ---------------------------------------------------------------- tile-level math


def gdn_tile_step(
    h: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``recurrence.gdn_step`` on a tile: h [bh, d_k, bv], q, k [bh, d_k], v [bh, bv],
    g, beta [bh]. Written with broadcasts and sums only, so it lowers without batched dots."""
    h = h * jnp.exp(g)[:, None, None]
    predicted = jnp.sum(h * k[:, :, None], axis=1)
    delta = (v - predicted) * beta[:, None]
    h = h + k[:, :, None] * delta[:, None, :]
    return h, jnp.sum(h * q[:, :, None], axis=1)


def mamba2_tile_step(
    h: jax.Array,
    x: jax.Array,
    b: jax.Array,
    c: jax.Array,
    dt: jax.Array,
    a: jax.Array,
    d: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """``recurrence.mamba2_step`` on a tile: h [bh, bp, N], x [bh, bp], b, c [bh, N] (already
    per head), dt, a, d [bh]."""
    decay = jnp.exp(dt * a)
    h = h * decay[:, None, None] + (dt[:, None] * x)[:, :, None] * b[:, None, :]
    return h, jnp.sum(h * c[:, None, :], axis=2) + d[:, None] * x


# ---------------------------------------------------------------- shared checks and specs


def check_mode(mode: str) -> None:
    """Raise ValueError unless mode is "decode" or "verify"."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def check_tile(name: str, size: int, block: int | None) -> int:
    """The tile size for an axis of ``size`` (None = whole axis); ValueError unless it divides."""
    block = size if block is None else block
    if block <= 0 or size % block:
        raise ValueError(f"{name}={block} must be a positive divisor of {size}")
    return block


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


def whole() -> pl.BlockSpec:
    """A block that is the whole array (indexed inside the kernel)."""
    return pl.BlockSpec()


def powers_of_two(*sizes: int) -> bool:
    """Whether every size is a power of two, as a Triton block's dimensions must be."""
    return all(n & (n - 1) == 0 for n in sizes)


def load_rows(view, first, num_rows: int) -> jax.Array:
    """``view[...]``, a tile of ``view.shape[0]`` rows starting at row ``first`` (a multiple
    of that count) of an array of ``num_rows`` rows, read with the rows past the array as
    zeros (a masked load) where the last tile is partial: no padded copy of the array is
    needed. Where every tile is whole, a plain load."""
    if num_rows % view.shape[0] == 0:
        return view[...]
    index = first + jax.lax.broadcasted_iota(jnp.int32, view.shape, 0)
    return pallas_triton.load(view, mask=index < num_rows, other=0)


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


def _run_update(
    kernel,
    mode: str,
    pool: jax.Array,
    grid: tuple[int, ...],
    in_specs: list,
    args: tuple,
    out_like: jax.Array,
    out_spec: pl.BlockSpec,
    state_block: tuple,
    state_index,
    interpret: bool,
    compiler_params: Any,
) -> StateUpdateResult:
    """Launch an update kernel whose refs are (*args, out, state): ``state`` is the pool (the
    last arg, aliased) in decode and the ``[B, T, *state]`` step states in verify."""
    state_shape, state_spec = state_output(
        mode, pool, out_like, whole(), pl.BlockSpec(state_block, state_index)
    )
    outputs, states = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=(out_spec, state_spec),
        out_shape=(jax.ShapeDtypeStruct(out_like.shape, out_like.dtype), state_shape),
        input_output_aliases={len(args) - 1: 1} if mode == "decode" else {},
        interpret=interpret,
        compiler_params=compiler_params,
    )(*args)
    return update_result(mode, outputs, states)


# ---------------------------------------------------------------- GDN


def _f32(ref, *idx) -> jax.Array:
    return ref[idx].astype(jnp.float32)


def _conv_token_loader(refs, heads, block_heads, per_key):
    """``GdnConvTokens``' per-token tiles, finished as ``GdnTokens`` holds them: refs are q,
    k (the tile's one key head), v, a, b, a_log, dt_bias, num_new. ``per_key`` (value heads
    per key head) given: a and b are the grouped projection (``GdnConvTokens.grouped``), the
    tile's columns found in it (a tile's heads share one key head)."""
    q_ref, k_ref, v_ref, a_ref, b_ref, a_log_ref, dt_bias_ref, num_new_ref = refs
    decay = -jnp.exp(_f32(a_log_ref, heads))
    dt_bias = _f32(dt_bias_ref, heads)
    num_new = num_new_ref[pl.program_id(0)]
    width = q_ref.shape[-1]
    a_cols = b_cols = heads
    if per_key is not None:  # key head h // per_key holds [b of its heads, a of its heads]
        first = pl.program_id(1) * block_heads
        b_start = first + jax.lax.div(first, per_key) * per_key
        b_cols = pl.ds(b_start, block_heads)
        a_cols = pl.ds(b_start + per_key, block_heads)

    def token(t):
        q = recurrence.l2_normalize(_f32(q_ref, t)) * width**-0.5
        k = recurrence.l2_normalize(_f32(k_ref, t))
        live = t < num_new
        g = jnp.where(live, decay * jax.nn.softplus(_f32(a_ref, t, a_cols) + dt_bias), 0.0)
        beta = jnp.where(live, jax.nn.sigmoid(_f32(b_ref, t, b_cols)), 0.0)
        repeat = (block_heads, width)
        return jnp.broadcast_to(q, repeat), jnp.broadcast_to(k, repeat), _f32(v_ref, t), g, beta

    return token


def _gdn_kernel(
    slot_ref,
    *refs,
    mode,
    block_heads,
    block_value,
    evict_last,
    layer,
    per_key,
    norm=None,
    skip_padding=False,
):
    """refs: q, k, v, g, beta (``GdnTokens``) or ``_conv_token_loader``'s eight (then, with
    ``norm`` = (eps, dtype) of an ``OutputNorm``, the head's gate block and the norm's
    weight), then the pool, the outputs and the state output."""
    pool_ref, out_ref, state_ref = refs[-3:]
    slot = slot_ref[pl.program_id(0)]
    heads = pl.ds(pl.program_id(1) * block_heads, block_heads)
    cols = pl.ds(pl.program_id(2) * block_value, block_value)
    tile = pool_index(layer, slot, heads, slice(None), cols)
    live = slot != 0 if skip_padding else None
    h = load_state(pool_ref, tile, evict_last, live).astype(jnp.float32)
    if len(refs) == 8:
        q_ref, k_ref, v_ref, g_ref, beta_ref = refs[:5]

        def token(t):
            return (
                _f32(q_ref, t),
                _f32(k_ref, t),
                _f32(v_ref, t),
                _f32(g_ref, t, heads),
                _f32(beta_ref, t, heads),
            )

    else:
        token = _conv_token_loader(refs[:8], heads, block_heads, per_key)
    for t in range(out_ref.shape[0]):
        h, out = gdn_tile_step(h, *token(t))
        if norm is not None:  # [1, d]: the head's whole row
            z_ref, weight_ref = refs[8:10]
            eps, dtype = norm
            out = gated_rows(out, z_ref[t][None, :], weight_ref[...], eps=eps, dtype=dtype)
        out_ref[t] = out.astype(out_ref.dtype)
        if mode == "verify":
            state_ref[t] = h.astype(state_ref.dtype)
    if mode == "decode":

        @pl.when(slot != 0)
        def _write_back():
            state_ref[tile] = h.astype(state_ref.dtype)


def _conv_token_specs(tokens: GdnConvTokens, block_heads: int, block_value: int):
    """(in specs, arrays) of ``GdnConvTokens`` for the grid ``(row, head tile, value
    tile)``: q and k blocks of the tile's key head and the v block straight out of the conv
    output (viewed ``[B, T, heads, d]``, a reshape), the rest whole."""
    batch, num_tokens, _ = tokens.conv_out.shape
    num_k, num_v, width = tokens.num_k_heads, tokens.num_v_heads, tokens.head_dim
    per_key = num_v // num_k
    if (2 * num_k + num_v) * width != tokens.conv_out.shape[-1] or num_v % num_k:
        raise ValueError(
            f"conv_out {tokens.conv_out.shape} must hold {num_k} q, {num_k} k and {num_v} v "
            "heads of one width, the value heads a multiple of the key heads"
        )
    gate_width = 2 * num_v if tokens.gates_per_key else num_v
    for name in ("a", "b"):
        if getattr(tokens, name).shape != (batch, num_tokens, gate_width):
            raise ValueError(
                f"{name} {getattr(tokens, name).shape} must be {(batch, num_tokens, gate_width)}"
            )
    if per_key % block_heads or (2 * num_k) % block_heads:
        raise ValueError(f"block_heads={block_heads} must divide {per_key} and {2 * num_k}")
    heads = tokens.conv_out.reshape(batch, num_tokens, -1, width)
    key = lambda first: pl.BlockSpec(  # noqa: E731
        (None, num_tokens, 1, width),
        lambda b, i, j: (b, 0, first + jax.lax.div(i * block_heads, per_key), 0),
    )
    first_v = 2 * num_k // block_heads
    values = pl.BlockSpec(
        (None, num_tokens, block_heads, block_value), lambda b, i, j: (b, 0, first_v + i, j)
    )
    per_head = pl.BlockSpec((None, num_tokens, gate_width), lambda b, i, j: (b, 0, 0))
    specs = [key(0), key(num_k), values, per_head, per_head, whole(), whole(), whole()]
    arrays = (heads, heads, heads, tokens.a, tokens.b, tokens.a_log, tokens.dt_bias)
    arrays += (tokens.num_new.astype(jnp.int32),)
    if tokens.norm is not None:  # head i's gate block (one head a tile), the weight whole
        layout = tokens.norm.layout
        per_group, group_width, offset = layout.heads_per_group, layout.group_width, layout.offset

        def gate_block(b, i, j):
            group, slot = jax.lax.div(i, per_group), jax.lax.rem(i, per_group)
            return b, 0, (group * group_width + offset) // width + slot

        specs += [pl.BlockSpec((None, num_tokens, width), gate_block), whole()]
        arrays += (tokens.norm.z_source, tokens.norm.weight)
    return specs, arrays


def _check_output_norm(tokens: GdnConvTokens, block_heads: int, block_value: int) -> None:
    """ValueError unless the kernel can apply ``tokens.norm``: a program a whole head, and
    the gates where the layout puts them, in whole head-wide blocks."""
    norm, width = tokens.norm, tokens.head_dim
    batch, num_tokens = tokens.conv_out.shape[:2]
    if block_heads != 1 or block_value != width:
        raise ValueError(
            f"the output norm needs a program a head: block_heads={block_heads} must be 1 "
            f"and block_value={block_value} the head's {width}"
        )
    layout, heads = norm.layout, tokens.num_v_heads
    groups, rest = divmod(heads, layout.heads_per_group)
    z_shape = (batch, num_tokens, groups * layout.group_width)
    inside = layout.offset + layout.heads_per_group * width <= layout.group_width
    if rest or not inside or not layout.in_whole_blocks(width) or norm.z_source.shape != z_shape:
        raise ValueError(f"{layout} does not place {heads} gates of {width} in {z_shape}")
    if norm.weight.shape != (width,):
        raise ValueError(f"the output norm's weight {norm.weight.shape} must be [{width}]")


def gdn_state_update_pallas(
    pool: jax.Array,
    slot: jax.Array,
    tokens: GdnTokens | GdnConvTokens,
    *,
    mode: str,
    block_heads: int = 1,
    block_value: int | None = None,
    evict_last: bool = False,
    layer: int | None = None,
    skip_padding: bool = False,
    interpret: bool = False,
    compiler_params: Any = None,
) -> StateUpdateResult:
    """Pallas GDN update (module docstring has the contract). Decode mutates ``pool`` only
    through the returned (aliased) array; ``evict_last`` (decode only) is ``load_state``'s;
    ``skip_padding`` (decode only): a padding row (slot 0) reads a zero state instead of
    slot 0's, not reading its bytes (its outputs, discarded, follow from zeros)."""
    check_mode(mode)
    if isinstance(tokens, GdnConvTokens):
        batch, num_tokens, _ = tokens.conv_out.shape
        num_heads, key_dim = tokens.num_v_heads, tokens.head_dim
        value_dim = key_dim
    else:
        batch, num_tokens, num_heads, key_dim = tokens.q.shape
        value_dim = tokens.v.shape[-1]
    check_pool(pool, slot, (num_heads, key_dim, value_dim), layer)
    bh = check_tile("block_heads", num_heads, block_heads)
    bv = check_tile("block_value", value_dim, block_value)
    values = pl.BlockSpec((None, num_tokens, bh, bv), lambda b, i, j: (b, 0, i, j))
    per_key = norm = None
    if isinstance(tokens, GdnConvTokens):
        token_specs, token_arrays = _conv_token_specs(tokens, bh, bv)
        if tokens.gates_per_key:
            per_key = num_heads // tokens.num_k_heads
        out_dtype = jnp.float32
        if tokens.norm is not None:
            _check_output_norm(tokens, bh, bv)
            norm, out_dtype = (tokens.norm.eps, tokens.norm.dtype), tokens.norm.dtype
        out_like = jax.ShapeDtypeStruct((batch, num_tokens, num_heads, value_dim), out_dtype)
    else:
        keys = pl.BlockSpec((None, num_tokens, bh, key_dim), lambda b, i, j: (b, 0, i, 0))
        per_head = pl.BlockSpec((None, num_tokens, num_heads), lambda b, i, j: (b, 0, 0))
        token_specs = [keys, keys, values, per_head, per_head]
        token_arrays = (tokens.q, tokens.k, tokens.v, tokens.g, tokens.beta)
        out_like = tokens.v

    def gdn_update(*refs):  # the kernel's name in profiles
        _gdn_kernel(
            *refs,
            mode=mode,
            block_heads=bh,
            block_value=bv,
            evict_last=evict_last and mode == "decode",
            layer=layer,
            per_key=per_key,
            norm=norm,
            skip_padding=skip_padding and mode == "decode",
        )

    return _run_update(
        gdn_update,
        mode,
        pool,
        (batch, num_heads // bh, value_dim // bv),
        [whole(), *token_specs, whole()],
        (slot, *token_arrays, pool),
        out_like,
        values,
        (None, num_tokens, bh, key_dim, bv),
        lambda b, i, j: (b, 0, i, 0, j),
        interpret,
        compiler_params,
    )


# ---------------------------------------------------------------- Mamba2


def _heads_from_groups(
    bc_ref, t: int, head_start: jax.Array, block_heads: int, heads_per_group: int
) -> jax.Array:
    """The [block_heads, N] rows of b or c read by heads head_start.. (head i -> group
    i // heads_per_group); the tile never straddles a group partially."""
    group = jax.lax.div(head_start, heads_per_group)  # truncating: no sign fix-ups to lower
    if block_heads <= heads_per_group:
        row = bc_ref[t, group, :].astype(jnp.float32)
        return jnp.broadcast_to(row[None, :], (block_heads, row.shape[0]))
    groups = bc_ref[t, pl.ds(group, block_heads // heads_per_group), :]
    return jnp.repeat(groups.astype(jnp.float32), heads_per_group, axis=0)


def _mamba2_kernel(
    slot_ref,
    x_ref,
    b_ref,
    c_ref,
    dt_ref,
    a_ref,
    d_ref,
    pool_ref,
    out_ref,
    state_ref,
    *,
    mode,
    block_heads,
    block_value,
    heads_per_group,
    evict_last,
    layer,
    skip_padding=False,
):
    slot = slot_ref[pl.program_id(0)]
    head_start = pl.program_id(1) * block_heads
    heads = pl.ds(head_start, block_heads)
    rows = pl.ds(pl.program_id(2) * block_value, block_value)
    tile = pool_index(layer, slot, heads, rows, slice(None))
    live = slot != 0 if skip_padding else None
    h = load_state(pool_ref, tile, evict_last, live).astype(jnp.float32)
    a = a_ref[heads].astype(jnp.float32)
    d = d_ref[heads].astype(jnp.float32)
    for t in range(x_ref.shape[0]):
        b = _heads_from_groups(b_ref, t, head_start, block_heads, heads_per_group)
        c = _heads_from_groups(c_ref, t, head_start, block_heads, heads_per_group)
        h, y = mamba2_tile_step(
            h, x_ref[t].astype(jnp.float32), b, c, dt_ref[t, heads].astype(jnp.float32), a, d
        )
        out_ref[t] = y.astype(out_ref.dtype)
        if mode == "verify":
            state_ref[t] = h.astype(state_ref.dtype)
    if mode == "decode":

        @pl.when(slot != 0)
        def _write_back():
            state_ref[tile] = h.astype(state_ref.dtype)


def _check_groups(num_heads: int, num_groups: int, block_heads: int) -> int:
    if num_groups <= 0 or num_heads % num_groups:
        raise ValueError(f"num_groups={num_groups} must divide num_heads={num_heads}")
    per_group = num_heads // num_groups
    if per_group % block_heads and block_heads % per_group:
        raise ValueError(
            f"block_heads={block_heads} must divide or be a multiple of the "
            f"{per_group} heads per group"
        )
    return per_group


def mamba2_state_update_pallas(
    pool: jax.Array,
    slot: jax.Array,
    tokens: Mamba2Tokens,
    *,
    mode: str,
    block_heads: int = 1,
    block_value: int | None = None,
    evict_last: bool = False,
    layer: int | None = None,
    skip_padding: bool = False,
    interpret: bool = False,
    compiler_params: Any = None,
) -> StateUpdateResult:
    """Pallas Mamba2 update (module docstring has the contract); value tiles split P;
    ``evict_last`` and ``skip_padding`` (decode only) as in ``gdn_state_update_pallas``."""
    check_mode(mode)
    batch, num_tokens, num_heads, head_dim = tokens.x.shape
    num_groups, state_dim = tokens.b.shape[2:]
    check_pool(pool, slot, (num_heads, head_dim, state_dim), layer)
    bh = check_tile("block_heads", num_heads, block_heads)
    bp = check_tile("block_value", head_dim, block_value)
    per_group = _check_groups(num_heads, num_groups, bh)
    values = pl.BlockSpec((None, num_tokens, bh, bp), lambda b, i, j: (b, 0, i, j))
    groups = pl.BlockSpec((None, num_tokens, num_groups, state_dim), lambda b, i, j: (b, 0, 0, 0))
    per_head = pl.BlockSpec((None, num_tokens, num_heads), lambda b, i, j: (b, 0, 0))

    def mamba2_update(*refs):  # the kernel's name in profiles
        _mamba2_kernel(
            *refs,
            mode=mode,
            block_heads=bh,
            block_value=bp,
            heads_per_group=per_group,
            evict_last=evict_last and mode == "decode",
            layer=layer,
            skip_padding=skip_padding and mode == "decode",
        )

    return _run_update(
        mamba2_update,
        mode,
        pool,
        (batch, num_heads // bh, head_dim // bp),
        [whole(), values, groups, groups, per_head, whole(), whole(), whole()],
        (slot, tokens.x, tokens.b, tokens.c, tokens.dt, tokens.a, tokens.d, pool),
        tokens.x,
        values,
        (None, num_tokens, bh, bp, state_dim),
        lambda b, i, j: (b, 0, i, j, 0),
        interpret,
        compiler_params,
    )


# ---------------------------------------------------------------- XLA forms


def _rows(pool: jax.Array, slot: jax.Array, layer: int | None) -> jax.Array:
    """Row b's state ``pool[slot[b]]`` (of ``layer`` when given) in float32."""
    return (pool if layer is None else pool[layer])[slot].astype(jnp.float32)


def _xla_finish(
    pool: jax.Array,
    slot: jax.Array,
    mode: str,
    outputs: jax.Array,
    final: jax.Array,
    states: jax.Array,
    layer: int | None,
) -> StateUpdateResult:
    if mode == "decode":
        slots = pool.shape[0 if layer is None else 1]
        target = jnp.where(slot != 0, slot, slots)  # out of range: dropped
        index = target if layer is None else (layer, target)
        new_pool = pool.at[index].set(final.astype(pool.dtype), mode="drop")
        return StateUpdateResult(outputs=outputs, pool=new_pool, step_states=None)
    return StateUpdateResult(outputs=outputs, pool=None, step_states=states.astype(pool.dtype))


def gdn_state_update_xla(
    pool: jax.Array, slot: jax.Array, tokens: GdnTokens, *, mode: str, layer: int | None = None
) -> StateUpdateResult:
    """Same contract as ``gdn_state_update_pallas``: gather, vmapped ``gdn_scan``, masked
    scatter."""
    check_mode(mode)
    check_pool(pool, slot, (tokens.q.shape[2], tokens.q.shape[3], tokens.v.shape[3]), layer)
    f32 = [x.astype(jnp.float32) for x in (tokens.q, tokens.k, tokens.v, tokens.g, tokens.beta)]
    outs, final, states = jax.vmap(recurrence.gdn_scan)(_rows(pool, slot, layer), *f32)
    return _xla_finish(pool, slot, mode, outs.astype(tokens.v.dtype), final, states, layer)


def mamba2_state_update_xla(
    pool: jax.Array, slot: jax.Array, tokens: Mamba2Tokens, *, mode: str, layer: int | None = None
) -> StateUpdateResult:
    """Same contract as ``mamba2_state_update_pallas``, through a vmapped ``mamba2_scan``."""
    check_mode(mode)
    check_pool(pool, slot, (tokens.x.shape[2], tokens.x.shape[3], tokens.b.shape[3]), layer)
    _check_groups(tokens.x.shape[2], tokens.b.shape[2], 1)
    f32 = [
        t.astype(jnp.float32) for t in (tokens.x, tokens.b, tokens.c, tokens.dt, tokens.a, tokens.d)
    ]
    scan = jax.vmap(recurrence.mamba2_scan, in_axes=(0, 0, 0, 0, 0, None, None))
    outs, final, states = scan(_rows(pool, slot, layer), *f32)
    return _xla_finish(pool, slot, mode, outs.astype(tokens.x.dtype), final, states, layer)
