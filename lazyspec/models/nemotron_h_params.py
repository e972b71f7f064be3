"""Nemotron-H parameters: the checkpoint plan of a NemotronHForCausalLM, for loading and init.

One plan (``plan.py``) names every tensor, its layout and its random init; ``load_params``
and ``init_params`` both read it. Params as in ``nemotron_h``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lazyspec.models.config import ModelConfig
from lazyspec.models.layers.attention import attention_plan
from lazyspec.models.layers.mamba2 import mamba2_plan
from lazyspec.models.layers.relu2_moe import moe_plan, relu2_mlp_plan
from lazyspec.models.plan import Params, Placement, TensorSpec, init_plan, linear_spec, load_plan


def _mixer_plan(cfg: ModelConfig, kind: str, prefix: str) -> Params:
    """Plan of one block's mixer ("mamba", "attention", "mlp" or "moe") under ``prefix``."""
    arch, hidden = cfg.arch, cfg.hidden_size
    if kind == "mamba":
        return mamba2_plan(
            prefix,
            arch.mamba,
            use_bias=arch.mamba_bias,
            use_conv_bias=arch.conv_bias,
            out_scale=cfg.num_layers**-0.5,
        )
    if kind == "attention":
        return attention_plan(prefix, hidden, arch.attention)
    if kind == "mlp":
        return relu2_mlp_plan(prefix, hidden, arch.intermediate_size, arch.mlp_bias)
    return moe_plan(prefix, hidden, arch.moe, arch.mlp_bias)


def param_plan(cfg: ModelConfig, root: str = "backbone", with_lm_head: bool = True) -> Params:
    """The checkpoint plan of the whole model, tensors under ``root`` ("backbone" or
    "model"); ``lm_head`` only when ``with_lm_head``."""
    hidden = cfg.hidden_size
    layers = [
        {
            "norm": TensorSpec(f"{root}.layers.{i}.norm.weight", (hidden,), init="ones"),
            "mixer": _mixer_plan(cfg, kind, f"{root}.layers.{i}.mixer"),
        }
        for i, kind in enumerate(cfg.arch.block_kinds)
    ]
    plan = {
        "embed_tokens": TensorSpec(
            f"{root}.embeddings.weight", (cfg.vocab_size, hidden), axes=("vocab", "embed")
        ),
        "norm": TensorSpec(f"{root}.norm_f.weight", (hidden,), init="ones"),
        "layers": layers,
    }
    if with_lm_head:
        plan["lm_head"] = linear_spec("lm_head", hidden, cfg.vocab_size, axes=("embed", "vocab"))
    return plan


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> Params:
    """Random params for ``cfg`` (normal(0.02) matrices, unit norms); for training and tests."""
    return init_plan(param_plan(cfg, with_lm_head=not cfg.tie_word_embeddings), key, dtype)


def weight_plan(cfg: ModelConfig, params: Params) -> Params:
    """The plan ``params`` were built from (its ``axes`` drive the shardings); reads only
    which top-level keys ``params`` has (``mtp``, ``lm_head``)."""
    return param_plan(cfg, with_lm_head="lm_head" in params)


def load_params(
    cfg: ModelConfig, reader, dtype=jnp.float32, place: Placement | None = None
) -> Params:
    """Params from a ``SafetensorsReader`` over a folder written by NemotronHForCausalLM.

    Tensor names are transformers' (``backbone.*``; ``model.*`` is accepted too). A missing
    tensor raises ``MissingTensorError`` (a KeyError and a ValueError) naming it; a
    misshapen one ValueError naming it and both shapes.
    """
    root = "backbone" if "backbone.embeddings.weight" in reader else "model"
    # transformers' NemotronHForCausalLM never ties lm_head (its tied-keys map is empty) and
    # saves it even with tie_word_embeddings; only a checkpoint without it reuses the embedding.
    with_lm_head = "lm_head.weight" in reader or not cfg.tie_word_embeddings
    return load_plan(param_plan(cfg, root, with_lm_head), reader, dtype, place)
