"""Nemotron-H's feed-forward blocks: the non-gated relu^2 MLP and the sigmoid-routed MoE of
relu^2 experts (grouped top-k) plus a shared expert. Pure functions over param dicts, and
their checkpoint plans (transformers' NemotronH names)."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from lazyspec.kernels.backend import MoEExpertsFn
from lazyspec.models.layers.linear import linear
from lazyspec.models.layers.mlp import DOWN, UP
from lazyspec.models.layers.moe import ExpertStack, grouped_experts, padding_follows_token_zero
from lazyspec.models.plan import Params, TensorSpec, linear_spec


@dataclass(frozen=True)
class MoESpec:
    """Sigmoid-routed MoE of relu^2 experts (grouped top-k) plus one shared relu^2 expert."""

    num_experts: int
    top_k: int
    intermediate_size: int
    shared_intermediate_size: int
    latent_size: int | None  # experts run in this width when set (fc1/fc2 latent projections)
    num_groups: int  # expert groups for routing (n_group)
    top_groups: int  # groups kept per token (topk_group)
    norm_top_k: bool
    scaling: float


def relu2_mlp_plan(prefix: str, hidden_size: int, width: int, bias: bool) -> Params:
    """Plan of a relu^2 MLP whose ``up_proj`` / ``down_proj`` sit under ``prefix``."""
    return {
        "up_proj": linear_spec(f"{prefix}.up_proj", hidden_size, width, bias, axes=UP),
        "down_proj": linear_spec(f"{prefix}.down_proj", width, hidden_size, bias, axes=DOWN),
    }


def moe_plan(prefix: str, hidden_size: int, spec: MoESpec, bias: bool) -> Params:
    """Plan of one MoE block under ``prefix``; the router and its bias stay float32.

    Experts come per expert or fused (``{prefix}.experts.up_proj`` / ``down_proj``,
    ``[E, out, in]``).
    """
    experts, inner = spec.num_experts, spec.latent_size or hidden_size
    plan = {
        "router": TensorSpec(
            f"{prefix}.gate.weight", (experts, hidden_size), transpose=True, dtype="float32"
        ),
        "router_bias": TensorSpec(
            f"{prefix}.gate.e_score_correction_bias", (experts,), init="zeros", dtype="float32"
        ),
        "shared": relu2_mlp_plan(
            f"{prefix}.shared_experts", hidden_size, spec.shared_intermediate_size, bias
        ),
    }
    for proj in ("up_proj", "down_proj"):
        plan[f"experts_{proj.removesuffix('_proj')}"] = ExpertStack(
            f"{prefix}.experts", proj, experts, inner, spec.intermediate_size, fused_gate_up=False
        )
    if spec.latent_size:
        plan["latent_in"] = linear_spec(f"{prefix}.fc1_latent_proj", hidden_size, inner, bias)
        plan["latent_out"] = linear_spec(f"{prefix}.fc2_latent_proj", inner, hidden_size, bias)
    return plan


def relu2_mlp(params: dict, x: jax.Array) -> jax.Array:
    """``down(relu(up(x))^2)``: the non-gated Nemotron-H MLP."""
    up = jax.nn.relu(linear(params["up_proj"], x))
    return linear(params["down_proj"], up * up)


def route(params: dict, spec: MoESpec, flat: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(weights ``[N, k]`` float32, expert ids ``[N, k]``) for tokens ``flat`` [N, D].

    Scores are sigmoids of the float32 router; choice adds the correction bias, keeps the
    ``top_groups`` groups with the best sum of their two best experts, then the top-k experts.
    The weights are the plain scores of the chosen experts, renormalised and scaled.
    """
    scores = jax.nn.sigmoid(flat.astype(jnp.float32) @ params["router"])
    choice = scores + params["router_bias"]
    if spec.num_groups > 1:
        grouped = choice.reshape(-1, spec.num_groups, spec.num_experts // spec.num_groups)
        group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
        _, group_ids = jax.lax.top_k(group_score, spec.top_groups)
        keep = jnp.any(jax.nn.one_hot(group_ids, spec.num_groups, dtype=bool), axis=1)
        keep = jnp.repeat(keep, spec.num_experts // spec.num_groups, axis=1)
        choice = jnp.where(keep, choice, -jnp.inf)
    _, expert_ids = jax.lax.top_k(choice, spec.top_k)
    weights = jnp.take_along_axis(scores, expert_ids, axis=1)
    if spec.norm_top_k:
        weights = weights / (jnp.sum(weights, axis=1, keepdims=True) + 1e-20)
    return weights * spec.scaling, expert_ids


@jax.named_scope("moe")
def sparse_moe(
    params: dict,
    spec: MoESpec,
    x: jax.Array,
    moe_experts: MoEExpertsFn | None = None,
    real: jax.Array | None = None,
) -> jax.Array:
    """Routed relu^2 experts + the shared expert, for x [..., D]. Each token runs only its
    top-k experts (``grouped_experts``: sorted by expert, grouped matmuls; or the
    ``moe_experts`` kernel, which chooses by shape, in the latent width when there is one).
    ``real``: padding tokens are routed like token 0 (``padding_follows_token_zero``)."""
    flat = x.reshape(-1, x.shape[-1])
    weights, expert_ids = route(params, spec, flat)
    expert_ids = padding_follows_token_zero(expert_ids, real)
    h = linear(params["latent_in"], flat) if "latent_in" in params else flat

    def relu2_experts(xs, group_sizes):
        xs = xs.astype(params["experts_up"].dtype)
        up = jax.nn.relu(jax.lax.ragged_dot(xs, params["experts_up"], group_sizes))
        return jax.lax.ragged_dot(up * up, params["experts_down"], group_sizes)

    def xla_form():
        return grouped_experts(h, weights, expert_ids, spec.num_experts, relu2_experts)

    if moe_experts is None:
        routed = xla_form()
    else:
        stacks = (params["experts_up"], params["experts_down"])
        routed = moe_experts(h, weights, expert_ids, *stacks, xla_form=xla_form)
    routed = routed.astype(flat.dtype)
    if "latent_out" in params:
        routed = linear(params["latent_out"], routed)
    out = routed + relu2_mlp(params["shared"], flat)
    return out.reshape(x.shape)
