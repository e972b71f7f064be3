"""Tiny random Qwen3-Next configs and checkpoints for the model tests.

``save_tiny_qwen`` (needs torch + transformers) builds a Qwen3NextForCausalLM from a small
config with random weights, re-draws every parameter transformers initialises to a constant
(norm weights, dt_bias, A_log) so no term of the math is trivially 1 or 0, saves it with
save_pretrained and optionally adds an MTP head (``mtp.*`` tensors, per-expert layout, like
released checkpoints) to the file. ``config_dict`` / ``write_checkpoint`` need only numpy:
a config.json dict and a random safetensors file covering our checkpoint plan.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from lazyspec.testing.tiny_models import QWEN_HF

# The engine tests' tiny widths with a larger vocabulary, value heads and shared expert;
# each tiny config names its layers, rotary share and MTP head.
_PER_CONFIG = (
    "model_type",
    "num_hidden_layers",
    "layer_types",
    "max_position_embeddings",
    "num_nextn_predict_layers",
    "partial_rotary_factor",
    "rope_theta",
)
BASE: dict[str, Any] = dict(
    {k: v for k, v in QWEN_HF.items() if k not in _PER_CONFIG},
    vocab_size=160,
    linear_value_head_dim=16,
    shared_expert_intermediate_size=40,
    initializer_range=0.1,
)

LIN, FULL = "linear_attention", "full_attention"
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    # all-MoE, the released layout (3 GDN : 1 attention), partial rotary 1/4
    "moe": dict(num_hidden_layers=4, layer_types=[LIN, LIN, LIN, FULL]),
    # dense MLPs, attention first, one key head per value head, tied embeddings, rotary 1/2
    "dense": dict(
        num_hidden_layers=3,
        layer_types=[FULL, LIN, LIN],
        num_experts=0,
        linear_num_value_heads=2,
        tie_word_embeddings=True,
        partial_rotary_factor=0.5,
    ),
    # MoE except mlp_only_layers, roles from full_attention_interval, 2 v-heads per k-head
    "mixed": dict(num_hidden_layers=4, full_attention_interval=2, mlp_only_layers=[1]),
}


def hf_kwargs(name: str) -> dict[str, Any]:
    """Keyword arguments of Qwen3NextConfig for tiny config ``name``."""
    kwargs = dict(BASE)
    kwargs.update(TINY_CONFIGS[name])
    return kwargs


def build_hf_model(name: str, seed: int = 0):
    """A Qwen3NextForCausalLM (fp32, eval mode) with random weights and no constant tensors."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**hf_kwargs(name))).eval()
    redraw_constants(model, seed + 1)
    return model


def redraw_constants(model, seed: int) -> None:
    """Re-draw the params transformers initialises to constants (norm weights, dt_bias,
    A_log) so no term of the math is trivially 1 or 0. Mutates ``model``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "norm" in pname or pname.endswith("dt_bias"):
                param.add_(0.3 * torch.randn(param.shape, generator=gen))
            elif pname.endswith("A_log"):
                param.copy_(torch.empty(param.shape).uniform_(0.05, 4.0, generator=gen).log())


def mtp_tensors(model, seed: int) -> dict[str, np.ndarray]:
    """Random ``mtp.*`` tensors for ``model``: one attention decoder layer, MLP type of the
    model (per-expert names when it has experts), norms, fc over 2 * hidden."""
    cfg = model.config.get_text_config()
    num_experts = getattr(cfg, "num_experts", 0) or 0
    rng = np.random.default_rng(seed)
    h = cfg.hidden_size

    def mat(*shape: int) -> np.ndarray:
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)

    def norm(size: int) -> np.ndarray:
        return (0.3 * rng.standard_normal(size)).astype(np.float32)

    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    layer = "mtp.layers.0"
    out = {
        "mtp.fc.weight": mat(h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": norm(h),
        "mtp.pre_fc_norm_hidden.weight": norm(h),
        "mtp.norm.weight": norm(h),
        f"{layer}.input_layernorm.weight": norm(h),
        f"{layer}.post_attention_layernorm.weight": norm(h),
        f"{layer}.self_attn.q_proj.weight": mat(2 * q, h),
        f"{layer}.self_attn.k_proj.weight": mat(kv, h),
        f"{layer}.self_attn.v_proj.weight": mat(kv, h),
        f"{layer}.self_attn.o_proj.weight": mat(h, q),
        f"{layer}.self_attn.q_norm.weight": norm(cfg.head_dim),
        f"{layer}.self_attn.k_norm.weight": norm(cfg.head_dim),
    }
    if num_experts > 0:
        inter, shared = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        out[f"{layer}.mlp.gate.weight"] = mat(num_experts, h)
        out[f"{layer}.mlp.shared_expert_gate.weight"] = mat(1, h)
        for e in range(num_experts):
            out.update(_mlp_tensors(f"{layer}.mlp.experts.{e}", h, inter, mat))
        out.update(_mlp_tensors(f"{layer}.mlp.shared_expert", h, shared, mat))
    else:
        out.update(_mlp_tensors(f"{layer}.mlp", h, cfg.intermediate_size, mat))
    return out


def _mlp_tensors(prefix: str, hidden: int, inter: int, mat) -> dict[str, np.ndarray]:
    return {
        f"{prefix}.gate_proj.weight": mat(inter, hidden),
        f"{prefix}.up_proj.weight": mat(inter, hidden),
        f"{prefix}.down_proj.weight": mat(hidden, inter),
    }


def add_tensors(folder: Path, extra: dict[str, np.ndarray], drop: tuple[str, ...] = ()) -> None:
    """Rewrite ``folder/model.safetensors`` with ``extra`` added and ``drop`` removed."""
    from safetensors.numpy import load_file, save_file

    path = Path(folder) / "model.safetensors"
    tensors = {k: v for k, v in load_file(str(path)).items() if k not in drop}
    tensors.update(extra)
    save_file(tensors, str(path), metadata={"format": "pt"})


def save_tiny_qwen(folder: Path, name: str, seed: int = 0, with_mtp: bool = False):
    """Save tiny config ``name`` to ``folder``; returns (hf_model, mtp tensors or None).

    With ``with_mtp`` the config declares ``num_nextn_predict_layers = 1`` and the file
    holds the ``mtp.*`` tensors (transformers itself ignores both).
    """
    return save_with_mtp(
        folder, build_hf_model(name, seed), seed, with_mtp, "num_nextn_predict_layers"
    )


def save_with_mtp(folder: Path, model, seed: int, with_mtp: bool, mtp_field: str):
    """Save the transformers ``model`` to ``folder``; with ``with_mtp`` add random ``mtp.*``
    tensors to the file and declare one MTP layer as ``mtp_field`` of the (text) config.
    Returns (model, mtp tensors or None)."""
    import json

    model.save_pretrained(str(folder))
    if not with_mtp:
        return model, None
    extra = mtp_tensors(model, seed + 2)
    add_tensors(folder, extra)
    config_path = Path(folder) / "config.json"
    config = json.loads(config_path.read_text())
    config.get("text_config", config)[mtp_field] = 1
    config_path.write_text(json.dumps(config, indent=2))
    return model, extra


# ---------------------------------------------------------------- torch-free checkpoints


def config_dict(name: str, **overrides: Any) -> dict[str, Any]:
    """A complete config.json dict for tiny config ``name`` (what save_pretrained writes)."""
    config = hf_kwargs(name)
    config.update(overrides)
    layers = config["num_hidden_layers"]
    if "layer_types" not in config:
        interval = config.pop("full_attention_interval", 4)
        config["layer_types"] = [FULL if (i + 1) % interval == 0 else LIN for i in range(layers)]
    config["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": config.pop("partial_rotary_factor", 0.25),
    }
    config.update(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"])
    return config


def write_checkpoint(
    folder: Path,
    config: dict[str, Any],
    seed: int = 0,
    fused_experts: bool = False,
    dtype=np.float32,
) -> dict[str, np.ndarray]:
    """Write config.json and a random model.safetensors covering the config's plan (numpy
    only). Experts use per-expert names, or transformers' fused in-memory layout with
    ``fused_experts``. Returns the tensors written (float32 copies)."""
    import json

    import jax
    from safetensors.numpy import save_file

    from lazyspec.models.layers.moe import ExpertStack
    from lazyspec.models.qwen3_next import param_plan, parse_config

    cfg = parse_config(config)
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for leaf in jax.tree.leaves(param_plan(cfg, cfg.has_mtp), is_leaf=lambda n: hasattr(n, "load")):
        if isinstance(leaf, ExpertStack):
            out, inp = leaf._expert_shape()
            for e in range(leaf.num_experts):
                tensors[f"{leaf.prefix}.{e}.{leaf.proj}.weight"] = rng.standard_normal((out, inp))
        else:
            tensors[leaf.name] = 0.3 * rng.standard_normal(leaf.shape)
    tensors = {k: v.astype(np.float32) for k, v in tensors.items()}
    stored = (
        fuse_experts(tensors, cfg.arch.moe.num_experts if cfg.arch.moe else 0)
        if fused_experts
        else dict(tensors)
    )
    Path(folder).mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.astype(dtype) for k, v in stored.items()}, str(Path(folder) / "model.safetensors")
    )
    (Path(folder) / "config.json").write_text(json.dumps(config))
    return tensors


def fuse_experts(tensors: dict[str, np.ndarray], num_experts: int) -> dict[str, np.ndarray]:
    """Per-expert tensors -> ``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj``."""
    out = {k: v for k, v in tensors.items() if ".experts." not in k}
    prefixes = {k.split(".experts.")[0] for k in tensors if ".experts." in k}
    for p in sorted(prefixes):
        e_range = range(num_experts)
        gate = [tensors[f"{p}.experts.{e}.gate_proj.weight"] for e in e_range]
        up = [tensors[f"{p}.experts.{e}.up_proj.weight"] for e in e_range]
        out[f"{p}.experts.gate_up_proj"] = np.stack([np.concatenate(gu) for gu in zip(gate, up)])
        out[f"{p}.experts.down_proj"] = np.stack(
            [tensors[f"{p}.experts.{e}.down_proj.weight"] for e in e_range]
        )
    return out
