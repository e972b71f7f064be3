"""The Granite 4.0-H family (GraniteMoeHybridForCausalLM): Mamba2 or attention, then MoE.

Every layer is ``h = h + r * mixer(norm(h)); h = h + r * ffn(norm(h))`` with plain RMSNorms
and the residual multiplier ``r``. The mixer is a Mamba2 mixer (``layers/mamba2.py``) or GQA
attention (``layers/attention.py``) whose softmax scale is ``attention_multiplier`` and which
has rotary embedding only when ``position_embedding_type`` is "rope" (Granite 4.0-H: none).
The ffn is a shared SwiGLU MLP plus, when the config has experts, softmax-top-k routed
SwiGLU experts (``layers/moe.routed_experts``); dense variants (no experts) run the shared
MLP alone. Embeddings are scaled by ``embedding_multiplier`` and logits divided by
``logits_scaling``. No MTP head.

The module exposes the family contract of ``interface.py``: ``parse_config``,
``load_params`` and ``init_params`` (from ``granite_params``), ``forward``,
``reference_forward`` and ``compute_logits``.

Params (HF module names, linears as in ``layers/mlp.linear``): ``{"embed_tokens": [V, D],
"norm": [D], "lm_head": linear (absent when tied), "layers": [{"input_layernorm",
"post_attention_layernorm", "mamba" | "self_attn", "shared_mlp", "block_sparse_moe" (with
experts)}, ...]}``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from lazyspec.models.config import (
    ATTENTION,
    RECURRENT,
    ModelConfig,
    eos_ids,
    layer_roles,
    pool_sizes,
    require,
    time_step_limit,
)
from lazyspec.models.decoder import (
    Decoder,
    Mlp,
    Step,
    attention_mixer,
    family_forwards,
    mamba2_mixer_kind,
)
from lazyspec.models.granite_params import (  # noqa: F401 (family API)
    init_params,
    load_params,
    weight_plan,
)
from lazyspec.models.layers.attention import AttentionSpec
from lazyspec.models.layers.linear import linear
from lazyspec.models.layers.mamba2 import Mamba2Dims
from lazyspec.models.layers.mlp import swiglu_mlp
from lazyspec.models.layers.moe import MoESpec, routed_experts
from lazyspec.models.layers.norms import rms_norm
from lazyspec.models.layers.residual import ResidualStream
from lazyspec.models.plan import Params

FAMILY = "granitemoehybrid"
# layer_types names: transformers' current ones and the legacy ones of released configs.
_ROLES = {
    "linear_attention": RECURRENT,
    "mamba": RECURRENT,
    "full_attention": ATTENTION,
    "attention": ATTENTION,
}


@dataclass(frozen=True)
class GraniteArch:
    """Granite 4.0-H details beyond ModelConfig (``ModelConfig.arch``)."""

    rms_norm_eps: float
    mamba: Mamba2Dims | None  # None without Mamba2 layers
    attention: AttentionSpec | None  # None without attention layers
    moe: MoESpec | None  # None for dense variants (num_local_experts == 0)
    shared_intermediate_size: int
    mamba_bias: bool  # in_proj / out_proj biases
    conv_bias: bool
    embedding_multiplier: float
    residual_multiplier: float
    logits_scaling: float


# ---------------------------------------------------------------- config


def _layer_roles(hf: dict[str, Any]) -> tuple[str, ...]:
    """Roles from ``layer_types`` (or ``layers_block_type``); all Mamba2 when absent."""
    num_layers = int(require(hf, "num_hidden_layers", FAMILY))
    types = hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * num_layers
    return layer_roles(types, num_layers, _ROLES, "Granite layer_types")


def _mamba_dims(hf: dict[str, Any], hidden: int, eps: float) -> Mamba2Dims:
    heads = int(require(hf, "mamba_n_heads", FAMILY))
    inner = int(hf.get("mamba_expand", 2)) * hidden
    head_dim = hf.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim in (None, "auto") else int(head_dim)
    low, high = time_step_limit(hf.get("time_step_limit"))
    dims = Mamba2Dims(
        hidden_size=hidden,
        num_heads=heads,
        head_dim=head_dim,
        state_size=int(require(hf, "mamba_d_state", FAMILY)),
        n_groups=int(hf.get("mamba_n_groups", 1)),
        conv_kernel=int(hf.get("mamba_d_conv", 4)),
        norm_eps=eps,
        dt_min=low,
        dt_max=high,
    )
    if heads * head_dim != inner or heads % dims.n_groups:
        raise ValueError(
            f"mamba_n_heads {heads} x mamba_d_head {head_dim} must equal mamba_expand * "
            f"hidden_size {inner}, and mamba_n_groups {dims.n_groups} divide the heads"
        )
    return dims


def _attention_spec(hf: dict[str, Any], hidden: int, eps: float) -> AttentionSpec:
    heads = int(require(hf, "num_attention_heads", FAMILY))
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads {heads} not divisible by {kv_heads} KV heads")
    head_dim = int(hf.get("head_dim") or hidden // heads)
    position = hf.get("position_embedding_type")
    if position not in (None, "nope", "rope"):
        raise ValueError(f"unsupported position_embedding_type {position!r}; None, nope or rope")
    rope = dict(hf.get("rope_scaling") or {})
    rope.update(hf.get("rope_parameters") or {})
    if position == "rope" and rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"unsupported rope_type {rope.get('rope_type')!r}; only 'default'")
    return AttentionSpec(
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rotary_dim=head_dim if position == "rope" else 0,
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=eps,
        bias=bool(hf.get("attention_bias", False)),
        scaling=float(hf.get("attention_multiplier", 1.0)),
    )


def _moe_spec(hf: dict[str, Any], hidden: int, shared: int) -> MoESpec | None:
    num_experts = int(require(hf, "num_local_experts", FAMILY))
    if num_experts == 0:
        return None
    top_k = int(hf.get("num_experts_per_tok", 2))
    if not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be in 1..{num_experts}")
    return MoESpec(
        hidden_size=hidden,
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=int(require(hf, "intermediate_size", FAMILY)),
        shared_intermediate_size=shared,
        norm_topk_prob=True,  # softmax over the top-k logits
    )


def parse_config(hf: dict[str, Any]) -> ModelConfig:
    """A Granite 4.0-H ``config.json`` dict -> ModelConfig; ValueError names a missing field."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {hf.get('hidden_act')!r}; only 'silu'")
    hidden = int(require(hf, "hidden_size", FAMILY))
    eps = float(hf.get("rms_norm_eps", 1e-6))
    roles = _layer_roles(hf)
    mamba = _mamba_dims(hf, hidden, eps) if RECURRENT in roles else None
    attention = _attention_spec(hf, hidden, eps) if ATTENTION in roles else None
    shared = int(require(hf, "shared_intermediate_size", FAMILY))
    arch = GraniteArch(
        rms_norm_eps=eps,
        mamba=mamba,
        attention=attention,
        moe=_moe_spec(hf, hidden, shared),
        shared_intermediate_size=shared,
        mamba_bias=bool(hf.get("mamba_proj_bias", False)),
        conv_bias=bool(hf.get("mamba_conv_bias", True)),
        embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
        logits_scaling=float(hf.get("logits_scaling", 1.0)),
    )
    return ModelConfig(
        family=FAMILY,
        vocab_size=int(require(hf, "vocab_size", FAMILY)),
        hidden_size=hidden,
        layer_roles=roles,
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        **pool_sizes(attention, mamba),
        eos_token_ids=eos_ids(hf),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        num_mtp_layers=0,
        arch=arch,
    )


# ---------------------------------------------------------------- forward passes


def _ffn_kind(moe: MoESpec | None) -> Mlp:
    """Shared MLP plus (with experts) the routed experts, for h ``[..., D]``; those run in
    the step's ``moe_experts`` when it has one, padding tokens (``real``) routed like token
    0."""

    def run(lp, h, step: Step, logits) -> jax.Array:
        out = swiglu_mlp(lp["shared_mlp"], h)
        if "block_sparse_moe" in lp:
            flat = h.reshape(-1, h.shape[-1])
            routed = routed_experts(
                lp["block_sparse_moe"], moe, flat, step.kernels.moe_experts, step.real
            )
            out = out + routed.reshape(h.shape)
        return out

    return Mlp(run)


@functools.cache
def decoder(cfg: ModelConfig) -> Decoder:
    """The declared layers: Mamba2 or attention, then the ffn; plain RMSNorms, every
    sublayer's output scaled by the residual multiplier, the embedding by its own."""
    arch: GraniteArch = cfg.arch
    mixer_kinds = {RECURRENT: "mamba2", ATTENTION: "attention"}
    layers = tuple((mixer_kinds[role], "ffn") for role in cfg.layer_roles)
    stream = ResidualStream(arch.rms_norm_eps, multiplier=arch.residual_multiplier)
    mixers = {"attention": attention_mixer(arch.attention)}
    if arch.mamba is not None:
        mixers["mamba2"] = mamba2_mixer_kind(arch.mamba, "mamba")
    mlps = {"ffn": _ffn_kind(arch.moe)}
    return Decoder(layers, stream, mixers, mlps, embedding_multiplier=arch.embedding_multiplier)


# ``extend`` runs the chunked Mamba2 form, ``decode`` / ``verify`` the T-step form whose SSM
# update runs in ``kernels.mamba2_state_update`` when it has one (``decoder.py``)
forward, reference_forward = family_forwards(decoder)


def compute_logits(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Final RMSNorm, lm_head (the embedding when tied), then ``/ logits_scaling``: float32
    ``[..., V]``."""
    x = rms_norm(hidden, params["norm"], cfg.arch.rms_norm_eps)
    if "lm_head" in params:
        logits = linear(params["lm_head"], x).astype(jnp.float32)
    else:
        embed = params["embed_tokens"]
        logits = jnp.matmul(x.astype(embed.dtype), embed.T).astype(jnp.float32)
    return logits / cfg.arch.logits_scaling
