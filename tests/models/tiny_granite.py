"""Tiny random Granite 4.0-H checkpoints written by transformers, for parity tests.

``save_tiny_granite`` builds a GraniteMoeHybridForCausalLM from a small config, re-draws every
parameter that transformers initialises to a constant (norm weights, D, dt_bias, A_log, conv
bias) so no term of the math is trivially 1 or 0, gives the projections unit gain (at
transformers' 0.02 the attention scores and expert outputs would be too small to show an
error), and saves it with save_pretrained. Needs torch + transformers.
"""

from __future__ import annotations

from typing import Any

from lazyspec.testing.tiny_models import GRANITE_HF
from tests.models.redraw import PatternCheckpoints

# The engine tests' tiny widths (Mamba2 H=4 heads of P=16, expand 2, N=16, K=4) with the
# Granite multipliers far from 1, as in the released configs; each tiny config names its
# layers, groups, positions and embedding tie.
_PER_CONFIG = (
    "model_type",
    "num_hidden_layers",
    "layer_types",
    "mamba_n_groups",
    "position_embedding_type",
    "tie_word_embeddings",
    "max_position_embeddings",
)
BASE = dict(
    {k: v for k, v in GRANITE_HF.items() if k not in _PER_CONFIG},
    mamba_chunk_size=16,  # transformers' torch SSD chunk; ours is 64, so the two differ
    embedding_multiplier=12.0,
    residual_multiplier=0.22,
    bos_token_id=1,
)

# name -> (pattern, overrides); "M" Mamba2, "*" attention (legacy names in the config).
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # Granite 4.0-H: MoE, no positional embedding, tied embeddings.
    "M*MM": ("M*MM", dict(mamba_n_groups=1, tie_word_embeddings=True)),
    # rope attention, attention biases, two groups, an active dt clamp, untied lm_head.
    "MM*M*": (
        "MM*M*",
        dict(
            mamba_n_groups=2,
            position_embedding_type="rope",
            rope_parameters=dict(rope_type="default", rope_theta=1000.0),
            attention_bias=True,
            time_step_limit=(0.2, 1.5),
            tie_word_embeddings=False,
        ),
    ),
    # dense (no experts), projection biases, no conv bias.
    "M*M": (
        "M*M",
        dict(
            mamba_n_groups=4,
            num_local_experts=0,
            mamba_proj_bias=True,
            mamba_conv_bias=False,
            tie_word_embeddings=True,
        ),
    ),
}

# "M" Mamba2, "*" attention (legacy names in the config)
CHECKPOINTS = PatternCheckpoints(
    "GraniteMoeHybridConfig",
    "GraniteMoeHybridForCausalLM",
    BASE,
    pattern_names={"M": "mamba", "*": "attention"},
    layers_field="layer_types",
    num_layers_field="num_hidden_layers",
    redraw=dict(
        d_suffix="mamba.D",
        norm_suffixes=("norm.weight", "layernorm.weight"),
        embedding_suffixes=("lm_head.weight", "embed_tokens.weight"),
        embedding_scale=0.1,
        unit_gain=True,
    ),
)
hf_config_dict = CHECKPOINTS.hf_config_dict
save_tiny_granite = CHECKPOINTS.save
