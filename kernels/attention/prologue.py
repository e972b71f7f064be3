"""An attention layer's prologue in one Pallas launch: the q / k RMSNorms, the rotary
embedding and the write of the new K / V rows into the pools.

Contract. ``q [N, Hq, Dq]`` (``Dq >= D``: the first D channels of a head are its query; the
rest, Qwen3-Next's output gate, are neither read nor returned), ``k``, ``v [N, Hkv, D]``
(``Hq % Hkv == 0``), or, read in place out of one product's output, ``q [N, >= Hq, Dq]``
whose first ``num_heads`` heads are the queries and ``k``, ``v [N, Hk, D]`` whose heads
``[k_head_at, k_head_at + Hkv)`` and ``[v_head_at, v_head_at + Hkv)`` are k and v (the same
array twice, viewed by heads of D: ``layers.attention``'s q, k and v in one product), the N
tokens of a ``[B, T]`` batch row-major (``N = B * T``);
``positions``, ``write_idx [B, T]`` and ``num_new [B]`` integers; pools ``[R, Hkv, D]``.
Optional ``q_norm`` / ``k_norm [D]`` (RMSNorm over a head's D channels, float32
statistics, scale ``1 + w`` with ``zero_centered``, rounded to q's dtype), then the
rotate-half rotary embedding of the first ``rotary_dim`` channels at ``positions``
(``layers.rope``: cos / sin in float32 rounded to q's dtype). Returns ``(q_out [N, Hq, D]``
in q's dtype, ``k_pool``, ``v_pool)``: the pools with row ``write_idx[b, t]`` set to token
(b, t)'s k (normed and rotated, in k's dtype, then the pool's) and v, for ``t < num_new[b]``
and ``0 <= write_idx < R``; no other row changes. The reference is the model's own ops
(``layers.attention.project_qkv``'s norms and rotation, then ``write_kv``), which XLA runs
as several fusions and two scatters. Every rounding of those ops is made here too (the
normed heads, cos and sin, each product and sum of the rotation, to q's dtype): on CPU the
two forms are equal bit for bit; XLA on a GPU may keep float32 between the ops it fuses,
so there they agree to q's dtype's rounding.

Kernel: grid ``(token, kv head, query-head tile)``; a program reads its tile of the
``Hq / Hkv`` query heads of its kv head (``block_q_heads``; one tile by default) and writes
them, and the first tile's program the kv head's k and v and, where the token is new, its
pool rows (the pools are whole-array refs aliased in place; the rows are named by
``write_idx`` inside the kernel). A head's channels move as pieces whose widths are powers
of two (Triton): the two halves of the rotated channels, then the passed channels in
power-of-two parts, so the rotation pairs whole pieces and no value is shuffled.

Backends: ``interpret=True`` anywhere (the tests, on CPU); NVIDIA GPUs through the Triton
lowering (``Hq / Hkv`` and the pieces powers of two). Not written for TPUs (whole-array
pool refs would be staged into VMEM).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from lazyspec.kernels.common import check_tile, powers_of_two, whole
from lazyspec.kernels.norm.residual import norm_scale


def pieces(head_dim: int, rotary_dim: int) -> tuple[tuple[int, int], ...]:
    """A head's channels as ``(start, width)`` pieces: with a rotation, its two halves
    first, then the passed channels ``[rotary_dim, head_dim)`` cut into powers of two, the
    largest first."""
    if rotary_dim < 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim={rotary_dim} must be even and in [0, head_dim={head_dim}]")
    half = rotary_dim // 2
    out = [(0, half), (half, half)] if half else []
    start = rotary_dim
    while start < head_dim:
        width = 1 << ((head_dim - start).bit_length() - 1)
        out.append((start, width))
        start += width
    return tuple(out)


def all_powers_of_two(head_dim: int, rotary_dim: int) -> bool:
    """Whether every piece (``pieces``) is a power of two wide, as Triton needs."""
    return powers_of_two(*(width for _, width in pieces(head_dim, rotary_dim)))


def inverse_frequencies(rotary_dim: int, theta: float) -> np.ndarray:
    """The ``rotary_dim // 2`` inverse frequencies ``theta ** (-2i / rotary_dim)`` (float32),
    of this launch and of ``layers.rope``."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)
    return (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["q", "k", "v"],
    meta_fields=["num_heads", "k_head_at", "v_head_at"],
)
@dataclasses.dataclass(frozen=True)
class QKVHeads:
    """The q, k and v a launch reads (module contract): q's first ``num_heads`` heads
    (None: all of them), k's heads from ``k_head_at`` and v's from ``v_head_at`` (one
    product's output read in place: the same array viewed by heads, the three offsets
    apart)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    num_heads: int | None = None
    k_head_at: int = 0
    v_head_at: int = 0

    @property
    def query_heads(self) -> int:
        return self.q.shape[1] if self.num_heads is None else self.num_heads


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["q_norm", "k_norm"],
    meta_fields=["eps", "zero_centered", "rotary_dim", "rope_theta"],
)
@dataclasses.dataclass(frozen=True)
class HeadPrep:
    """What the launch does to each head before the write (module contract): the RMSNorm
    of the ``q_norm`` / ``k_norm`` weights ``[D]`` (None: none; ``eps``, scale ``1 + w``
    with ``zero_centered``), then the rotary embedding of the first ``rotary_dim`` channels
    (0: none) with base ``rope_theta``."""

    q_norm: jax.Array | None = None
    k_norm: jax.Array | None = None
    eps: float = 1e-6
    zero_centered: bool = False
    rotary_dim: int = 0
    rope_theta: float = 10000.0


NO_HEAD_PREP = HeadPrep()


def _prepare(load, weight_ref, parts, *, eps, zero_centered, dtype):
    """The pieces of one head (or heads, on the leading axis) as float32, normed (rounded
    to ``dtype`` as ``rms_norm`` rounds) where a norm weight is given."""
    values = [load(start, width).astype(jnp.float32) for start, width in parts]
    if weight_ref is None:
        return values
    head_dim = sum(width for _, width in parts)
    total = sum(jnp.sum(p * p, axis=-1, keepdims=True) for p in values)
    inv = jax.lax.rsqrt(total / head_dim + eps)
    normed = []
    for (start, width), p in zip(parts, values):
        scale = norm_scale(weight_ref[pl.ds(start, width)], zero_centered)
        normed.append((p * inv * scale).astype(dtype).astype(jnp.float32))
    return normed


def _rotate(values, cos, sin, rotated: bool, dtype):
    """Each piece in ``dtype``; with a rotation, the first two pieces (the halves) become
    ``lo * cos - hi * sin`` and ``hi * cos + lo * sin``, every product and sum rounded to
    ``dtype`` as ``layers.rope.apply_rope``'s ops in that dtype are."""
    if not rotated:
        return [p.astype(dtype) for p in values]

    def rounded(x):
        return x.astype(dtype).astype(jnp.float32)

    lo, hi = values[0], values[1]
    first = rounded(lo * cos) - rounded(hi * sin)
    second = rounded(hi * cos) + rounded(lo * sin)
    return [p.astype(dtype) for p in (first, second, *values[2:])]


def _kernel(*refs, parts, num_tokens, eps, zero_centered, has_q_norm, has_k_norm, rotated):
    """refs: positions, write rows, num_new, q, k, v, the norms' weights given and the
    inverse frequencies where there is a rotation, the pools (aliased), then q's output and
    the pools' outputs."""
    pos_ref, idx_ref, num_new_ref, q_ref, k_ref, v_ref, *rest = refs
    q_norm_ref = rest.pop(0) if has_q_norm else None
    k_norm_ref = rest.pop(0) if has_k_norm else None
    inv_freq_ref = rest.pop(0) if rotated else None
    _, _, q_out_ref, k_pool_ref, v_pool_ref = rest  # the pools' in refs are aliased
    n, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    b, t = n // num_tokens, n % num_tokens
    dtype = q_out_ref.dtype
    cos = sin = None
    if rotated:
        angles = pos_ref[b, t].astype(jnp.float32) * inv_freq_ref[...]
        cos = jnp.cos(angles).astype(dtype).astype(jnp.float32)
        sin = jnp.sin(angles).astype(dtype).astype(jnp.float32)
    options = {"eps": eps, "zero_centered": zero_centered, "dtype": dtype}
    q = _prepare(lambda s, w: q_ref[:, pl.ds(s, w)], q_norm_ref, parts, **options)
    for (start, width), piece in zip(parts, _rotate(q, cos, sin, rotated, dtype)):
        q_out_ref[:, pl.ds(start, width)] = piece
    row = idx_ref[b, t]
    new = (t < num_new_ref[b]) & (row >= 0) & (row < k_pool_ref.shape[0])

    @pl.when(new & (j == 0))  # the kv head's first query-head tile writes its k and v
    def _():
        k = _prepare(lambda s, w: k_ref[pl.ds(s, w)], k_norm_ref, parts, **options)
        k = _rotate(k, cos, sin, rotated, k_ref.dtype)
        for (start, width), piece in zip(parts, k):
            k_pool_ref[row, h, pl.ds(start, width)] = piece.astype(k_pool_ref.dtype)
            values = v_ref[pl.ds(start, width)]
            v_pool_ref[row, h, pl.ds(start, width)] = values.astype(v_pool_ref.dtype)


def _check(qkv: QKVHeads, positions, write_idx, num_new, k_pool, v_pool, prep: HeadPrep) -> None:
    """ValueError unless the arrays fit the module contract."""
    q, k, v = qkv.q, qkv.k, qkv.v
    if q.ndim != 3 or k.ndim != 3 or v.shape != k.shape:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape} must be [N, H, D] with k == v")
    if k_pool.ndim != 3 or k_pool.shape != v_pool.shape:
        raise ValueError(f"pools {k_pool.shape} / {v_pool.shape} must both be [R, Hkv, D]")
    num_kv_heads, head_dim = k_pool.shape[1:]
    num_heads, k_at, v_at = qkv.query_heads, qkv.k_head_at, qkv.v_head_at
    num = k.shape[0]
    if k.shape[2] != head_dim or min(k_at, v_at) < 0 or max(k_at, v_at) + num_kv_heads > k.shape[1]:
        raise ValueError(
            f"k / v {k.shape} must be [N, H, {head_dim}] holding {num_kv_heads} heads from "
            f"{k_at} (k) and {v_at} (v), as the pools {k_pool.shape}"
        )
    if (
        q.shape[0] != num
        or q.shape[2] < head_dim
        or num_heads % num_kv_heads
        or num_heads > q.shape[1]
    ):
        raise ValueError(
            f"q {q.shape} must be [{num}, >= {num_heads} heads (a multiple of {num_kv_heads}), "
            f">= {head_dim}]"
        )
    if positions.ndim != 2 or write_idx.shape != positions.shape or positions.size != num:
        raise ValueError(
            f"positions {positions.shape} and write_idx {write_idx.shape} must be one [B, T] "
            f"of {num} tokens"
        )
    if num_new.shape != positions.shape[:1]:
        raise ValueError(f"num_new {num_new.shape} must be [{positions.shape[0]}]")
    for name, weight in (("q_norm", prep.q_norm), ("k_norm", prep.k_norm)):
        if weight is not None and weight.shape != (head_dim,):
            raise ValueError(f"{name} {weight.shape} must be [{head_dim}]")


def _weight_operands(prep: HeadPrep) -> list[jax.Array]:
    """The launch's operands after q, k and v: the norms' weights given, then the rotary
    inverse frequencies where there is a rotation (each read whole)."""
    operands = [weight for weight in (prep.q_norm, prep.k_norm) if weight is not None]
    if prep.rotary_dim:
        operands.append(jnp.asarray(inverse_frequencies(prep.rotary_dim, prep.rope_theta)))
    return operands


def attention_prologue_pallas(
    qkv: QKVHeads,
    positions: jax.Array,
    write_idx: jax.Array,
    num_new: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    *,
    prep: HeadPrep = NO_HEAD_PREP,
    block_q_heads: int | None = None,
    interpret: bool = False,
    compiler_params: Any = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The launch (module docstring) of ``qkv``'s heads, prepared as ``prep`` says; pure,
    the pools returned (aliased in place). ``block_q_heads``: a program's query heads
    (None: all of its kv head's); the kv head's programs then split its query heads, the
    first of them writing its k and v rows."""
    _check(qkv, positions, write_idx, num_new, k_pool, v_pool, prep)
    q, num_heads = qkv.q, qkv.query_heads
    num = qkv.k.shape[0]
    num_kv_heads, head_dim = k_pool.shape[1:]
    groups = num_heads // num_kv_heads
    block_q = check_tile("block_q_heads", groups, block_q_heads)  # of a kv head's query heads
    tiles = groups // block_q
    ints = [a.astype(jnp.int32) for a in (positions, write_idx, num_new)]
    args = [*ints, q, qkv.k, qkv.v]
    in_specs = [whole()] * 3 + [
        pl.BlockSpec((None, block_q, q.shape[2]), lambda n, h, j: (n, h * tiles + j, 0)),
        pl.BlockSpec((None, None, head_dim), lambda n, h, j: (n, h + qkv.k_head_at, 0)),
        pl.BlockSpec((None, None, head_dim), lambda n, h, j: (n, h + qkv.v_head_at, 0)),
    ]
    args += _weight_operands(prep)
    in_specs += [whole()] * (len(args) - len(in_specs))
    first_pool = len(args)
    args += [k_pool, v_pool]
    in_specs += [whole(), whole()]
    kernel = functools.partial(
        _kernel,
        parts=pieces(head_dim, prep.rotary_dim),
        num_tokens=positions.shape[1],
        eps=prep.eps,
        zero_centered=prep.zero_centered,
        has_q_norm=prep.q_norm is not None,
        has_k_norm=prep.k_norm is not None,
        rotated=bool(prep.rotary_dim),
    )
    return pl.pallas_call(
        kernel,
        grid=(num, num_kv_heads, tiles),
        in_specs=in_specs,
        out_specs=(
            pl.BlockSpec((None, block_q, head_dim), lambda n, h, j: (n, h * tiles + j, 0)),
            whole(),
            whole(),
        ),
        out_shape=(
            jax.ShapeDtypeStruct((num, num_heads, head_dim), q.dtype),
            jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype),
            jax.ShapeDtypeStruct(v_pool.shape, v_pool.dtype),
        ),
        input_output_aliases={first_pool: 1, first_pool + 1: 2},
        name="attention_prologue",
        interpret=interpret,
        compiler_params=compiler_params,
    )(*args)
