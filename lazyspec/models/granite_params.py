"""Granite 4.0-H parameters: the checkpoint plan of a GraniteMoeHybridForCausalLM, for loading
and init.

One plan (``plan.py``) names every tensor, its layout and its random init; ``load_params``
and ``init_params`` both read it. Names are those of released checkpoints, which
transformers' save_pretrained writes too (``block_sparse_moe.input_linear`` /
``output_linear`` / ``router.layer``, ``shared_mlp.input_linear`` / ``output_linear``).
Params as in ``granite``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lazyspec.models.config import RECURRENT, ModelConfig
from lazyspec.models.layers.attention import attention_plan
from lazyspec.models.layers.mamba2 import mamba2_plan
from lazyspec.models.layers.moe import ExpertStack
from lazyspec.models.plan import Params, Placement, TensorSpec, init_plan, linear_spec, load_plan


def _ffn_plan(cfg: ModelConfig, prefix: str) -> Params:
    """The shared MLP (fused ``input_linear``: gate then up) and, with experts, the MoE."""
    arch = cfg.arch  # granite.GraniteArch
    h, width = cfg.hidden_size, arch.shared_intermediate_size
    plan = {
        "shared_mlp": {
            # gate then up: an even shard of the fused columns mixes the two halves, so the
            # fused projection is a mixed layout (``mlp_fused``)
            "gate_up_proj": linear_spec(
                f"{prefix}.shared_mlp.input_linear", h, 2 * width, axes=("embed", "mlp_fused")
            ),
            "down_proj": linear_spec(
                f"{prefix}.shared_mlp.output_linear", width, h, axes=("mlp", "embed")
            ),
        }
    }
    if arch.moe is not None:
        moe, base = arch.moe, f"{prefix}.block_sparse_moe"
        fused = dict(gate_proj="input_linear", up_proj="input_linear", down_proj="output_linear")
        plan["block_sparse_moe"] = {
            "gate": TensorSpec(f"{base}.router.layer.weight", (moe.num_experts, h)),
            "experts": {
                proj: ExpertStack(
                    f"{base}.experts",
                    proj,
                    moe.num_experts,
                    h,
                    moe.intermediate_size,
                    fused_name=f"{base}.{name}.weight",
                )
                for proj, name in fused.items()
            },
        }
    return plan


def _layer_plan(cfg: ModelConfig, i: int, role: str) -> Params:
    arch = cfg.arch  # granite.GraniteArch
    prefix, h = f"model.layers.{i}", cfg.hidden_size
    plan = {
        "input_layernorm": TensorSpec(f"{prefix}.input_layernorm.weight", (h,), init="ones"),
        "post_attention_layernorm": TensorSpec(
            f"{prefix}.post_attention_layernorm.weight", (h,), init="ones"
        ),
        **_ffn_plan(cfg, prefix),
    }
    if role == RECURRENT:
        plan["mamba"] = mamba2_plan(
            f"{prefix}.mamba", arch.mamba, use_bias=arch.mamba_bias, use_conv_bias=arch.conv_bias
        )
    else:
        plan["self_attn"] = attention_plan(f"{prefix}.self_attn", h, arch.attention)
    return plan


def param_plan(cfg: ModelConfig) -> Params:
    """The checkpoint plan of the whole model; ``lm_head`` only when not tied (transformers
    ties it to the embedding and does not save it)."""
    h = cfg.hidden_size
    plan = {
        "embed_tokens": TensorSpec(
            "model.embed_tokens.weight", (cfg.vocab_size, h), axes=("vocab", "embed")
        ),
        "norm": TensorSpec("model.norm.weight", (h,), init="ones"),
        "layers": [_layer_plan(cfg, i, role) for i, role in enumerate(cfg.layer_roles)],
    }
    if not cfg.tie_word_embeddings:
        plan["lm_head"] = linear_spec("lm_head", h, cfg.vocab_size, axes=("embed", "vocab"))
    return plan


def weight_plan(cfg: ModelConfig, params: Params) -> Params:
    """The plan ``params`` were built from (its ``axes`` drive the shardings); reads only
    which top-level keys ``params`` has (``mtp``, ``lm_head``)."""
    return param_plan(cfg)


def load_params(
    cfg: ModelConfig, reader, dtype=jnp.float32, place: Placement | None = None
) -> Params:
    """Params from a ``SafetensorsReader`` over a folder written by GraniteMoeHybridForCausalLM
    (released checkpoints and ``save_pretrained`` share its names). A missing tensor raises
    ``MissingTensorError`` naming it; a misshapen one ValueError with both shapes."""
    return load_plan(param_plan(cfg), reader, dtype, place)


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> Params:
    """Random params (normal(0, scale) matrices, unit norms, Mamba2's A / dt / D inits)."""
    return init_plan(param_plan(cfg), key, dtype, scale)
