"""The Qwen3.5 family (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM): Qwen3-Next's layers,
read from Qwen3.5 checkpoints.

The decoder is Qwen3-Next's (``qwen3_next.py``): zero-centred RMSNorms, Gated DeltaNet and
gated full attention with q/k norms and partial RoPE, the ``mtp.*`` draft head. What differs:

* the GDN input projections are split (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
  ``in_proj_a``; ``GDNSpec.split_projections``) instead of fused per key head;
* every MLP is dense (``qwen3_5``) or every MLP is a sparse MoE with a gated shared expert
  whose top-k weights are always renormalised (``qwen3_5_moe``);
* the rotary embedding is multimodal (mrope): for text, all three position streams are the
  token position, so it is the plain partial RoPE of ``layers/rope.py``;
* the MTP layer count is ``mtp_num_hidden_layers``;
* a vision-language checkpoint (``Qwen3_5ForConditionalGeneration``, model_type
  ``qwen3_5`` / ``qwen3_5_moe``) nests the text config under ``text_config`` and the
  decoder under ``model.language_model``: the language model is loaded, the vision tower
  skipped. Image input is not supported.

The forward functions are Qwen3-Next's: ``ModelConfig.arch`` is a ``Qwen3NextArch``.
"""

from __future__ import annotations

import logging
from typing import Any

import jax.numpy as jnp

from lazyspec.models import qwen3_next
from lazyspec.models.config import ModelConfig, require
from lazyspec.models.layers.moe import MoESpec
from lazyspec.models.plan import Params, Placement
from lazyspec.models.qwen3_next import (  # noqa: F401  (the family contract)
    compute_logits,
    compute_mtp_logits,
    forward,
    init_params,
    lm_head_columns,
    mtp_forward,
    reference_forward,
    weight_plan,
)

logger = logging.getLogger(__name__)

FAMILY = "qwen3_5"
DENSE_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
MOE_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
TEXT_PREFIX = "model"
VL_TEXT_PREFIX = "model.language_model"  # the decoder inside a vision-language checkpoint
VISION_PREFIX = "model.visual."


def _moe_spec(text: dict[str, Any]) -> MoESpec:
    req = lambda key: require(text, key, FAMILY)  # noqa: E731
    return MoESpec(
        hidden_size=int(req("hidden_size")),
        num_experts=int(req("num_experts")),
        top_k=int(req("num_experts_per_tok")),
        intermediate_size=int(req("moe_intermediate_size")),
        shared_intermediate_size=int(req("shared_expert_intermediate_size")),
        norm_topk_prob=True,  # Qwen3.5's router always renormalises the top-k weights
    )


def parse_config(hf: dict[str, Any]) -> ModelConfig:
    """A Qwen3.5 ``config.json`` dict (text-only or vision-language) -> ModelConfig.

    ValueError names a missing field or an unknown model_type.
    """
    model_type = hf.get("model_type")
    if model_type not in DENSE_MODEL_TYPES + MOE_MODEL_TYPES:
        raise ValueError(
            f"{model_type!r} is not a Qwen3.5 model_type; "
            f"expected one of {DENSE_MODEL_TYPES + MOE_MODEL_TYPES}"
        )
    text = hf.get("text_config") or hf
    if text.get("mtp_use_dedicated_embeddings"):
        raise ValueError("mtp_use_dedicated_embeddings=True is not supported")
    num_layers = int(require(text, "num_hidden_layers", FAMILY))
    moe = model_type in MOE_MODEL_TYPES
    kind = "moe" if moe else "dense"
    if "eos_token_id" not in text and "eos_token_id" in hf:
        text = {**text, "eos_token_id": hf["eos_token_id"]}
    return qwen3_next.build_config(
        text,
        family=FAMILY,
        mlp_kinds=(kind,) * num_layers,
        moe=_moe_spec(text) if moe else None,
        mtp_mlp_kind=kind,
        num_mtp_layers=int(text.get("mtp_num_hidden_layers") or 0),
        split_projections=True,
        # the outermost model ties (or not) its lm_head to the embedding
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def _text_prefix(reader) -> str:
    """Where the decoder sits: ``model`` or, in a vision-language checkpoint,
    ``model.language_model`` (whose vision tower is skipped, logged)."""
    if f"{VL_TEXT_PREFIX}.embed_tokens.weight" not in reader:
        return TEXT_PREFIX
    num_vision = sum(1 for _ in reader.iter_prefix(VISION_PREFIX))
    logger.info(
        "vision-language checkpoint: loading the language model, skipping %d vision tower "
        "tensors (%s*); image input is not supported",
        num_vision,
        VISION_PREFIX,
    )
    return VL_TEXT_PREFIX


def load_params(
    cfg: ModelConfig, reader, dtype=jnp.float32, place: Placement | None = None
) -> Params:
    """Params read tensor by tensor from a ``SafetensorsReader`` and cast to ``dtype``.

    Reads a text-only or a vision-language checkpoint; the MTP head as in
    ``qwen3_next.load_params``. Missing or misshapen tensors raise ValueError.
    """
    return qwen3_next.load_params(cfg, reader, dtype, _text_prefix(reader), place)
