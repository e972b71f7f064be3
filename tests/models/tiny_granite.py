"""Tiny random Granite 4.0-H checkpoints written by transformers, for parity tests.

``save_tiny_granite`` builds a GraniteMoeHybridForCausalLM from a small config, re-draws every
parameter that transformers initialises to a constant (norm weights, D, dt_bias, A_log, conv
bias) so no term of the math is trivially 1 or 0, gives the projections unit gain (at
transformers' 0.02 the attention scores and expert outputs would be too small to show an
error), and saves it with save_pretrained. Needs torch + transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Small shapes shared by every tiny config: Mamba2 H=4 heads of P=16 (expand 2), N=16, K=4;
# the Granite multipliers far from 1, as in the released configs.
BASE = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=24,
    shared_intermediate_size=40,
    num_attention_heads=4,
    num_key_value_heads=2,
    mamba_n_heads=4,
    mamba_d_head=16,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=16,  # transformers' torch SSD chunk; ours is 64, so the two differ
    num_local_experts=4,
    num_experts_per_tok=2,
    rms_norm_eps=1e-5,
    embedding_multiplier=12.0,
    residual_multiplier=0.22,
    attention_multiplier=0.125,
    logits_scaling=4.0,
    eos_token_id=2,
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

PATTERN_NAMES = {"M": "mamba", "*": "attention"}


def hf_config_dict(pattern: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of GraniteMoeHybridConfig for ``pattern`` (one char per layer)."""
    config = dict(BASE)
    config.update(overrides)
    config["num_hidden_layers"] = len(pattern)
    config["layer_types"] = [PATTERN_NAMES[ch] for ch in pattern]
    return config


def _redraw_constants(model, seed: int) -> None:
    """Give every constant-initialised tensor random values of a plausible scale."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            shape = param.shape
            if name.endswith("A_log"):
                param.copy_(torch.log(torch.rand(shape, generator=gen) * 7 + 1))
            elif name.endswith("dt_bias"):
                param.copy_(torch.rand(shape, generator=gen) * 4 - 3)
            elif name.endswith("mamba.D"):
                param.copy_(torch.randn(shape, generator=gen))
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.copy_(1 + 0.3 * torch.randn(shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(shape, generator=gen))
            elif name.endswith("lm_head.weight") or name.endswith("embed_tokens.weight"):
                param.copy_(0.1 * torch.randn(shape, generator=gen))
            elif param.dim() >= 2 and "conv1d" not in name:
                # unit-gain projections: attention scores, routing and every branch of
                # the residual stream matter at the parity tolerance
                param.copy_(torch.randn(shape, generator=gen) * shape[-1] ** -0.5)


def save_tiny_granite(folder: str | Path, pattern: str, overrides: dict[str, Any], seed: int = 0):
    """Build, randomise and save a tiny GraniteMoeHybridForCausalLM; returns the torch model
    (eval)."""
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    torch.manual_seed(seed)
    config = GraniteMoeHybridConfig(**hf_config_dict(pattern, overrides))
    model = GraniteMoeHybridForCausalLM(config).float().eval()
    _redraw_constants(model, seed + 1)
    model.save_pretrained(str(folder))
    return model
