"""Write Qwen3-Next params as a Hugging Face model folder that ``load_model`` reads back.

The tensor names and layouts are the exact inverse of ``qwen3_next.param_plan``: linear
weights are transposed back to PyTorch's ``[out, in]``, the conv taps regain their middle
axis, and expert stacks ``[E, in, out]`` are split into per-expert tensors
``...experts.{e}.{proj}.weight`` (the layout of released checkpoints and of transformers'
``save_pretrained``), ``mtp.*`` included. The folder holds ``config.json``,
``model.safetensors``, ``generation_config.json``, ``tokenizer.json`` and
``tokenizer_config.json`` (eos / bos tokens and a small ChatML-style chat template).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from lazyspec.models.layers.moe import ExpertStack
from lazyspec.models.plan import Params, TensorSpec
from lazyspec.models.qwen3_next import param_plan, parse_config

EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _is_plan_leaf(node: Any) -> bool:
    return isinstance(node, (TensorSpec, ExpertStack))


def _param_shape(spec: TensorSpec) -> tuple[int, ...]:
    """The param shape ``TensorSpec.load`` produces from the checkpoint shape."""
    shape = tuple(reversed(spec.shape)) if spec.transpose else tuple(spec.shape)
    return tuple(spec.reshape) if spec.reshape is not None else shape


def _tensor_to_checkpoint(spec: TensorSpec, param: np.ndarray) -> dict[str, np.ndarray]:
    """Undo ``TensorSpec.load``: reshape back, then transpose back."""
    if param.shape != _param_shape(spec):
        raise ValueError(
            f"param for {spec.name!r} has shape {param.shape}, expected {_param_shape(spec)}"
        )
    stored = tuple(reversed(spec.shape)) if spec.transpose else tuple(spec.shape)
    array = param.reshape(stored)
    return {spec.name: np.ascontiguousarray(array.T if spec.transpose else array)}


def _experts_to_checkpoint(stack: ExpertStack, param: np.ndarray) -> dict[str, np.ndarray]:
    """``[E, in, out]`` -> one ``[out, in]`` tensor per expert."""
    h, i = stack.hidden_size, stack.intermediate_size
    inner = (i, h) if stack.proj == "down_proj" else (h, i)
    if param.shape != (stack.num_experts, *inner):
        raise ValueError(
            f"param for {stack.prefix}.*.{stack.proj} has shape {param.shape}, "
            f"expected {(stack.num_experts, *inner)}"
        )
    return {
        f"{stack.prefix}.{e}.{stack.proj}.weight": np.ascontiguousarray(param[e].T)
        for e in range(stack.num_experts)
    }


def checkpoint_tensors(params: Params, plan: Params) -> dict[str, np.ndarray]:
    """HF tensor name -> float32 array for every param, following ``plan``.

    ValueError when the params tree does not have the plan's structure or a shape differs.
    """
    plan_leaves, plan_tree = jax.tree.flatten(plan, is_leaf=_is_plan_leaf)
    param_leaves, param_tree = jax.tree.flatten(params)
    if plan_tree != param_tree:
        raise ValueError(
            f"params do not match the config's checkpoint plan:\n"
            f"params {param_tree}\nplan   {plan_tree}"
        )
    tensors: dict[str, np.ndarray] = {}
    for spec, param in zip(plan_leaves, param_leaves):
        array = np.asarray(jax.device_get(param), dtype=np.float32)
        if isinstance(spec, ExpertStack):
            tensors.update(_experts_to_checkpoint(spec, array))
        else:
            tensors.update(_tensor_to_checkpoint(spec, array))
    return tensors


def _full_config(params: Params, cfg_hf: dict[str, Any], tokenizer, dtype: str) -> dict:
    """``cfg_hf`` plus the fields every exported folder carries."""
    config = dict(cfg_hf)
    config.update(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], dtype=dtype)
    config["num_nextn_predict_layers"] = len(params["mtp"]["layers"]) if "mtp" in params else 0
    if config.get("eos_token_id") is None:
        eos_id = tokenizer.token_to_id("<|endoftext|>")
        if eos_id is None:
            raise ValueError(
                "cfg_hf_dict has no eos_token_id and the tokenizer has no <|endoftext|> token"
            )
        config["eos_token_id"] = eos_id
    config.setdefault("bos_token_id", config["eos_token_id"])
    config.setdefault("max_position_embeddings", 4096)
    return config


def _first_id(value: Any) -> int:
    return int(value[0]) if isinstance(value, (list, tuple)) else int(value)


def _tokenizer_config(tokenizer, config: dict, chat_template: str) -> dict:
    eos = tokenizer.id_to_token(_first_id(config["eos_token_id"]))
    bos = tokenizer.id_to_token(_first_id(config["bos_token_id"]))
    if eos is None or bos is None:
        raise ValueError(
            f"eos_token_id={config['eos_token_id']} / bos_token_id="
            f"{config['bos_token_id']} are not in the tokenizer's vocabulary"
        )
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": eos,
        "unk_token": None,
        "chat_template": chat_template,
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }


def export_hf_folder(
    params: Params,
    cfg_hf_dict: dict[str, Any],
    tokenizer,
    out_dir: str | Path,
    dtype: str = "bfloat16",
    chat_template: str = CHAT_TEMPLATE,
) -> Path:
    """Write ``params`` (a qwen3_next params tree, MTP head optional) as a HF folder.

    ``cfg_hf_dict`` is the model's config.json dict (model_type, architectures and
    ``num_nextn_predict_layers`` are set here); ``tokenizer`` a ``tokenizers.Tokenizer``.
    Tensors are written in ``dtype`` ("float32" or "bfloat16"). Creates ``out_dir`` if
    needed, overwrites the files it writes and returns the folder's path.
    """
    from safetensors.numpy import save_file

    if dtype not in EXPORT_DTYPES:
        raise ValueError(
            f"unsupported export dtype {dtype!r}; expected one of {sorted(EXPORT_DTYPES)}"
        )
    config = _full_config(params, cfg_hf_dict, tokenizer, dtype)
    cfg = parse_config(config)
    tensors = checkpoint_tensors(params, param_plan(cfg, "mtp" in params))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.astype(EXPORT_DTYPES[dtype]) for k, v in tensors.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id")}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer.save(str(out / "tokenizer.json"))
    tok_config = _tokenizer_config(tokenizer, config, chat_template)
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return out
