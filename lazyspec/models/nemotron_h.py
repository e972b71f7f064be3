"""The Nemotron-H family (NemotronHForCausalLM): Mamba2, attention, MLP and MoE blocks.

Every layer is one pre-norm residual block ``h = h + mixer(rms_norm(h))`` whose mixer is a
Mamba2 mixer (``layers/mamba2.py``), GQA attention without positional embedding, a non-gated
relu^2 MLP, or a sigmoid-routed MoE of relu^2 experts plus a shared expert
(``layers/relu2_moe.py``). The module exposes the family contract of ``interface.py``:
``parse_config``, ``init_params`` and ``load_params`` (from ``nemotron_h_params``),
``forward``, ``compute_logits`` and ``reference_forward``. The checkpoint's MTP head (if any)
is not used yet.

Params: ``{"embed_tokens": [V, D], "norm": [D], "lm_head": linear (absent when tied),
"layers": [{"norm": [D], "mixer": {...}}, ...]}``, linears as in ``layers/mlp.linear``.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from lazyspec.models.config import (
    ATTENTION,
    RECURRENT,
    STATELESS,
    ModelConfig,
    eos_ids,
    pool_sizes,
    time_step_limit,
)
from lazyspec.models.decoder import (
    NONE,
    Decoder,
    Mlp,
    attention_mixer,
    family_forwards,
    mamba2_mixer_kind,
)
from lazyspec.models.layers.attention import AttentionSpec
from lazyspec.models.layers.linear import linear
from lazyspec.models.layers.mamba2 import Mamba2Dims
from lazyspec.models.layers.norms import rms_norm
from lazyspec.models.layers.relu2_moe import MoESpec, relu2_mlp, sparse_moe
from lazyspec.models.layers.residual import ResidualStream
from lazyspec.models.nemotron_h_params import (  # noqa: F401 (family API)
    init_params,
    load_params,
    weight_plan,
)

logger = logging.getLogger(__name__)

FAMILY = "nemotron_h"

# Block names of layers_block_type and of the legacy hybrid_override_pattern characters.
_BLOCK_KINDS = {
    "mamba": "mamba",
    "linear_attention": "mamba",
    "M": "mamba",
    "attention": "attention",
    "full_attention": "attention",
    "*": "attention",
    "mlp": "mlp",
    "-": "mlp",
    "moe": "moe",
    "E": "moe",
}
_ROLES = {"mamba": RECURRENT, "attention": ATTENTION, "mlp": STATELESS, "moe": STATELESS}
# Older Nemotron-H config.json files spell some fields differently.
_LEGACY_NAMES = {
    "n_groups": "mamba_n_groups",
    "conv_kernel": "mamba_d_conv",
    "time_step_min": "mamba_dt_min",
    "time_step_limit": "mamba_dt_limit",
    "use_conv_bias": "mamba_conv_bias",
    "head_dim": "attention_head_dim",
}
_REQUIRED = object()


@dataclass(frozen=True)
class NemotronHArch:
    """Nemotron-H details beyond ModelConfig (``ModelConfig.arch``)."""

    block_kinds: tuple[str, ...]  # "mamba" | "attention" | "mlp" | "moe" per layer
    mamba: Mamba2Dims | None
    attention: AttentionSpec | None
    intermediate_size: int  # dense MLP width (0 without mlp blocks)
    mlp_bias: bool
    mamba_bias: bool  # in_proj / out_proj biases
    conv_bias: bool
    norm_eps: float
    moe: MoESpec | None


def _field(hf: dict[str, Any], key: str, default: Any = _REQUIRED) -> Any:
    """``hf[key]`` (or its legacy name); ValueError naming ``key`` when required and absent."""
    for name in (key, _LEGACY_NAMES.get(key)):
        if name is not None and hf.get(name) is not None:
            return hf[name]
    if default is _REQUIRED:
        raise ValueError(f"{FAMILY} config.json is missing the required field {key!r}")
    return default


def _block_kinds(hf: dict[str, Any]) -> tuple[str, ...]:
    """Per-layer block kinds from ``layers_block_type`` or ``hybrid_override_pattern``."""
    names = hf.get("layers_block_type") or hf.get("layer_types")
    if names is None:
        names = list(_field(hf, "hybrid_override_pattern"))
    unknown = [n for n in names if n not in _BLOCK_KINDS]
    if unknown:
        raise ValueError(f"unknown Nemotron-H block types {unknown!r} in {names!r}")
    return tuple(_BLOCK_KINDS[n] for n in names)


def _mamba_dims(hf: dict[str, Any], eps: float) -> Mamba2Dims:
    limit = time_step_limit(_field(hf, "time_step_limit", None))
    dims = Mamba2Dims(
        hidden_size=_field(hf, "hidden_size"),
        num_heads=_field(hf, "mamba_num_heads"),
        head_dim=_field(hf, "mamba_head_dim"),
        state_size=_field(hf, "ssm_state_size"),
        n_groups=_field(hf, "n_groups"),
        conv_kernel=_field(hf, "conv_kernel"),
        norm_eps=eps,
        # the clamp of dt: time_step_limit, as transformers (from 5.25; its earlier port
        # clamped at time_step_min instead) and the reference Mamba2 mixer read it
        dt_min=limit[0],
        dt_max=limit[1],
    )
    if dims.num_heads % dims.n_groups:
        raise ValueError(
            f"mamba_num_heads {dims.num_heads} not divisible by n_groups {dims.n_groups}"
        )
    return dims


def _attention_spec(hf: dict[str, Any], eps: float) -> AttentionSpec:
    heads = _field(hf, "num_attention_heads")
    kv_heads = _field(hf, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise ValueError(
            f"num_attention_heads {heads} not divisible by num_key_value_heads {kv_heads}"
        )
    head_dim = _field(hf, "head_dim", _field(hf, "hidden_size") // heads)
    return AttentionSpec(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, norm_eps=eps)


def _moe_spec(hf: dict[str, Any]) -> MoESpec:
    return MoESpec(
        num_experts=_field(hf, "n_routed_experts"),
        top_k=_field(hf, "num_experts_per_tok"),
        intermediate_size=_field(hf, "moe_intermediate_size"),
        shared_intermediate_size=_field(hf, "moe_shared_expert_intermediate_size"),
        latent_size=_field(hf, "moe_latent_size", None),
        num_groups=_field(hf, "n_group", 1),
        top_groups=_field(hf, "topk_group", 1),
        norm_top_k=bool(_field(hf, "norm_topk_prob", True)),
        scaling=float(_field(hf, "routed_scaling_factor", 1.0)),
    )


def parse_config(hf: dict[str, Any]) -> ModelConfig:
    """Parse a Nemotron-H ``config.json`` dict; missing fields raise ValueError naming them."""
    kinds = _block_kinds(hf)
    eps = float(_field(hf, "layer_norm_epsilon", 1e-5))
    act = _field(hf, "mlp_hidden_act", "relu2")
    if act != "relu2":
        raise ValueError(f"unsupported Nemotron-H mlp_hidden_act {act!r}; only 'relu2'")
    mamba = _mamba_dims(hf, eps) if "mamba" in kinds else None
    attention = _attention_spec(hf, eps) if "attention" in kinds else None
    arch = NemotronHArch(
        block_kinds=kinds,
        mamba=mamba,
        attention=attention,
        intermediate_size=_field(hf, "intermediate_size") if "mlp" in kinds else 0,
        mlp_bias=bool(_field(hf, "mlp_bias", False)),
        mamba_bias=bool(_field(hf, "use_bias", False)),
        conv_bias=bool(_field(hf, "use_conv_bias", True)),
        norm_eps=eps,
        moe=_moe_spec(hf) if "moe" in kinds else None,
    )
    if _field(hf, "num_nextn_predict_layers", 0):
        logger.warning("Nemotron-H checkpoint declares MTP layers; the MTP head is not used yet")
    return ModelConfig(
        family=FAMILY,
        vocab_size=_field(hf, "vocab_size"),
        hidden_size=_field(hf, "hidden_size"),
        layer_roles=tuple(_ROLES[k] for k in kinds),
        max_position_embeddings=_field(hf, "max_position_embeddings", 4096),
        **pool_sizes(attention, mamba),
        eos_token_ids=eos_ids(hf),
        tie_word_embeddings=bool(_field(hf, "tie_word_embeddings", False)),
        num_mtp_layers=0,
        arch=arch,
    )


# ---------------------------------------------------------------- forward


def _mlp_kinds(arch: NemotronHArch) -> dict[str, Mlp]:
    """The relu^2 MLP and the relu^2 MoE (routed experts in the step's ``moe_experts`` when
    it has one, padding tokens routed like token 0), their params at ``lp["mixer"]``."""

    def moe(lp, h, step, logits) -> jax.Array:
        return sparse_moe(lp["mixer"], arch.moe, h, step.kernels.moe_experts, step.real)

    return {"mlp": Mlp(lambda lp, h, step, logits: relu2_mlp(lp["mixer"], h)), "moe": Mlp(moe)}


@functools.cache
def decoder(cfg: ModelConfig) -> Decoder:
    """The declared blocks: each a mixer (Mamba2, attention) or an MLP (relu^2, MoE) after
    the block's one plain RMSNorm."""
    arch: NemotronHArch = cfg.arch
    halves = {"mamba": ("mamba2", NONE), "attention": ("attention", NONE)}
    layers = tuple(halves.get(kind, (NONE, kind)) for kind in arch.block_kinds)
    mixers = {"attention": attention_mixer(arch.attention, "mixer")}
    if arch.mamba is not None:
        mixers["mamba2"] = mamba2_mixer_kind(arch.mamba, "mixer")
    stream = ResidualStream(arch.norm_eps)
    return Decoder(layers, stream, mixers, _mlp_kinds(arch), norms=("norm", "norm"))


# ``extend`` runs the chunked Mamba2 form, ``decode`` / ``verify`` the T-step form whose SSM
# update runs in ``kernels.mamba2_state_update`` when it has one (``decoder.py``)
forward, reference_forward = family_forwards(decoder)


def compute_logits(params: dict, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Final RMSNorm then lm_head (the embedding when params have none); float32 [..., V]."""
    x = rms_norm(hidden, params["norm"], cfg.arch.norm_eps)
    if "lm_head" not in params:
        return jnp.matmul(x.astype(jnp.float32), params["embed_tokens"].astype(jnp.float32).T)
    return linear(params["lm_head"], x).astype(jnp.float32)
