"""The Pallas kernels per shard under tensor parallelism.

``per_shard(kernels, plan)`` wraps every function of a Pallas ``Kernels`` record in
``jax.shard_map`` over the ``tp`` axis, with in / out specs read from the rule table's
shardings (``ShardingPlan.sharding`` of the pools' logical axes), so that each device runs
the kernel on the blocks it holds and XLA never gathers a pool around the call:

* GDN / Mamba2 state update: its heads of the ssm pool (the stacked pool read in place, or
  gathered rows), of the tokens, outputs and step states. Mamba2's B / C groups are first
  repeated where tp does not divide them, so a device's heads read groups it holds whole.
* state scatter: its heads of the ssm pool and scratch, its block of the conv pool's
  channels and of the scratch's (a copy per channel, so the even split of the mixed
  ``[q | k | v]`` / ``[x | B | C]`` channels is exact).
* state copy (pool to pool, a decode step's checkpoint): its heads of the ssm pool and its
  block of the conv pool's channels, both pools read and written in place.
* conv update (a decode step's conv, the windows written in place): its block of the conv
  pool's channels, of the conv inputs and outputs, and of the conv weight and bias.
* paged attention: its query heads. KV pools split by kv heads: its kv heads (whole GQA
  groups). KV pools replicated (tp > kv heads): the one kv head its query heads read,
  picked by the kernel's index map (``kv_head``; one static branch per kv head), the pools
  read in place.
* routed experts: its experts on every token (ids shifted by its first expert; pairs
  routed to another device's experts are dropped), then one psum of the float32
  ``[N, d_out]``: the only collective of the four.

Operands whose sharding differs from the specs (the tokens of a state update come out of
the conv, whose channels are split evenly, not by heads) are resharded by XLA at the
``shard_map`` boundary: the kernels only ever see whole heads. The jnp conv (every step
but a decode that writes in place) and the token-count fallbacks (the MoE layer's XLA
form) run outside, on the global arrays.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from lazyspec.engine.sharding import (
    CONV_POOL_AXES,
    KV_POOL_AXES,
    SSM_POOL_AXES,
    TP_AXIS,
    ShardingPlan,
)
from lazyspec.kernels.attention.inputs import PagedInputs
from lazyspec.kernels.backend import Kernels
from lazyspec.kernels.moe.dispatch import experts_in_pieces, takes_widths
from lazyspec.kernels.state.conv import ConvUpdateResult, every_token_new
from lazyspec.kernels.state.update_common import GdnTokens, Mamba2Tokens, StateUpdateResult
from lazyspec.kernels.tuning import Tuning

EXPERT_AXES = ("experts", None, None)  # ExpertStack's


def _spec(plan: ShardingPlan, axes: tuple[str | None, ...], shape: tuple[int, ...]) -> P:
    return plan.sharding(axes, shape).spec


def _head_axis(spec: P, position: int) -> str | None:
    """The mesh axis of ``spec`` at ``position`` (None: replicated)."""
    return spec[position] if position < len(spec) else None


def _at(position: int, axis: str | None) -> P:
    """A spec splitting axis ``position`` over ``axis`` (None: replicated)."""
    return P(*([None] * position), axis)


def _map(plan: ShardingPlan, body: Callable, in_specs: Any, out_specs: Any) -> Callable:
    # check_vma off: a pallas_call's out_shape carries no varying-axes type; an output
    # spec without the tp axis is a promise kept by the psum (experts) or by inputs that
    # are replicated
    return jax.shard_map(
        body, mesh=plan.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )


def _repeat_groups(tokens: Mamba2Tokens, tp_size: int) -> Mamba2Tokens:
    """B and C with each group repeated tp / gcd(groups, tp) times: the group count becomes
    a multiple of tp (and still divides the heads), and head i still reads its group."""
    repeats = tp_size // math.gcd(tokens.b.shape[2], tp_size)
    if repeats == 1:
        return tokens
    b, c = (jnp.repeat(t, repeats, axis=2) for t in (tokens.b, tokens.c))
    return dataclasses.replace(tokens, b=b, c=c)


def _token_specs(tokens: GdnTokens | Mamba2Tokens, heads: str | None):
    per_head = _at(2, heads)  # [B, T, H, ...] and Mamba2's [B, T, G, N]
    if isinstance(tokens, GdnTokens):
        return GdnTokens(q=per_head, k=per_head, v=per_head, g=per_head, beta=per_head)
    return Mamba2Tokens(
        x=per_head, b=per_head, c=per_head, dt=per_head, a=_at(0, heads), d=_at(0, heads)
    )


def _state_update(update: Callable, plan: ShardingPlan) -> Callable:
    """``update`` (the ``state_update`` contract) on each device's heads."""

    def run(pool, slot, tokens, *, mode: str, layer: int | None = None) -> StateUpdateResult:
        lead = 0 if layer is None else 1  # the stacked pool's layer axis
        heads = _head_axis(_spec(plan, SSM_POOL_AXES[1 - lead :], pool.shape), 1 + lead)
        if heads is None:
            return update(pool, slot, tokens, mode=mode, layer=layer)
        if isinstance(tokens, Mamba2Tokens):
            tokens = _repeat_groups(tokens, plan.tp_size)
        pool_spec = _at(1 + lead, heads)
        per_step = _at(2, heads)  # outputs and step states [B, T, H, ...]

        def body(pool, slot, tokens):
            return update(pool, slot, tokens, mode=mode, layer=layer)

        out_specs = StateUpdateResult(
            outputs=per_step,
            pool=pool_spec if mode == "decode" else None,
            step_states=per_step if mode == "verify" else None,
        )
        in_specs = (pool_spec, P(), _token_specs(tokens, heads))
        return _map(plan, body, in_specs, out_specs)(pool, slot, tokens)

    return run


def _state_scatter(scatter: Callable, plan: ShardingPlan) -> Callable:
    """``scatter`` (the ``state_scatter`` contract) on each device's heads and channels."""

    def run(ssm_pool, conv_pool, ssm_steps, conv_steps, dst_slot, step, *, layer=None):
        ssm_spec = _spec(plan, SSM_POOL_AXES, ssm_pool.shape)
        conv_spec = _spec(plan, CONV_POOL_AXES, conv_pool.shape)
        lead = 3 if layer is None else 2  # scratch [L, B, N, ...] or one layer's [B, N, ...]
        ssm_steps_spec = _at(lead, _head_axis(ssm_spec, 2))
        conv_steps_spec = _at(lead, _head_axis(conv_spec, 2))

        def body(ssm_pool, conv_pool, ssm_steps, conv_steps, dst_slot, step):
            return scatter(ssm_pool, conv_pool, ssm_steps, conv_steps, dst_slot, step, layer=layer)

        in_specs = (ssm_spec, conv_spec, ssm_steps_spec, conv_steps_spec, P(), P())
        mapped = _map(plan, body, in_specs, (ssm_spec, conv_spec))
        return mapped(ssm_pool, conv_pool, ssm_steps, conv_steps, dst_slot, step)

    return run


def _state_copy(copy: Callable, plan: ShardingPlan) -> Callable:
    """``copy`` (the ``state_copy`` contract) on each device's heads and channels."""

    def run(ssm_pool, conv_pool, src_slot, dst_slot):
        ssm_spec = _spec(plan, SSM_POOL_AXES, ssm_pool.shape)
        conv_spec = _spec(plan, CONV_POOL_AXES, conv_pool.shape)
        in_specs = (ssm_spec, conv_spec, P(), P())
        return _map(plan, copy, in_specs, (ssm_spec, conv_spec))(
            ssm_pool, conv_pool, src_slot, dst_slot
        )

    return run


def _conv_update(conv: Callable, plan: ShardingPlan) -> Callable:
    """``conv`` (the ``conv_update`` contract) on each device's block of the conv channels:
    a depthwise conv is per channel, so the even split is exact."""

    def run(
        pool, slot, x, weight, bias=None, *, mode: str, num_new=None, layer=None, out_dtype=None
    ):
        lead = 0 if layer is None else 1  # the stacked pool's layer axis
        pool_spec = _spec(plan, CONV_POOL_AXES[1 - lead :], pool.shape)
        channels = _head_axis(pool_spec, 1 + lead)
        options = {"mode": mode, "layer": layer, "out_dtype": out_dtype}
        if channels is None:
            return conv(pool, slot, x, weight, bias, num_new=num_new, **options)
        if num_new is None:
            num_new = every_token_new(x)  # one array for shard_map to hand every shard
        per_token = _at(2, channels)  # x, outputs [B, T, C] and step windows [B, T, C, K-1]
        per_channel = _at(0, channels)  # weight [C, K], bias [C]
        has_bias = bias is not None

        def body(pool, slot, x, weight, num_new, *bias):
            bias = bias[0] if has_bias else None
            return conv(pool, slot, x, weight, bias, num_new=num_new, **options)

        out_specs = ConvUpdateResult(
            outputs=per_token,
            pool=pool_spec if mode == "decode" else None,
            step_windows=per_token if mode == "verify" else None,
        )
        in_specs = (pool_spec, P(), per_token, per_channel, P()) + (per_channel,) * has_bias
        args = (pool, slot, x, weight, num_new) + ((bias,) if has_bias else ())
        return _map(plan, body, in_specs, out_specs)(*args)

    return run


def _paged_attention(attention: Callable, plan: ShardingPlan) -> Callable:
    """``attention`` (the ``paged_attention`` contract) on each device's query heads: the
    specs are a ``PagedInputs`` of ``PartitionSpec``s, a prefix of the inputs' tree."""

    def run(inputs: PagedInputs, scale: float, *, gate: jax.Array | None = None) -> jax.Array:
        kv_spec = _spec(plan, KV_POOL_AXES, inputs.k_pool.shape)
        q_spec = _at(2, plan.sharding(("q_heads",), (inputs.q.shape[2],)).spec[0])
        num_kv_heads = inputs.k_pool.shape[1]
        gates = () if gate is None else (gate,)  # sharded as q, head by head
        if _head_axis(kv_spec, 1) is not None:  # whole GQA groups per device

            def body(inputs, *gate):
                return attention(inputs, scale, gate=gate[0] if gate else None)

        else:  # every device holds all kv heads; its query heads read one of them

            def body(inputs, *gate):
                kv_head = jax.lax.axis_index(TP_AXIS) * num_kv_heads // plan.tp_size
                branches = [
                    functools.partial(
                        attention, scale=scale, kv_head=head, gate=gate[0] if gate else None
                    )
                    for head in range(num_kv_heads)
                ]
                return jax.lax.switch(kv_head, branches, inputs)

        specs = PagedInputs(q_spec, kv_spec, kv_spec, P(), P(), P())
        return _map(plan, body, (specs,) + (q_spec,) * len(gates), q_spec)(inputs, *gates)

    return run


def _moe_experts(moe: Callable, plan: ShardingPlan, tuning: Tuning) -> Callable:
    """``moe`` (``MoEExpertsFn``) with each device running its own experts on every token,
    in the kernel's pieces (``experts_in_pieces``) where its widths take a launch (else
    ``moe`` chooses, on the global arrays)."""

    def run(x, weights, expert_ids, up, down, gate=None, *, xla_form):
        stack_spec = _spec(plan, EXPERT_AXES, up.shape)
        operands = (x, weights, expert_ids, up, down)
        if not takes_widths(operands, tuning=tuning) or _head_axis(stack_spec, 0) is None:
            return moe(x, weights, expert_ids, up, down, gate, xla_form=xla_form)
        stacks = (up, down) if gate is None else (up, down, gate)

        def body(x, weights, expert_ids, *stacks):
            first = jax.lax.axis_index(TP_AXIS) * stacks[0].shape[0]
            local = experts_in_pieces((x, weights, expert_ids - first, *stacks), tuning=tuning)
            return jax.lax.psum(local, TP_AXIS)

        in_specs = (P(), P(), P()) + (stack_spec,) * len(stacks)
        return _map(plan, body, in_specs, P())(x, weights, expert_ids, *stacks)

    return run


@functools.cache
def per_shard(kernels: Kernels, plan: ShardingPlan) -> Kernels:
    """``kernels`` with each function run per shard of ``plan``'s mesh (module docstring);
    the record itself when it runs on one device or on XLA (whose sharded forms XLA
    partitions). On a TPU the routed experts keep the MoE layers' XLA form at tp > 1
    (its kernel's per-shard form is not checked)."""
    if plan.tp_size == 1 or kernels.backend == "xla":
        return kernels

    def wrap(fn: Callable | None, wrapper: Callable) -> Callable | None:
        return None if fn is None else wrapper(fn, plan)

    moe = kernels.moe_experts
    if moe is not None:
        moe = None if kernels.platform == "tpu" else _moe_experts(moe, plan, kernels.tuning)
    return dataclasses.replace(
        kernels,
        gdn_state_update=wrap(kernels.gdn_state_update, _state_update),
        mamba2_state_update=wrap(kernels.mamba2_state_update, _state_update),
        state_scatter=_state_scatter(kernels.state_scatter, plan),
        state_copy=_state_copy(kernels.state_copy, plan),
        moe_experts=moe,
        paged_attention=wrap(kernels.paged_attention, _paged_attention),
        conv_update=wrap(kernels.conv_update, _conv_update),
        residual_norm=None,  # the layers' own ops, which XLA partitions
        attention_prologue=None,
        gated_norm=None,
        mesh=plan.mesh,
    )
