"""Tiny random Qwen3.5 checkpoints (dense, MoE, vision-language) for the model tests.

``save_tiny_qwen35`` (needs torch + transformers) builds the transformers model of a tiny
config with random weights, re-draws the constant params (``tiny_qwen.redraw_constants``),
saves it with save_pretrained and optionally adds an MTP head (``mtp.*`` tensors at the top
level, like released checkpoints) declared by ``mtp_num_hidden_layers``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.models.tiny_qwen import BASE, redraw_constants, save_with_mtp

LIN, FULL = "linear_attention", "full_attention"
MOE_FIELDS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)
MOE: dict[str, Any] = {k: BASE[k] for k in MOE_FIELDS}
# Qwen3-Next's tiny widths, no MoE fields, the released 3 GDN : 1 attention layer pattern
TEXT: dict[str, Any] = dict(
    {k: v for k, v in BASE.items() if k not in MOE_FIELDS + ("intermediate_size",)},
    num_hidden_layers=4,
    layer_types=[LIN, LIN, LIN, FULL],
)
VISION: dict[str, Any] = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=32,
    patch_size=4,
    num_position_embeddings=16,
)

# name -> (transformers model class, config class, text config overrides, vision-language?)
TINY_CONFIGS: dict[str, tuple[str, str, dict[str, Any], bool]] = {
    # dense text model, rotary 1/2 with an mrope section that fits it
    "dense": (
        "Qwen3_5ForCausalLM",
        "Qwen3_5TextConfig",
        dict(
            intermediate_size=BASE["intermediate_size"],
            rope_parameters=dict(
                rope_type="default",
                rope_theta=10000.0,
                partial_rotary_factor=0.5,
                mrope_section=[2, 1, 1],
                mrope_interleaved=True,
            ),
        ),
        False,
    ),
    # MoE text model, one value head per key head, tied embeddings, default rope (1/4)
    "moe": (
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeTextConfig",
        dict(MOE, linear_num_value_heads=2, tie_word_embeddings=True),
        False,
    ),
    # the released layout: a vision-language MoE checkpoint (model.language_model.*)
    "vl_moe": (
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3_5MoeConfig",
        dict(MOE),
        True,
    ),
}


def build_hf_model(name: str, seed: int = 0):
    """The transformers model (fp32, eval mode) of tiny config ``name``, random weights."""
    import torch
    import transformers

    model_class, config_class, overrides, vision = TINY_CONFIGS[name]
    text = dict(TEXT, **overrides)
    if vision:
        config = getattr(transformers, config_class)(text_config=text, vision_config=VISION)
    else:
        config = getattr(transformers, config_class)(**text)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    redraw_constants(model, seed + 1)
    return model


def language_model(hf_model):
    """The decoder stack (``embed_tokens``, ``layers``, ``norm``) of a text or VL model."""
    inner = hf_model.model
    return getattr(inner, "language_model", inner)


def save_tiny_qwen35(folder: Path, name: str, seed: int = 0, with_mtp: bool = False):
    """Save tiny config ``name`` to ``folder``; returns (hf_model, mtp tensors or None)."""
    return save_with_mtp(
        folder, build_hf_model(name, seed), seed, with_mtp, "mtp_num_hidden_layers"
    )
