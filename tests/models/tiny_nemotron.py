"""Tiny random Nemotron-H checkpoints written by transformers, for parity tests.

``save_tiny_nemotron`` builds a NemotronHForCausalLM from a small config, re-draws every
parameter that transformers initialises to a constant (norm weights, D, dt_bias, conv bias,
router bias, ...) so no term of the math is trivially 1 or 0, and saves it with
save_pretrained. Needs torch + transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Small Mamba2 shapes shared by every tiny config: H=4 heads of P=8, N=16, K=4.
BASE = dict(
    vocab_size=128,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=48,
    mamba_num_heads=4,
    mamba_head_dim=8,
    ssm_state_size=16,
    conv_kernel=4,
    chunk_size=16,  # transformers' torch SSD chunk; ours is 64, so the two differ on purpose
    layer_norm_epsilon=1e-5,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    moe_shared_expert_intermediate_size=40,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=1.5,
    eos_token_id=2,
)

# name -> (pattern, overrides); "M" Mamba2, "*" attention, "-" MLP, "E" MoE.
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "M-M*-": ("M-M*-", dict(n_groups=1)),
    # time_step_limit (0.2, 0.4) cuts softplus of many dt values at both ends: the dt clamp
    # is active.
    "M*M-M*": ("M*M-M*", dict(n_groups=2, time_step_limit=(0.2, 0.4))),
    "ME*M-": ("ME*M-", dict(n_groups=4, use_bias=True, mlp_bias=True, tie_word_embeddings=True)),
}

PATTERN_NAMES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def hf_config_dict(pattern: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of NemotronHConfig for ``pattern`` (one char per layer)."""
    config = dict(BASE)
    config.update(overrides)
    config["layers_block_type"] = [PATTERN_NAMES[ch] for ch in pattern]
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
            elif name.endswith("mixer.D"):
                param.copy_(torch.randn(shape, generator=gen))
            elif name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                param.copy_(1 + 0.3 * torch.randn(shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(shape, generator=gen))
            elif name.endswith("lm_head.weight") or name.endswith("embeddings.weight"):
                param.copy_(torch.randn(shape, generator=gen))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen))


def save_tiny_nemotron(folder: str | Path, pattern: str, overrides: dict[str, Any], seed: int = 0):
    """Build, randomise and save a tiny NemotronHForCausalLM; returns the torch model (eval)."""
    import torch
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(seed)
    config = NemotronHConfig(**hf_config_dict(pattern, overrides))
    model = NemotronHForCausalLM(config).float().eval()
    _redraw_constants(model, seed + 1)
    model.save_pretrained(str(folder))
    return model
