"""Tiny random Nemotron-H checkpoints written by transformers, for parity tests.

``save_tiny_nemotron`` builds a NemotronHForCausalLM from a small config, re-draws every
parameter that transformers initialises to a constant (norm weights, D, dt_bias, conv bias,
router bias, ...) so no term of the math is trivially 1 or 0, and saves it with
save_pretrained. Needs torch + transformers.
"""

from __future__ import annotations

from typing import Any

from lazyspec.testing.tiny_models import NEMOTRON_HF
from tests.models.redraw import PatternCheckpoints

_PER_CONFIG = ("model_type", "n_groups", "max_position_embeddings", "layers_block_type")

# The engine tests' tiny widths (Mamba2 H=4 heads of P=8, N=16, K=4), an MoE, and no layer
# pattern or group count: each tiny config names its own.
BASE = dict(
    {k: v for k, v in NEMOTRON_HF.items() if k not in _PER_CONFIG},
    chunk_size=16,  # transformers' torch SSD chunk; ours is 64, so the two differ on purpose
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    moe_shared_expert_intermediate_size=40,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=1.5,
)

# name -> (pattern, overrides); "M" Mamba2, "*" attention, "-" MLP, "E" MoE.
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "M-M*-": ("M-M*-", dict(n_groups=1)),
    # time_step_limit (0.2, 0.4) cuts softplus of many dt values at both ends: the dt clamp
    # is active.
    "M*M-M*": ("M*M-M*", dict(n_groups=2, time_step_limit=(0.2, 0.4))),
    "ME*M-": ("ME*M-", dict(n_groups=4, use_bias=True, mlp_bias=True, tie_word_embeddings=True)),
}

CHECKPOINTS = PatternCheckpoints(
    "NemotronHConfig",
    "NemotronHForCausalLM",
    BASE,
    pattern_names={"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"},
    layers_field="layers_block_type",
    redraw=dict(
        d_suffix="mixer.D",
        norm_suffixes=("norm.weight", "norm_f.weight"),
        embedding_suffixes=("lm_head.weight", "embeddings.weight"),
        embedding_scale=1.0,
        buffer_suffixes=("e_score_correction_bias",),
    ),
)
hf_config_dict = CHECKPOINTS.hf_config_dict
save_tiny_nemotron = CHECKPOINTS.save
