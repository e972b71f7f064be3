"""Nemotron-H's feed-forward blocks: the non-gated relu^2 MLP and the sigmoid-routed MoE of
relu^2 experts (grouped top-k) plus a shared expert. Pure functions over param dicts."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from lazyspec.models.layers.mlp import linear


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


def relu2_mlp(params: dict, x: jax.Array) -> jax.Array:
    """``down(relu(up(x))^2)``: the non-gated Nemotron-H MLP."""
    up = jax.nn.relu(linear(params["up_proj"], x))
    return linear(params["down_proj"], up * up)


def route(params: dict, spec: MoESpec, flat: jax.Array) -> jax.Array:
    """Routing weights [N, E] (zero off the chosen experts) for tokens ``flat`` [N, D].

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
    weights = weights * spec.scaling
    rows = jnp.arange(flat.shape[0])[:, None]
    return jnp.zeros_like(scores).at[rows, expert_ids].add(weights)


def sparse_moe(params: dict, spec: MoESpec, x: jax.Array) -> jax.Array:
    """Routed relu^2 experts + the shared expert, for x [..., D].

    Every expert runs on every token and the routing weights select (dense; fine for tests
    and small models, a grouped matmul is the faster form).
    """
    flat = x.reshape(-1, x.shape[-1])
    weights = route(params, spec, flat)
    h = linear(params["latent_in"], flat) if "latent_in" in params else flat
    up = jax.nn.relu(jnp.einsum("nd,edi->nei", h, params["experts_up"]))
    down = jnp.einsum("nei,eid->ned", up * up, params["experts_down"])
    routed = jnp.einsum("ned,ne->nd", down.astype(jnp.float32), weights).astype(flat.dtype)
    if "latent_out" in params:
        routed = linear(params["latent_out"], routed)
    out = routed + relu2_mlp(params["shared"], flat)
    return out.reshape(x.shape)
