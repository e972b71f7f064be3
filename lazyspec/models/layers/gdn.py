"""The Gated DeltaNet mixer of Qwen3-Next and Qwen3.5, in three forms that agree.

* ``"reference"`` / ``"steps"``: token by token (``recurrence.conv_scan`` / ``gdn_scan``);
  ``"steps"`` also returns the conv window and state after every token (decode / verify).
* ``"chunked"``: ``gdn_chunked.conv_chunked`` / ``gdn_chunked`` for prefill, returning the
  window and state after every full chunk of the row.

Params: the input projections, ``out_proj`` (linear), ``conv1d [conv_dim, K]``, ``dt_bias
[Hv]``, ``A_log [Hv]``, ``norm [d_v]`` (gated RMSNorm weight, not zero-centred). The input
projections come in two layouts (``GDNSpec.split_projections``): Qwen3-Next's fused
``in_proj_qkvz`` / ``in_proj_ba``, grouped per key head, or Qwen3.5's separate
``in_proj_qkv`` (q, k, v of all heads, the conv input as is), ``in_proj_z``, ``in_proj_b`` and
``in_proj_a``. The math after the projections is the same.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lazyspec.kernels.backend import ConvUpdateFn, GatedNormFn, StateUpdateFn, norms_gdn_output
from lazyspec.kernels.gdn.chunked import conv_chunked, gdn_chunked
from lazyspec.kernels.gdn.reference import gdn_scan, l2_normalize
from lazyspec.kernels.norm.gated import GateLayout
from lazyspec.kernels.state.conv import ChannelGroups, conv_scan
from lazyspec.kernels.state.update_common import GdnConvTokens, OutputNorm
from lazyspec.models.interface import PoolRows
from lazyspec.models.layers.linear import linear, project_out
from lazyspec.models.layers.norms import gated_rms_norm
from lazyspec.models.layers.state_kernels import (
    conv_write,
    gdn_tokens,
    kernel_steps,
    kernel_write,
    states_for_form,
    writes_in_place,
)
from lazyspec.models.plan import Params, TensorSpec, linear_spec

FORMS = ("reference", "steps", "chunked")


@dataclass(frozen=True)
class GDNSpec:
    """Static shapes of one GDN layer."""

    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    norm_eps: float
    split_projections: bool = False  # Qwen3.5: in_proj_qkv / _z / _b / _a

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def heads_per_key(self) -> int:
        return self.num_v_heads // self.num_k_heads

    @property
    def state_shape(self) -> tuple[int, int, int]:
        """A layer's state [value heads, d_k, d_v] (``ModelConfig.ssm_state_shape``)."""
        return (self.num_v_heads, self.head_k_dim, self.head_v_dim)


class GDNStates(NamedTuple):
    """States a GDN call returns; ``conv_trace``/``ssm_trace`` are per step or per chunk.
    Written in place by a kernel (writing ``PoolRows``): ``ssm_pool`` is the stacked pool
    it returned and ``ssm`` / ``ssm_trace`` are None; likewise ``conv_pool`` with ``conv`` /
    ``conv_trace`` None when the conv kernel wrote the windows."""

    conv: jax.Array | None  # [B, conv_dim, K-1]
    ssm: jax.Array | None  # [B, Hv, d_k, d_v]
    conv_trace: jax.Array | None  # [B, S, conv_dim, K-1]
    ssm_trace: jax.Array | None  # [B, S, Hv, d_k, d_v]
    ssm_pool: jax.Array | None = None  # [L_rec, S+1, Hv, d_k, d_v]
    conv_pool: jax.Array | None = None  # [L_rec, S+1, conv_dim, K-1]


def _projection_plan(prefix: str, spec: GDNSpec) -> Params:
    """The input projections in the layout ``spec`` names (output widths per linear)."""
    h, hv = spec.hidden_size, spec.num_v_heads
    if spec.split_projections:
        widths = {"qkv": spec.conv_dim, "z": spec.value_dim, "b": hv, "a": hv}
        # qkv's columns are the conv channels [q | k | v]; z, b, a are per value head
        axes = {"qkv": "linear_conv", "z": "linear_v_heads", "b": "linear_v_heads"}
        axes["a"] = "linear_v_heads"
    else:
        widths = {"qkvz": spec.conv_dim + spec.value_dim}
        # both fused projections are grouped per key head: a shard holds whole groups
        axes = {"qkvz": "linear_k_heads"}
    plan = {
        f"in_proj_{part}": linear_spec(
            f"{prefix}.in_proj_{part}", h, width, axes=("embed", axes[part])
        )
        for part, width in widths.items()
    }
    if not spec.split_projections:
        # [2 * Hv, hidden] as stored: a few tokens' gates are computed with the input
        # norm in one launch reading whole rows (``Kernels.residual_norm``)
        name = f"{prefix}.in_proj_ba.weight"
        plan["in_proj_ba"] = {
            "weight": TensorSpec(name, (2 * hv, h), axes=("linear_k_heads", "embed"))
        }
    return plan


def gdn_plan(prefix: str, spec: GDNSpec) -> Params:
    """Checkpoint plan of one GDN mixer whose modules sit under ``prefix``."""
    return {
        **_projection_plan(prefix, spec),
        "out_proj": linear_spec(
            f"{prefix}.out_proj",
            spec.value_dim,
            spec.hidden_size,
            axes=("linear_v_heads", "embed"),
        ),
        "conv1d": TensorSpec(
            f"{prefix}.conv1d.weight",
            (spec.conv_dim, 1, spec.conv_kernel),
            reshape=(spec.conv_dim, spec.conv_kernel),
            init="fan_in_uniform",
            axes=("linear_conv", None),
        ),
        "dt_bias": TensorSpec(
            f"{prefix}.dt_bias", (spec.num_v_heads,), init="ones", axes=("linear_v_heads",)
        ),
        "A_log": TensorSpec(
            f"{prefix}.A_log", (spec.num_v_heads,), init="a_log", axes=("linear_v_heads",)
        ),
        "norm": TensorSpec(f"{prefix}.norm.weight", (spec.head_v_dim,), init="ones"),
    }


class Projections(NamedTuple):
    """A GDN layer's input projections: ``mixed`` the conv input ``[B, T, conv_dim]``, z
    ``[B, T, Hv, d_v]``, b and a ``[B, T, Hv]``; with Qwen3-Next's fused projections also
    those as they are, for kernels that read them so: ``qkvz`` (``ChannelGroups``) and
    ``ba [B, T, 2 * Hv]`` (``GdnConvTokens.grouped``), else None. Unused arrays are not
    computed (XLA drops them)."""

    mixed: jax.Array
    z: jax.Array
    b: jax.Array
    a: jax.Array
    qkvz: jax.Array | None = None
    ba: jax.Array | None = None


def _project(
    params: Params, spec: GDNSpec, x: jax.Array, ba: jax.Array | None = None
) -> Projections:
    """x ``[B, T, hidden]`` -> ``Projections``.

    Fused projections are grouped per key head: ``[q, k, v-group, z-group]`` and ``[b, a]``
    (``ba``: the latter where the caller computed it, ``gate_projection``); split ones
    already give the conv input ``[q, k, v]`` and per-value-head z, b, a.
    """
    lead = x.shape[:-1]
    if spec.split_projections:
        z = linear(params["in_proj_z"], x).reshape(*lead, spec.num_v_heads, spec.head_v_dim)
        b, a = linear(params["in_proj_b"], x), linear(params["in_proj_a"], x)
        return Projections(linear(params["in_proj_qkv"], x), z, b, a)
    r = spec.heads_per_key
    fused = linear(params["in_proj_qkvz"], x)
    z = _gate_layout(spec).gather(fused, spec.num_v_heads, spec.head_v_dim)
    if ba is None:
        ba = gate_projection(params, x)
    grouped = ba.reshape(*lead, spec.num_k_heads, 2 * r)
    b = grouped[..., :r].reshape(*lead, spec.num_v_heads)
    a = grouped[..., r:].reshape(*lead, spec.num_v_heads)
    mixed = _conv_channels(spec).gather(fused)  # [q | k | v] of every key head
    return Projections(mixed, z, b, a, fused, ba)


def gate_projection(params: Params, x: jax.Array) -> jax.Array:
    """Qwen3-Next's fused ``in_proj_ba`` of x ``[..., hidden]`` (its weight kept ``[2 * Hv,
    hidden]``, as checkpoints store it), in the weight's dtype as ``linear`` gives it."""
    weight = params["in_proj_ba"]["weight"]
    return jnp.matmul(x.astype(weight.dtype), weight.T)


def _gate_layout(spec: GDNSpec) -> GateLayout:
    """Where z sits in Qwen3-Next's fused ``in_proj_qkvz``: after each key head's q, k and
    its value heads' v, that key head's value heads' z."""
    r, dk, dv = spec.heads_per_key, spec.head_k_dim, spec.head_v_dim
    return GateLayout(2 * dk + 2 * r * dv, 2 * dk + r * dv, r)


def _conv_channels(spec: GDNSpec) -> ChannelGroups:
    """Where the conv channels sit in Qwen3-Next's fused ``in_proj_qkvz``: per key head its
    q, its k, then its value heads' v (z follows, not a conv channel)."""
    return ChannelGroups(
        spec.num_k_heads, (spec.head_k_dim, spec.head_k_dim, spec.heads_per_key * spec.head_v_dim)
    )


def _heads(spec: GDNSpec, conv_out: jax.Array):
    """Conv output -> q, k ``[..., Hv, d_k]`` (L2-normed, q scaled, repeated) and v
    ``[..., Hv, d_v]``."""
    lead = conv_out.shape[:-1]
    kd = spec.key_dim
    q = conv_out[..., :kd].reshape(*lead, spec.num_k_heads, spec.head_k_dim)
    k = conv_out[..., kd : 2 * kd].reshape(*lead, spec.num_k_heads, spec.head_k_dim)
    v = conv_out[..., 2 * kd :].reshape(*lead, spec.num_v_heads, spec.head_v_dim)
    q = l2_normalize(q.astype(jnp.float32)) * spec.head_k_dim**-0.5
    k = l2_normalize(k.astype(jnp.float32))
    # value head i reads key head i // heads_per_key
    q = jnp.repeat(q, spec.heads_per_key, axis=-2)
    k = jnp.repeat(k, spec.heads_per_key, axis=-2)
    return q, k, v.astype(jnp.float32)


def _gates(params: Params, a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b), in float32."""
    a_log = params["A_log"].astype(jnp.float32)
    dt = jax.nn.softplus(a.astype(jnp.float32) + params["dt_bias"].astype(jnp.float32))
    return -jnp.exp(a_log) * dt, jax.nn.sigmoid(b.astype(jnp.float32))


def _conv_tokens(params, spec, mixed, a, b, conv0, valid):
    """Token-by-token conv, then the recurrence inputs: ((q, k, v, g, beta), conv final, trace)."""
    conv = jax.vmap(lambda w, x, ok: conv_scan(w, x, params["conv1d"], None, ok))
    conv_out, conv_final, conv_trace = conv(conv0, mixed, valid)
    q, k, v = _heads(spec, conv_out)
    g, beta = _gates(params, a, b)
    return (q, k, v, g, beta), conv_final, conv_trace


def _mix_scan(params, spec, mixed, a, b, conv0, ssm0, num_new):
    """Token-by-token form over rows; traces hold the state after every token."""
    valid = jnp.arange(mixed.shape[1])[None, :] < num_new[:, None]
    tokens, conv_final, conv_trace = _conv_tokens(params, spec, mixed, a, b, conv0, valid)
    outs, ssm_final, ssm_trace = jax.vmap(gdn_scan)(ssm0, *tokens, valid)
    return outs, GDNStates(conv_final, ssm_final, conv_trace, ssm_trace)


def _mix_steps_kernel(update, conv_update, params, spec, projected, conv0, ssm0, num_new, dtype):
    """T-step form with the state update in the kernel ``update``; the conv in the kernel
    ``conv_update`` when it writes the windows in place (``conv0`` writing ``PoolRows``),
    else in jnp. ``projected``: ``_project``'s. Returns (outputs, states, whether the
    outputs are gated-normed already: the kernel was handed the norm with its conv tokens
    (``norms_gdn_output``), reading z out of the fused projection; outputs in ``dtype``)."""
    mixed, _, b, a, qkvz, ba = projected
    if isinstance(conv0, PoolRows):  # gdn_mixer hands PoolRows only when both write
        conv_in, groups = mixed, None
        if qkvz is not None and getattr(conv_update, "reads_channel_groups", False):
            conv_in, groups = qkvz, _conv_channels(spec)  # read in place: no concatenation
        conv_out, conv_pool = conv_write(
            conv_update, conv0, conv_in, params["conv1d"], None, num_new, groups
        )
        fits = getattr(update, "takes_conv_tokens", None)
        if fits is not None and fits(spec.head_k_dim, spec.head_v_dim):
            # the kernel finishes the heads and gates itself (``GdnConvTokens``), reading
            # the fused gate projection as it is where there is one
            finish = (params["A_log"], params["dt_bias"], num_new, spec.num_k_heads)
            if ba is None:
                tokens = GdnConvTokens(conv_out, a, b, *finish)
            else:
                tokens = GdnConvTokens.grouped(conv_out, ba, *finish)
            layout = _gate_layout(spec)
            if (
                qkvz is not None
                and norms_gdn_output(update, qkvz.shape[0] * qkvz.shape[1])
                and layout.in_whole_blocks(spec.head_v_dim)
            ):
                norm = OutputNorm(qkvz, params["norm"], layout, spec.norm_eps, dtype)
                outs, pool = kernel_write(update, ssm0, replace(tokens, norm=norm))
                return outs, GDNStates(None, None, None, None, pool, conv_pool), True
        else:
            tokens = gdn_tokens(*_heads(spec, conv_out), *_gates(params, a, b), num_new)
        outs, pool = kernel_write(update, ssm0, tokens)
        return outs, GDNStates(None, None, None, None, pool, conv_pool), False
    valid = jnp.arange(mixed.shape[1])[None, :] < num_new[:, None]
    tokens, conv_final, conv_trace = _conv_tokens(params, spec, mixed, a, b, conv0, valid)
    tokens = gdn_tokens(*tokens, num_new)
    if writes_in_place(ssm0, update):
        outs, pool = kernel_write(update, ssm0, tokens)
        return outs, GDNStates(conv_final, None, conv_trace, None, pool), False
    outs, ssm_final, ssm_trace = kernel_steps(update, ssm0, tokens, num_new)
    return outs, GDNStates(conv_final, ssm_final, conv_trace, ssm_trace), False


def _mix_chunked(params, spec, mixed, a, b, conv0, ssm0, num_new, chunk_size):
    """Chunked form over rows; traces hold the state after every full chunk."""
    conv = jax.vmap(lambda w, x, n: conv_chunked(w, x, params["conv1d"], None, n, chunk_size))
    conv_out, conv_final, conv_trace = conv(conv0, mixed, num_new)
    q, k, v = _heads(spec, conv_out)
    g, beta = _gates(params, a, b)
    rows = jax.vmap(lambda *xs: gdn_chunked(*xs, chunk_size=chunk_size))
    outs, ssm_final, ssm_trace = rows(ssm0, q, k, v, g, beta, num_new)
    return outs, GDNStates(conv_final, ssm_final, conv_trace, ssm_trace)


def _gated_norm(params, spec, outs, z, qkvz, dtype, gated_norm):
    """The output's gated norm (``outs`` rounded to ``dtype`` first): in ``gated_norm`` (a
    ``Kernels`` entry, handed the layer's ops as its XLA form) reading z out of the fused
    projection ``qkvz`` where there is one and a step's tokens (``[B, T]``) fit it, else
    those ops."""

    def xla_form():
        return gated_rms_norm(outs.astype(dtype), z, params["norm"], spec.norm_eps)

    if gated_norm is None or qkvz is None:
        return xla_form()
    lead = outs.shape[:-2]
    flat = gated_norm(
        outs.reshape(-1, *outs.shape[-2:]),
        qkvz.reshape(-1, qkvz.shape[-1]),
        _gate_layout(spec),
        params["norm"],
        eps=spec.norm_eps,
        dtype=dtype,
        xla_form=lambda: xla_form().reshape(-1, *outs.shape[-2:]),
    )
    return flat.reshape(*lead, *flat.shape[1:])


@jax.named_scope("recurrent")
def gdn_mixer(
    params: Params,
    spec: GDNSpec,
    x: jax.Array,
    conv0: jax.Array,
    ssm0: jax.Array,
    num_new: jax.Array,
    *,
    form: str,
    chunk_size: int = 64,
    state_update: StateUpdateFn | None = None,
    conv_update: ConvUpdateFn | None = None,
    gated_norm: GatedNormFn | None = None,
    ba: jax.Array | None = None,
    out_parts: int = 0,
) -> tuple[jax.Array, GDNStates]:
    """One GDN layer over B rows: x ``[B, T, hidden]`` (already input-normed).

    conv0 ``[B, conv_dim, K-1]`` and ssm0 ``[B, Hv, d_k, d_v]`` (or ``PoolRows``, which a
    ``state_update`` kernel reads in place) are the states before the tokens; only the first
    ``num_new[b]`` tokens of row b change them. ``state_update``
    (``Kernels.gdn_state_update``) runs the state update of the steps form; None: the jnp
    token scan. Returns (output ``[B, T, hidden]``, ``GDNStates`` in the dtypes of conv0 /
    ssm0). Writing ``PoolRows`` with a kernel: the kernel's decode mode writes the rows in
    place and returns the pool (``GDNStates.ssm_pool``); conv0 as writing ``PoolRows`` with
    ``conv_update`` (``Kernels.conv_update``) as well, the conv windows too
    (``GDNStates.conv_pool``). ``gated_norm`` (``Kernels.gated_norm``) runs the output's
    gated norm where the projections are fused. ``ba``: the fused gate projection of x
    where the caller computed it (``gate_projection``'s contract). ``out_parts``: the
    output is ``out_proj``'s float32 partial sums ``[out_parts, B, T, hidden]``
    (``linear.linear_parts``), for a residual norm that sums them. Pure; mutates nothing.
    """
    if form not in FORMS:
        raise ValueError(f"unknown GDN form {form!r}; expected one of {FORMS}")
    use_kernel, conv0, ssm0 = states_for_form(form, conv0, ssm0, state_update, conv_update)
    projected = _project(params, spec, x, ba)
    mixed, z, b, a = projected[:4]
    normed = False
    if form == "chunked":
        outs, states = _mix_chunked(params, spec, mixed, a, b, conv0, ssm0, num_new, chunk_size)
    elif use_kernel:
        outs, states, normed = _mix_steps_kernel(
            state_update, conv_update, params, spec, projected, conv0, ssm0, num_new, x.dtype
        )
    else:
        outs, states = _mix_scan(params, spec, mixed, a, b, conv0, ssm0, num_new)
    if not normed:  # else the state update's launch applied it
        outs = _gated_norm(params, spec, outs, z, projected.qkvz, x.dtype, gated_norm)
    out = project_out(params["out_proj"], outs.reshape(*outs.shape[:-2], spec.value_dim), out_parts)
    cast = lambda x, like: None if x is None else x.astype(like.dtype)  # noqa: E731
    states = GDNStates(
        cast(states.conv, conv0),
        cast(states.ssm, ssm0),
        cast(states.conv_trace, conv0),
        cast(states.ssm_trace, ssm0),
        states.ssm_pool,
        states.conv_pool,
    )
    return out, states
