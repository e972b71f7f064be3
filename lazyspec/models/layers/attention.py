"""Causal self-attention over the flat KV pools of ``interface.py`` (and a pool-free form).

One function family serves every model: options in ``AttentionSpec`` switch on the q/k
RMSNorm, the per-head sigmoid output gate folded into ``q_proj`` (Qwen3-Next), partial or
no rotary embedding, projection biases, a softmax scale other than ``head_dim ** -0.5``
(Granite's ``attention_multiplier``) and GQA.

Params (see ``mlp.linear`` for the linear layout): ``q_proj``, ``k_proj``, ``v_proj``,
``o_proj`` and, with ``qk_norm``, the weight vectors ``q_norm`` / ``k_norm`` ``[head_dim]``.
With ``output_gate``, ``q_proj`` emits ``[num_heads, 2 * head_dim]`` per token: the query
then the gate of each head.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from lazyspec.kernels.attention.inputs import PagedInputs
from lazyspec.kernels.attention.paged import gated
from lazyspec.kernels.attention.walk import paged_attend
from lazyspec.kernels.backend import (
    XLA_KERNELS,
    AttentionPrologueFn,
    Kernels,
    reads_qkv_in_place,
)
from lazyspec.models.interface import ForwardInputs
from lazyspec.models.layers.linear import linear, project_out
from lazyspec.models.layers.norms import rms_norm
from lazyspec.models.layers.rope import apply_rope, rope_cos_sin
from lazyspec.models.plan import Params, TensorSpec, linear_spec

MASK_VALUE = -1e30  # finite, so a fully masked (padding) query gives no NaN


@dataclass(frozen=True)
class AttentionSpec:
    """Static shape and option facts of one attention layer."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int = 0  # 0 = no rotary embedding
    rope_theta: float = 10000.0
    qk_norm: bool = False
    zero_centered_qk_norm: bool = False  # Qwen3-Next q/k norms scale by (1 + w)
    output_gate: bool = False
    norm_eps: float = 1e-6
    bias: bool = False  # q/k/v/o projection biases
    scaling: float | None = None  # softmax scale; None = head_dim ** -0.5

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5 if self.scaling is None else self.scaling


# Logical axes of the projections: head-major columns (rows for o_proj), so a shard of
# the heads axis holds whole heads (and, with output_gate, each head's gate beside it).
_Q, _KV, _O = ("embed", "q_heads"), ("embed", "kv_heads"), ("q_heads", "embed")


def attention_plan(prefix: str, hidden_size: int, spec: AttentionSpec) -> Params:
    """Checkpoint plan of one attention layer whose modules sit under ``prefix``."""
    q_width = spec.num_heads * spec.head_dim * (2 if spec.output_gate else 1)
    kv_width = spec.num_kv_heads * spec.head_dim
    o_width, bias = spec.num_heads * spec.head_dim, spec.bias
    plan = {
        "q_proj": linear_spec(f"{prefix}.q_proj", hidden_size, q_width, bias, axes=_Q),
        "k_proj": linear_spec(f"{prefix}.k_proj", hidden_size, kv_width, bias, axes=_KV),
        "v_proj": linear_spec(f"{prefix}.v_proj", hidden_size, kv_width, bias, axes=_KV),
        "o_proj": linear_spec(f"{prefix}.o_proj", o_width, hidden_size, bias, axes=_O),
    }
    if spec.qk_norm:
        init = "zeros" if spec.zero_centered_qk_norm else "ones"
        for name in ("q_norm", "k_norm"):
            plan[name] = TensorSpec(f"{prefix}.{name}.weight", (spec.head_dim,), init=init)
    return plan


def _projections(
    params: Params, spec: AttentionSpec, x: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The raw projections: q ``[..., Hq, Dq]`` (``Dq = 2 * D`` with ``output_gate``: a
    head's query then its gate), k, v ``[..., Hkv, D]``."""
    lead = x.shape[:-1]
    q_out = linear(params["q_proj"], x).reshape(*lead, spec.num_heads, -1)
    k = linear(params["k_proj"], x).reshape(*lead, spec.num_kv_heads, spec.head_dim)
    v = linear(params["v_proj"], x).reshape(*lead, spec.num_kv_heads, spec.head_dim)
    return q_out, k, v


def _gate(spec: AttentionSpec, q_out: jax.Array) -> jax.Array | None:
    """The output gate ``[..., Hq * D]`` (pre-sigmoid) with ``output_gate``, else None."""
    if not spec.output_gate:
        return None
    return q_out[..., spec.head_dim :].reshape(*q_out.shape[:-2], -1)


def norm_rope(
    params: Params, spec: AttentionSpec, q: jax.Array, k: jax.Array, positions: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """q ``[..., T, Hq, D]`` and k ``[..., T, Hkv, D]`` normed (``qk_norm``) and rotated at
    ``positions [..., T]``."""
    if spec.qk_norm:
        zc = spec.zero_centered_qk_norm
        q = rms_norm(q, params["q_norm"], spec.norm_eps, zero_centered=zc)
        k = rms_norm(k, params["k_norm"], spec.norm_eps, zero_centered=zc)
    if spec.rotary_dim:
        cos, sin = rope_cos_sin(positions, spec.rotary_dim, spec.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return q, k


def project_qkv(
    params: Params, spec: AttentionSpec, x: jax.Array, positions: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """q ``[B, T, Hq, D]``, k, v ``[B, T, Hkv, D]`` (normed and rotated) and the gate.

    The gate is ``[B, T, Hq * D]`` (pre-sigmoid) with ``output_gate``, else None.
    """
    q_out, k, v = _projections(params, spec, x)
    q, k = norm_rope(params, spec, q_out[..., : spec.head_dim], k, positions)
    return q, k, v, _gate(spec, q_out)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """Masked softmax attention with GQA.

    q ``[B, T, Hq, D]``, k/v ``[B, C, Hkv, D]``, mask ``[B, T, C]`` (True = may attend).
    Scores and softmax in float32; returns ``[B, T, Hq, D]`` in v's dtype.
    """
    batch, num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    groups = num_heads // num_kv_heads
    q = q.reshape(batch, num_tokens, num_kv_heads, groups, head_dim)
    scores = jnp.einsum("btkgd,bckd->bkgtc", q, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, None, None], scores * scale, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum(
        "bkgtc,bckd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
    )
    return out.reshape(batch, num_tokens, num_heads, head_dim).astype(v.dtype)


def _output(params: Params, attn: jax.Array, gate: jax.Array | None, parts: int = 0) -> jax.Array:
    """Flatten heads, apply the sigmoid output gate if any, then ``o_proj`` (with
    ``parts``, its float32 partial sums: ``linear.project_out``)."""
    return project_out(params["o_proj"], gated(attn.reshape(*attn.shape[:-2], -1), gate), parts)


def write_kv(
    k_pool: jax.Array,
    v_pool: jax.Array,
    k: jax.Array,
    v: jax.Array,
    write_idx: jax.Array,
    num_new: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Scatter new K/V ``[B, T, Hkv, D]`` to pool rows ``write_idx [B, T]``.

    Tokens at ``t >= num_new[b]`` and out-of-range indices are dropped; returns new pools.
    """
    num_rows = k_pool.shape[0]
    t = jnp.arange(write_idx.shape[1])[None, :]
    idx = jnp.where(t < num_new[:, None], write_idx, num_rows).reshape(-1)
    k_flat = k.reshape(-1, *k.shape[2:]).astype(k_pool.dtype)
    v_flat = v.reshape(-1, *v.shape[2:]).astype(v_pool.dtype)
    k_pool = k_pool.at[idx].set(k_flat, mode="drop")
    v_pool = v_pool.at[idx].set(v_flat, mode="drop")
    return k_pool, v_pool


def _one_product(params: Params, spec: AttentionSpec, x: jax.Array) -> jax.Array:
    """q, k and v in one product, ``x @ [q_proj | k_proj | v_proj]`` (the biases likewise):
    ``[..., Hq * Dq + 2 * Hkv * D]``, the three outputs side by side."""
    names = ("q_proj", "k_proj", "v_proj")
    merged = {"weight": jnp.concatenate([params[n]["weight"] for n in names], axis=1)}
    if spec.bias:
        merged["bias"] = jnp.concatenate([params[n]["bias"] for n in names])
    return linear(merged, x)


def _prologue(
    params: Params,
    spec: AttentionSpec,
    x: jax.Array,
    inputs: ForwardInputs,
    k_pool: jax.Array,
    v_pool: jax.Array,
    prologue: AttentionPrologueFn,
) -> tuple[jax.Array, jax.Array | None, jax.Array, jax.Array]:
    """The projections, then the norms, the rotation and the K / V write in ``prologue``
    (a ``Kernels`` entry, handed these ops as its XLA form): (q ``[B, T, Hq, D]``, the
    gate ``[B, T, Hg, Dg]`` as ``paged_attention`` reads it (each head's last D channels),
    k_pool, v_pool). Where the prologue ``reads_qkv_in_place``, q, k and v are one product
    (``_one_product``) whose output the prologue reads by heads and whose q part, each
    head's query then its gate, is the gate: no slice of it is copied out."""
    lead = x.shape[:-1]
    flat = lambda a: a.reshape(-1, *a.shape[-2:])  # noqa: E731  [B * T, H, D]
    q_width = spec.head_dim * (2 if spec.output_gate else 1)  # a head's query, then its gate
    if reads_qkv_in_place(prologue):
        out = _one_product(params, spec, x)
        rows = out.reshape(-1, out.shape[-1])
        by_head = rows.reshape(rows.shape[0], -1, spec.head_dim)
        k_at = spec.num_heads * q_width // spec.head_dim
        views = (rows.reshape(rows.shape[0], -1, q_width), by_head, by_head)
        heads = {"num_heads": spec.num_heads, "k_head_at": k_at}
        heads["v_head_at"] = k_at + spec.num_kv_heads
        gate = out.reshape(*lead, -1, q_width) if spec.output_gate else None

        def parts():  # the three outputs sliced out, for the XLA form only
            ends = [k_at * spec.head_dim, (k_at + spec.num_kv_heads) * spec.head_dim]
            q_out, k, v = jnp.split(out, ends, axis=-1)
            kv = (*lead, spec.num_kv_heads, spec.head_dim)
            return q_out.reshape(*lead, spec.num_heads, q_width), k.reshape(kv), v.reshape(kv)

    else:
        q_out, k, v = _projections(params, spec, x)
        views, heads = (flat(q_out), flat(k), flat(v)), {}
        gate = _gate(spec, q_out)
        gate = None if gate is None else gate.reshape(*lead, spec.num_heads, spec.head_dim)

        def parts():
            return q_out, k, v

    def xla_form():
        q_out, k, v = parts()
        q, k_new = norm_rope(params, spec, q_out[..., : spec.head_dim], k, inputs.positions)
        pools = write_kv(k_pool, v_pool, k_new, v, inputs.kv_write_idx, inputs.num_new)
        return (q.reshape(-1, *q.shape[-2:]), *pools)

    norms = [params["q_norm"], params["k_norm"]] if spec.qk_norm else [None, None]
    q, k_pool, v_pool = prologue(
        *views,
        inputs.positions,
        inputs.kv_write_idx,
        inputs.num_new,
        k_pool,
        v_pool,
        *norms,
        eps=spec.norm_eps,
        zero_centered=spec.zero_centered_qk_norm,
        rotary_dim=spec.rotary_dim,
        rope_theta=spec.rope_theta,
        xla_form=xla_form,
        **heads,
    )
    return q.reshape(*lead, *q.shape[1:]), gate, k_pool, v_pool


@jax.named_scope("attention")
def attention_forward(
    params: Params,
    spec: AttentionSpec,
    x: jax.Array,
    inputs: ForwardInputs,
    k_pool: jax.Array,
    v_pool: jax.Array,
    kernels: Kernels = XLA_KERNELS,
    out_parts: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One attention layer over the pools: write the new K/V, then attend to the context.

    x ``[B, T, hidden]`` (the step's new tokens, ``inputs``); query t of row b sees context
    positions ``c < ctx_len[b]`` with ``c <= positions[b, t]``. With the ``kernels``'
    ``paged_attention`` the attention runs in that kernel, which reads only the table
    entries below ``ctx_len`` and applies the output gate; with their
    ``attention_prologue`` too, the norms, the rotation and the K/V write run in that one.
    Without, ``paged_attend`` walks the ``kv_read_idx`` table in blocks of the tuning's
    ``xla_block_kv`` positions up to the batch's longest context, so the cost follows the
    lengths, not C. Returns (output ``[B, T, hidden]``, k_pool, v_pool); with ``out_parts``
    the output is ``o_proj``'s float32 partial sums ``[out_parts, B, T, hidden]``
    (``linear.linear_parts``), for a residual norm that sums them.
    """
    paged_attention, prologue = kernels.paged_attention, kernels.attention_prologue
    if paged_attention is not None and prologue is not None:
        q, gate, k_pool, v_pool = _prologue(params, spec, x, inputs, k_pool, v_pool, prologue)
    else:
        q, k, v, gate = project_qkv(params, spec, x, inputs.positions)
        k_pool, v_pool = write_kv(k_pool, v_pool, k, v, inputs.kv_write_idx, inputs.num_new)
        if paged_attention is not None and gate is not None:
            gate = gate.reshape(q.shape)
    tables = (inputs.kv_read_idx, inputs.ctx_len, inputs.positions)
    paged = PagedInputs(q, k_pool, v_pool, *tables)
    if paged_attention is not None:  # the kernel applies the gate as it writes its output
        out = paged_attention(paged, spec.scale, gate=gate)
        return _output(params, out, None, out_parts), k_pool, v_pool
    out = paged_attend(paged, spec.scale, kernels.tuning.attention.xla_block_kv)
    return _output(params, out, gate, out_parts), k_pool, v_pool


def attention_reference(
    params: Params, spec: AttentionSpec, x: jax.Array, positions: jax.Array
) -> jax.Array:
    """Dense causal attention over the full sequence, no pools: x ``[B, T, hidden]``.

    Token t attends to tokens ``s <= t`` of its own row. Returns ``[B, T, hidden]``.
    """
    q, k, v, gate = project_qkv(params, spec, x, positions)
    num_tokens = x.shape[1]
    causal = jnp.tril(jnp.ones((num_tokens, num_tokens), dtype=bool))
    mask = jnp.broadcast_to(causal, (x.shape[0], num_tokens, num_tokens))
    return _output(params, attend(q, k, v, mask, spec.scale), gate)
