"""The Mamba2 mixer of Nemotron-H and Granite 4.0-H: in_proj, causal conv, SSD recurrence, gated
norm, out_proj.

Parameters are a plain dict; ``in_proj`` and ``out_proj`` are linear layers in the layout of
``layers/mlp.linear`` (``{"weight": [in, out]}`` plus an optional ``"bias"``):
  ``in_proj`` D -> I + conv_dim + H, ``conv_weight`` [conv_dim, K] (+ ``conv_bias`` [conv_dim]),
  ``dt_bias``, ``A_log``, ``D`` [H], ``norm`` [I], ``out_proj`` I -> D,
with I = H * P and conv_dim = I + 2 * G * N; ``mamba2_plan`` names their checkpoint tensors.

The projection splits, in order, into the gate z [I], the conv input xBC [conv_dim] and the
raw time step [H]; after the conv (with silu) xBC splits into x [H, P], B [G, N], C [G, N].
``dt = clamp(softplus(dt + dt_bias), dt_min, dt_max)`` and ``A = -exp(A_log)``. The output
``y = scan(x) + D * x`` is multiplied by ``silu(z)``, RMS-normalised per group of I / G
channels, scaled by ``norm`` and projected back to D.

Three forms of the same math (they must agree; the tests hold them to 1e-5 in float32):
``"reference"`` the token-by-token ``lax.scan`` oracles of ``recurrence.py`` (conv scan, then
SSM scan; per-token trace), ``"chunked"`` the SSD prefill form (trace = state after every full
chunk), ``"steps"`` the T-step update for decode / verify: one fused conv + SSM step per token,
unrolled for short T (trace = state after every step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lazyspec.kernels.backend import ConvUpdateFn, StateUpdateFn
from lazyspec.kernels.mamba2.chunked import DEFAULT_CHUNK, conv_windowed, mamba2_chunked
from lazyspec.kernels.mamba2.reference import mamba2_scan, mamba2_step
from lazyspec.kernels.state.conv import conv_scan, conv_step
from lazyspec.models.interface import PoolRows
from lazyspec.models.layers.linear import linear
from lazyspec.models.layers.norms import gated_rms_norm
from lazyspec.models.layers.state_kernels import (
    conv_write,
    kernel_steps,
    kernel_write,
    mamba2_tokens,
    states_for_form,
    writes_in_place,
)
from lazyspec.models.plan import Params, TensorSpec, linear_spec

FORMS = ("reference", "chunked", "steps")
MAX_UNROLL = 8  # the steps form unrolls decode / verify windows up to this length


@dataclass(frozen=True)
class Mamba2Dims:
    """Static shapes and constants of one Mamba2 mixer."""

    hidden_size: int
    num_heads: int  # H
    head_dim: int  # P
    state_size: int  # N
    n_groups: int  # G
    conv_kernel: int  # K
    norm_eps: float
    dt_min: float = 0.0
    dt_max: float = float("inf")

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @property
    def projection_size(self) -> int:
        return self.intermediate_size + self.conv_dim + self.num_heads

    @property
    def state_shape(self) -> tuple[int, int, int]:
        """A layer's state [heads, head_dim, state_size] (``ModelConfig.ssm_state_shape``)."""
        return (self.num_heads, self.head_dim, self.state_size)


@jax.tree_util.register_dataclass
@dataclass
class MixerStates:
    """States a mixer call leaves behind (per row); ``trace_*`` depend on the form. Written
    in place by a kernel (writing ``PoolRows``): ``ssm_pool`` is the stacked pool it
    returned and ``ssm`` / ``trace_ssm`` are None; likewise ``conv_pool`` with ``conv`` /
    ``trace_conv`` None when the conv kernel wrote the windows."""

    conv: jax.Array | None  # [B, conv_dim, K-1] after each row's valid tokens
    ssm: jax.Array | None  # [B, H, P, N]
    trace_conv: jax.Array | None  # [B, S, conv_dim, K-1]: per token / per chunk / per step
    trace_ssm: jax.Array | None  # [B, S, H, P, N]
    ssm_pool: jax.Array | None = None  # [L_rec, S+1, H, P, N]
    conv_pool: jax.Array | None = None  # [L_rec, S+1, conv_dim, K-1]


def split_projection(
    dims: Mamba2Dims, projected: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Split in_proj's output [..., projection_size] into (gate, xbc, raw dt)."""
    inter, conv_dim = dims.intermediate_size, dims.conv_dim
    gate = projected[..., :inter]
    xbc = projected[..., inter : inter + conv_dim]
    dt_raw = projected[..., inter + conv_dim :]
    return gate, xbc, dt_raw


def split_xbc(dims: Mamba2Dims, xbc: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Split the conv output [..., conv_dim] into x [..., H, P], b and c [..., G, N]."""
    inter, group_width = dims.intermediate_size, dims.n_groups * dims.state_size
    lead = xbc.shape[:-1]
    x = xbc[..., :inter].reshape(lead + (dims.num_heads, dims.head_dim))
    b = xbc[..., inter : inter + group_width].reshape(lead + (dims.n_groups, dims.state_size))
    c = xbc[..., inter + group_width :].reshape(lead + (dims.n_groups, dims.state_size))
    return x, b, c


def time_steps(dims: Mamba2Dims, dt_raw: jax.Array, dt_bias: jax.Array) -> jax.Array:
    """dt = clamp(softplus(dt_raw + dt_bias), dt_min, dt_max) in float32."""
    dt = jax.nn.softplus(dt_raw.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    return jnp.clip(dt, dims.dt_min, dims.dt_max)


class _Recurrence(NamedTuple):
    """The per-row constants every form needs (float32 decay and skip)."""

    conv_weight: jax.Array  # [conv_dim, K]
    conv_bias: jax.Array | None  # [conv_dim]
    a: jax.Array  # [H] = -exp(A_log)
    d: jax.Array  # [H]


class _Row(NamedTuple):
    """One row's states before its tokens and its tokens' inputs."""

    conv0: jax.Array  # [conv_dim, K-1]
    ssm0: jax.Array  # [H, P, N]
    xbc: jax.Array  # [T, conv_dim]
    dt: jax.Array  # [T, H]
    num_valid: jax.Array  # the real tokens; the rest are padding


# (y [T, H, P], final conv window, final ssm state, conv trace, ssm trace) of one row.
RowResult = tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]


def _row_reference(dims: Mamba2Dims, rec: _Recurrence, row: _Row, chunk_size: int) -> RowResult:
    """Token-by-token scans over one row; the trace is the state after every token."""
    valid = jnp.arange(row.xbc.shape[0]) < row.num_valid
    conv_out, conv_final, conv_trace = conv_scan(
        row.conv0, row.xbc, rec.conv_weight, rec.conv_bias, valid
    )
    x, b, c = split_xbc(dims, conv_out)
    y, ssm_final, ssm_trace = mamba2_scan(
        row.ssm0.astype(jnp.float32), x, b, c, row.dt, rec.a, rec.d, valid
    )
    return y, conv_final, ssm_final, conv_trace, ssm_trace


def _row_chunked(dims: Mamba2Dims, rec: _Recurrence, row: _Row, chunk_size: int) -> RowResult:
    """Chunked SSD over one row; the trace is the state after every full chunk."""
    conv_out, conv_final, conv_trace = conv_windowed(
        row.conv0, row.xbc, rec.conv_weight, rec.conv_bias, row.num_valid, chunk_size
    )
    x, b, c = split_xbc(dims, conv_out)
    y, ssm_final, ssm_trace = mamba2_chunked(
        row.ssm0, x, b, c, row.dt, rec.a, rec.d, row.num_valid, chunk_size
    )
    return y, conv_final, ssm_final, conv_trace, ssm_trace


def _row_steps(dims: Mamba2Dims, rec: _Recurrence, row: _Row, chunk_size: int) -> RowResult:
    """T fused single-token updates (conv then SSM) over one row; the trace is the state
    after each step. Short T (decode, verify) is fully unrolled."""

    def step(carry, inputs):
        window, h = carry
        xbc_t, dt_t, ok = inputs
        new_window, conv_out = conv_step(window, xbc_t, rec.conv_weight, rec.conv_bias)
        x, b, c = split_xbc(dims, conv_out)
        new_h, y = mamba2_step(h, x, b, c, dt_t, rec.a, rec.d)
        window = jnp.where(ok, new_window, window)
        h = jnp.where(ok, new_h, h)
        return (window, h), (y, window, h)

    num_tokens = row.xbc.shape[0]
    valid = jnp.arange(num_tokens) < row.num_valid
    unroll = num_tokens if num_tokens <= MAX_UNROLL else 1
    (window, h), (ys, windows, states) = jax.lax.scan(
        step, (row.conv0, row.ssm0.astype(jnp.float32)), (row.xbc, row.dt, valid), unroll=unroll
    )
    return ys, window, h, windows, states


_ROW_FORMS = {"reference": _row_reference, "chunked": _row_chunked, "steps": _row_steps}


def _steps_kernel(
    update, conv_update, dims: Mamba2Dims, rec: _Recurrence, conv0, ssm0, xbc, dt, num_new
):
    """T-step form with the SSM update in the kernel ``update``, the conv in the kernel
    ``conv_update`` when it writes the windows in place (``conv0`` writing ``PoolRows``),
    else in jnp: a ``RowResult`` for all rows, then the ssm and conv pools the kernels wrote
    (writing ``PoolRows``; the finals and traces they replace are None then) or None."""
    conv_pool = None
    if isinstance(conv0, PoolRows):  # mamba2_mixer hands PoolRows only when both write
        conv_out, conv_pool = conv_write(
            conv_update, conv0, xbc, rec.conv_weight, rec.conv_bias, num_new
        )
        conv_final = conv_trace = None
    else:
        valid = jnp.arange(xbc.shape[1])[None, :] < num_new[:, None]
        conv = jax.vmap(lambda w, x, ok: conv_scan(w, x, rec.conv_weight, rec.conv_bias, ok))
        conv_out, conv_final, conv_trace = conv(conv0, xbc, valid)
    x, b, c = split_xbc(dims, conv_out)
    tokens = mamba2_tokens(x, b, c, dt, rec.a, rec.d, num_new)
    if writes_in_place(ssm0, update):
        y, pool = kernel_write(update, ssm0, tokens)
        return y, conv_final, None, conv_trace, None, pool, conv_pool
    y, ssm_final, ssm_trace = kernel_steps(update, ssm0, tokens, num_new)
    return y, conv_final, ssm_final, conv_trace, ssm_trace, None, conv_pool


@jax.named_scope("recurrent")
def mamba2_mixer(
    params: dict,
    dims: Mamba2Dims,
    hidden: jax.Array,
    conv0: jax.Array,
    ssm0: jax.Array,
    num_new: jax.Array,
    *,
    form: str,
    chunk_size: int = DEFAULT_CHUNK,
    state_update: StateUpdateFn | None = None,
    conv_update: ConvUpdateFn | None = None,
) -> tuple[jax.Array, MixerStates]:
    """Run the mixer over B rows of T tokens; row b's real tokens are ``hidden[b, :num_new[b]]``.

    ``conv0`` [B, conv_dim, K-1] and ``ssm0`` [B, H, P, N] (or ``PoolRows``, which a
    ``state_update`` kernel reads in place) are the states before the tokens.
    ``state_update`` (``Kernels.mamba2_state_update``) runs the SSM update of the steps
    form; None: the fused jnp steps.
    Returns (output [B, T, D] in hidden's dtype, MixerStates). Padding tokens never change a
    state; their outputs are finite but meaningless. Writing ``PoolRows`` with a kernel:
    the kernel's decode mode writes the rows in place and returns the pool
    (``MixerStates.ssm_pool``); conv0 as writing ``PoolRows`` with ``conv_update``
    (``Kernels.conv_update``) as well, the conv windows too (``MixerStates.conv_pool``).
    Pure; never mutates.
    """
    if form not in _ROW_FORMS:
        raise ValueError(f"unknown Mamba2 form {form!r}; expected one of {FORMS}")
    use_kernel, conv0, ssm0 = states_for_form(form, conv0, ssm0, state_update, conv_update)
    projected = linear(params["in_proj"], hidden)
    gate, xbc, dt_raw = split_projection(dims, projected)
    dt = time_steps(dims, dt_raw, params["dt_bias"])

    rec = _Recurrence(
        conv_weight=params["conv_weight"],
        conv_bias=params.get("conv_bias"),
        a=-jnp.exp(params["A_log"].astype(jnp.float32)),
        d=params["D"].astype(jnp.float32),
    )
    row_fn = _ROW_FORMS[form]

    ssm_pool = conv_pool = None
    if use_kernel:
        y, conv_final, ssm_final, conv_trace, ssm_trace, ssm_pool, conv_pool = _steps_kernel(
            state_update, conv_update, dims, rec, conv0, ssm0, xbc, dt, num_new
        )
    else:
        y, conv_final, ssm_final, conv_trace, ssm_trace = jax.vmap(
            lambda row: row_fn(dims, rec, row, chunk_size)
        )(_Row(conv0, ssm0, xbc, dt, num_new))
    y = y.reshape(y.shape[:2] + (dims.intermediate_size,))
    group_size = dims.intermediate_size // dims.n_groups
    normed = gated_rms_norm(
        y, gate, params["norm"], dims.norm_eps, group_size=group_size, norm_before_gate=False
    )
    out = linear(params["out_proj"], normed)
    cast = lambda x, like: None if x is None else x.astype(like.dtype)  # noqa: E731
    states = MixerStates(
        conv=cast(conv_final, conv0),
        ssm=cast(ssm_final, ssm0),
        trace_conv=cast(conv_trace, conv0),
        trace_ssm=cast(ssm_trace, ssm0),
        ssm_pool=ssm_pool,
        conv_pool=conv_pool,
    )
    return out.astype(hidden.dtype), states


# ---------------------------------------------------------------- parameters


def mamba2_plan(
    prefix: str,
    dims: Mamba2Dims,
    *,
    use_bias: bool = False,
    use_conv_bias: bool = True,
    out_scale: float = 1.0,
) -> Params:
    """Checkpoint plan of one mixer whose tensors sit under ``prefix`` (transformers' names).

    ``dt_bias``, ``A_log`` and ``D`` stay float32 whatever the model dtype (tiny, and they
    set the decay rates). Random init: normal projections (``out_proj`` scaled by
    ``out_scale``), fan-in uniform conv taps, A in [1, 16], dt log-uniform, D and norm ones.
    """
    heads, conv_dim, inter = dims.num_heads, dims.conv_dim, dims.intermediate_size
    # in_proj's columns are [z | xBC | dt] and the conv channels [x | B | C]: mixed layouts
    # (``mamba_proj`` / ``mamba_conv``); z, x, norm and out_proj's rows are head-major
    # (``mamba_inner``), dt_bias / A_log / D per head
    head_axes = ("mamba_heads",)
    plan = {
        "in_proj": linear_spec(
            f"{prefix}.in_proj",
            dims.hidden_size,
            dims.projection_size,
            use_bias,
            axes=("embed", "mamba_proj"),
        ),
        "conv_weight": TensorSpec(
            f"{prefix}.conv1d.weight",
            (conv_dim, 1, dims.conv_kernel),
            reshape=(conv_dim, dims.conv_kernel),
            init="fan_in_uniform",
            axes=("mamba_conv", None),
        ),
        "dt_bias": TensorSpec(
            f"{prefix}.dt_bias", (heads,), init="dt_bias", dtype="float32", axes=head_axes
        ),
        "A_log": TensorSpec(
            f"{prefix}.A_log", (heads,), init="a_log", dtype="float32", axes=head_axes
        ),
        "D": TensorSpec(f"{prefix}.D", (heads,), init="ones", dtype="float32", axes=head_axes),
        "norm": TensorSpec(f"{prefix}.norm.weight", (inter,), init="ones", axes=("mamba_inner",)),
        "out_proj": linear_spec(
            f"{prefix}.out_proj",
            inter,
            dims.hidden_size,
            use_bias,
            init_scale=out_scale,
            axes=("mamba_inner", "embed"),
        ),
    }
    if use_conv_bias:
        plan["conv_bias"] = TensorSpec(
            f"{prefix}.conv1d.bias", (conv_dim,), init="zeros", axes=("mamba_conv",)
        )
    return plan
