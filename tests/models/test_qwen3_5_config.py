"""Qwen3.5 config.json parsing (text-only and vision-language, dense and MoE), its weight
plan, and the registry's answer for model types it does not know."""

from __future__ import annotations

import jax
import pytest

from lazyspec.models import qwen3_5
from lazyspec.models.config import ATTENTION, RECURRENT
from lazyspec.models.registry import parse_hf_config, supported_architectures
from lazyspec.testing.tiny_models import QWEN35_HF

TEXT = {k: v for k, v in QWEN35_HF.items() if k not in ("model_type", "mtp_num_hidden_layers")}


def _text(model_type: str, **overrides) -> dict:
    return dict(TEXT, model_type=model_type, **overrides)


def _vision_language(model_type: str, **text_overrides) -> dict:
    """A ``Qwen3_5[Moe]ForConditionalGeneration`` config: the text config nested, the outer
    config owning tie_word_embeddings."""
    text = _text(f"{model_type}_text", tie_word_embeddings=True, **text_overrides)
    del text["eos_token_id"]
    return {
        "model_type": model_type,
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "text_config": text,
        "vision_config": {"depth": 1, "hidden_size": 16},
        "tie_word_embeddings": False,
        "eos_token_id": 7,
    }


def test_text_configs_dense_and_moe():
    dense = parse_hf_config(_text("qwen3_5_text", intermediate_size=48))
    moe = parse_hf_config(_text("qwen3_5_moe_text", mtp_num_hidden_layers=1))
    for cfg in (dense, moe):
        assert cfg.family == "qwen3_5"
        assert cfg.layer_roles == (RECURRENT,) * 3 + (ATTENTION,)
        assert cfg.arch.gdn.split_projections
        assert cfg.arch.attention.rotary_dim == 4  # 16 * 0.25; mrope_section ignored for text
    assert dense.arch.mlp_kinds == ("dense",) * 4 and dense.arch.moe is None
    assert dense.arch.intermediate_size == 48 and dense.num_mtp_layers == 0
    assert moe.arch.mlp_kinds == ("moe",) * 4 and moe.arch.mtp_mlp_kind == "moe"
    assert moe.arch.moe.norm_topk_prob and moe.arch.moe.top_k == 2
    assert moe.num_mtp_layers == 1


def test_vision_language_config_reads_the_nested_text_config():
    cfg = parse_hf_config(_vision_language("qwen3_5_moe", mtp_num_hidden_layers=1))
    assert cfg.family == "qwen3_5" and cfg.arch.moe is not None and cfg.num_mtp_layers == 1
    assert not cfg.tie_word_embeddings  # the outer model owns the lm_head
    assert cfg.eos_token_ids == (7,)
    dense = parse_hf_config(_vision_language("qwen3_5", intermediate_size=48))
    assert dense.arch.moe is None and dense.arch.mlp_kinds == ("dense",) * 4


@pytest.mark.parametrize("field", ["num_experts", "moe_intermediate_size", "linear_key_head_dim"])
def test_missing_field_is_named(field):
    config = _text("qwen3_5_moe_text")
    del config[field]
    with pytest.raises(ValueError, match=field):
        parse_hf_config(config)


def test_wrong_model_type_and_rope_raise():
    with pytest.raises(ValueError, match="Qwen3.5 model_type"):
        qwen3_5.parse_config(_text("qwen3_next"))
    yarn = {"rope_type": "yarn", "rope_theta": 1e4}
    with pytest.raises(ValueError, match="yarn"):
        parse_hf_config(_text("qwen3_5_moe_text", rope_parameters=yarn))
    with pytest.raises(ValueError, match="mtp_use_dedicated_embeddings"):
        parse_hf_config(_text("qwen3_5_text", mtp_use_dedicated_embeddings=True))


def test_unknown_architecture_names_the_supported_ones():
    names = supported_architectures()
    for name in ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM"):
        assert name in names
    with pytest.raises(ValueError, match="llama") as error:
        parse_hf_config({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    assert "Qwen3_5MoeForCausalLM" in str(error.value)
    assert "NemotronHForCausalLM" in str(error.value)


def test_plan_uses_split_projections():
    cfg = parse_hf_config(_text("qwen3_5_moe_text", mtp_num_hidden_layers=1))
    params = qwen3_5.init_params(cfg, jax.random.key(0))
    gdn = params["layers"][0]["linear_attn"]
    assert sorted(k for k in gdn if k.startswith("in_proj")) == [
        "in_proj_a",
        "in_proj_b",
        "in_proj_qkv",
        "in_proj_z",
    ]
    assert gdn["in_proj_qkv"]["weight"].shape == (cfg.hidden_size, cfg.conv_dim)
    assert gdn["in_proj_z"]["weight"].shape == (cfg.hidden_size, cfg.ssm_heads * cfg.ssm_dim_b)
    assert "mtp" in params
