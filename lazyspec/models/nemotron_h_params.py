"""Nemotron-H parameters: random init and loading from a NemotronHForCausalLM checkpoint.

The attention, MLP and MoE blocks are described once as lists of tensors (their place in the
params tree, our layout, the checkpoint name and layout), which both init and load walk; the
Mamba2 mixers use ``layers/mamba2``'s own init and loader. Params as in ``nemotron_h``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from lazyspec.models.config import ModelConfig
from lazyspec.models.layers.mamba2 import init_mamba2_params, load_mamba2_params

if TYPE_CHECKING:
    from lazyspec.models.nemotron_h import NemotronHArch


@dataclass(frozen=True)
class _Tensor:
    """One parameter of an attention / MLP / MoE block: its place in params and checkpoint."""

    path: str  # "shared.up_proj.weight" -> params["shared"]["up_proj"]["weight"]
    shape: tuple[int, ...]  # our layout ([in, out] for linear weights)
    name: str  # checkpoint name under the mixer's prefix; "{e}" marks per-expert tensors
    transpose: bool = False  # the checkpoint holds the transpose (torch Linear layout)
    float32: bool = False  # kept in float32 whatever the model dtype


def _linear(path: str, name: str, fan_in: int, fan_out: int, bias: bool) -> list[_Tensor]:
    weight = _Tensor(f"{path}.weight", (fan_in, fan_out), f"{name}.weight", transpose=True)
    return [weight, _Tensor(f"{path}.bias", (fan_out,), f"{name}.bias")] if bias else [weight]


def _block_tensors(kind: str, arch: NemotronHArch, hidden: int) -> list[_Tensor]:
    """Every parameter of an "attention", "mlp" or "moe" block."""
    if kind == "attention":
        spec = arch.attention
        q_width, kv_width = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        widths = {
            "q_proj": (hidden, q_width),
            "k_proj": (hidden, kv_width),
            "v_proj": (hidden, kv_width),
            "o_proj": (q_width, hidden),
        }
        return [t for name, (i, o) in widths.items() for t in _linear(name, name, i, o, False)]
    bias = arch.mlp_bias
    if kind == "mlp":
        width = arch.intermediate_size
        return _linear("up_proj", "up_proj", hidden, width, bias) + _linear(
            "down_proj", "down_proj", width, hidden, bias
        )
    spec = arch.moe
    experts, inner, width = spec.num_experts, spec.latent_size or hidden, spec.intermediate_size
    shared = spec.shared_intermediate_size
    tensors = [
        _Tensor("router", (hidden, experts), "gate.weight", transpose=True, float32=True),
        _Tensor("router_bias", (experts,), "gate.e_score_correction_bias", float32=True),
        _Tensor("experts_up", (experts, inner, width), "experts.{e}.up_proj.weight", True),
        _Tensor("experts_down", (experts, width, inner), "experts.{e}.down_proj.weight", True),
        *_linear("shared.up_proj", "shared_experts.up_proj", hidden, shared, bias),
        *_linear("shared.down_proj", "shared_experts.down_proj", shared, hidden, bias),
    ]
    if spec.latent_size:
        tensors += _linear("latent_in", "fc1_latent_proj", hidden, inner, bias)
        tensors += _linear("latent_out", "fc2_latent_proj", inner, hidden, bias)
    return tensors


def _nest(values: dict[str, jax.Array]) -> dict:
    """{"a.b.weight": w} -> {"a": {"b": {"weight": w}}}."""
    tree: dict = {}
    for path, value in values.items():
        *outer, last = path.split(".")
        node = tree
        for part in outer:
            node = node.setdefault(part, {})
        node[last] = value
    return tree


def _init_block(tensors: list[_Tensor], key: jax.Array, dtype) -> dict:
    """normal(0.02) matrices, zero vectors (biases, router bias)."""
    values = {}
    for k, t in zip(jax.random.split(key, len(tensors)), tensors):
        t_dtype = jnp.float32 if t.float32 else dtype
        values[t.path] = (
            0.02 * jax.random.normal(k, t.shape, t_dtype)
            if len(t.shape) > 1
            else jnp.zeros(t.shape, t_dtype)
        )
    return _nest(values)


def _read(reader, prefix: str, t: _Tensor):
    """One tensor in our layout; experts stacked from per-expert or fused checkpoint tensors."""
    if "{e}" not in t.name:
        shape = t.shape[::-1] if t.transpose else t.shape
        array = reader.get(prefix + t.name, shape)
        return array.T if t.transpose else array
    experts, fan_in, fan_out = t.shape
    fused = prefix + t.name.replace(".{e}", "").removesuffix(".weight")
    if fused in reader:
        return reader.get(fused, (experts, fan_out, fan_in)).transpose(0, 2, 1)
    return jnp.stack(
        [reader.get(prefix + t.name.format(e=e), (fan_out, fan_in)).T for e in range(experts)]
    )


def _load_block(tensors: list[_Tensor], reader, prefix: str, dtype) -> dict:
    return _nest(
        {
            t.path: jnp.asarray(_read(reader, prefix, t), jnp.float32 if t.float32 else dtype)
            for t in tensors
        }
    )


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random params for ``cfg`` (normal(0.02) matrices, unit norms); for training and tests."""
    return _init_params(cfg, key, jnp.dtype(dtype))


@partial(jax.jit, static_argnums=(0, 2))  # one compile instead of one per eager random op
def _init_params(cfg: ModelConfig, key: jax.Array, dtype) -> dict:
    arch: NemotronHArch = cfg.arch
    keys = jax.random.split(key, cfg.num_layers + 2)
    layers = []
    for i, kind in enumerate(arch.block_kinds):
        if kind == "mamba":
            mixer = init_mamba2_params(
                arch.mamba,
                keys[i],
                dtype,
                use_bias=arch.mamba_bias,
                use_conv_bias=arch.conv_bias,
                out_scale=cfg.num_layers**-0.5,
            )
        else:
            mixer = _init_block(_block_tensors(kind, arch, cfg.hidden_size), keys[i], dtype)
        layers.append({"norm": jnp.ones((cfg.hidden_size,), dtype), "mixer": mixer})
    params = {
        "embed_tokens": 0.02
        * jax.random.normal(keys[-2], (cfg.vocab_size, cfg.hidden_size), dtype),
        "norm": jnp.ones((cfg.hidden_size,), dtype),
        "layers": layers,
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = {
            "weight": 0.02 * jax.random.normal(keys[-1], (cfg.hidden_size, cfg.vocab_size), dtype)
        }
    return params


def load_params(cfg: ModelConfig, reader, dtype=jnp.float32) -> dict:
    """Params from a ``SafetensorsReader`` over a folder written by NemotronHForCausalLM.

    Tensor names are transformers' (``backbone.*``; ``model.*`` is accepted too). A missing
    tensor raises KeyError naming it; a misshapen one ValueError naming it and both shapes.
    """
    arch: NemotronHArch = cfg.arch
    root = "backbone." if "backbone.embeddings.weight" in reader else "model."
    hidden = cfg.hidden_size

    def get(name, shape):
        return jnp.asarray(reader.get(name, shape), dtype)

    layers = []
    for i, kind in enumerate(arch.block_kinds):
        prefix = f"{root}layers.{i}.mixer."
        if kind == "mamba":
            mixer = load_mamba2_params(
                arch.mamba,
                reader.get,
                prefix,
                dtype,
                use_bias=arch.mamba_bias,
                use_conv_bias=arch.conv_bias,
            )
        else:
            mixer = _load_block(_block_tensors(kind, arch, hidden), reader, prefix, dtype)
        layers.append({"norm": get(f"{root}layers.{i}.norm.weight", (hidden,)), "mixer": mixer})
    params = {
        "embed_tokens": get(root + "embeddings.weight", (cfg.vocab_size, hidden)),
        "norm": get(root + "norm_f.weight", (hidden,)),
        "layers": layers,
    }
    # transformers' NemotronHForCausalLM never ties lm_head (its tied-keys map is empty) and
    # saves it even with tie_word_embeddings; only a checkpoint without it reuses the embedding.
    if "lm_head.weight" in reader or not cfg.tie_word_embeddings:
        params["lm_head"] = {"weight": get("lm_head.weight", (cfg.vocab_size, hidden)).T}
    return params
