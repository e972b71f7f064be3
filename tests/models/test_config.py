"""Qwen3-Next config.json parsing: layer roles, MLP kinds, state shapes, rope, errors."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import pytest

from lazyspec.models.config import ATTENTION, RECURRENT
from lazyspec.models.qwen3_next import Qwen3NextArch
from lazyspec.models.registry import (
    FAMILIES,
    load_model_config,
    parse_hf_config,
    supported_architectures,
)
from lazyspec.testing.tiny_models import GRANITE_HF
from tests.models.tiny_qwen import config_dict


def _base(**overrides):
    config = config_dict("moe")
    config.update(overrides)
    return config


def test_roles_and_state_shapes_follow_layer_types():
    cfg = parse_hf_config(_base())
    assert cfg.family == "qwen3_next"
    assert cfg.layer_roles == (RECURRENT, RECURRENT, RECURRENT, ATTENTION)
    assert cfg.recurrent_layer_ids == (0, 1, 2) and cfg.attention_layer_ids == (3,)
    # GDN: Hk=2, Hv=4, d_k=8, d_v=16, K=4 -> conv_dim = 2*2*8 + 4*16
    assert cfg.conv_state_shape == (2 * 2 * 8 + 4 * 16, 3)
    assert cfg.ssm_state_shape == (4, 8, 16)
    assert (cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)
    assert isinstance(cfg.arch, Qwen3NextArch)
    assert cfg.arch.attention.rotary_dim == 4  # 16 * 0.25
    assert cfg.eos_token_ids == (2,)
    assert cfg.num_mtp_layers == 0 and not cfg.has_mtp


def test_interval_rule_when_layer_types_absent():
    config = _base(num_hidden_layers=6, full_attention_interval=3)
    del config["layer_types"]
    cfg = parse_hf_config(config)
    assert cfg.layer_roles == (RECURRENT, RECURRENT, ATTENTION) * 2
    del config["full_attention_interval"]  # transformers' default interval is 4
    config["num_hidden_layers"] = 5
    assert parse_hf_config(config).layer_roles == (RECURRENT,) * 3 + (ATTENTION, RECURRENT)


def test_mlp_kinds():
    lt = ["linear_attention"] * 6
    kinds = parse_hf_config(
        _base(num_hidden_layers=6, layer_types=lt, mlp_only_layers=[0, 4], decoder_sparse_step=2)
    ).arch.mlp_kinds
    assert kinds == ("dense", "moe", "dense", "moe", "dense", "moe")
    dense = parse_hf_config(_base(num_experts=0)).arch
    assert dense.mlp_kinds == ("dense",) * 4 and dense.moe is None
    assert dense.mtp_mlp_kind == "dense"
    moe = parse_hf_config(_base()).arch
    assert moe.moe.num_experts == 4 and moe.moe.top_k == 2 and moe.mtp_mlp_kind == "moe"


def test_rope_from_new_and_legacy_fields():
    cfg = parse_hf_config(
        _base(
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5e6,
                "partial_rotary_factor": 0.5,
            }
        )
    )
    assert cfg.arch.attention.rope_theta == 5e6 and cfg.arch.attention.rotary_dim == 8
    legacy = _base(rope_theta=1e7, partial_rotary_factor=0.25, rope_scaling=None)
    del legacy["rope_parameters"]
    cfg = parse_hf_config(legacy)
    assert cfg.arch.attention.rope_theta == 1e7 and cfg.arch.attention.rotary_dim == 4
    with pytest.raises(ValueError, match="yarn"):
        parse_hf_config(_base(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}))


def test_mtp_layers_from_config():
    assert parse_hf_config(_base(num_nextn_predict_layers=1)).num_mtp_layers == 1
    assert parse_hf_config(_base(num_nextn_predict_layers=None)).num_mtp_layers == 0


@pytest.mark.parametrize(
    "field",
    [
        "hidden_size",
        "num_key_value_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "num_experts",
        "vocab_size",
    ],
)
def test_missing_field_is_named(field):
    config = _base()
    del config[field]
    with pytest.raises(ValueError, match=field):
        parse_hf_config(config)


def test_moe_fields_required_only_with_experts():
    config = _base()
    del config["moe_intermediate_size"]
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        parse_hf_config(config)
    config["num_experts"] = 0
    assert parse_hf_config(config).arch.moe is None


def test_bad_values_raise():
    with pytest.raises(ValueError, match="layer_types"):
        parse_hf_config(_base(layer_types=["linear_attention", "sliding_attention"] * 2))
    with pytest.raises(ValueError, match="layer_types"):
        parse_hf_config(_base(layer_types=["linear_attention"] * 3))
    with pytest.raises(ValueError, match="hidden_act"):
        parse_hf_config(_base(hidden_act="gelu"))


def test_unknown_architecture(tmp_path):
    with pytest.raises(ValueError, match="llama") as error:
        parse_hf_config({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    for name in supported_architectures():
        assert name in str(error.value)
    # a known decoder under a head the engine does not run
    other_head = _base(architectures=["Qwen3NextForSequenceClassification"])
    with pytest.raises(ValueError, match="Qwen3NextForSequenceClassification") as error:
        parse_hf_config(other_head)
    assert "GraniteMoeHybridForCausalLM" in str(error.value)
    with pytest.raises(ValueError, match="architectures='Qwen3NextForCausalLM'"):
        parse_hf_config(_base(architectures="Qwen3NextForCausalLM"))
    # any architecture of the family is accepted, and a config may leave the field out
    granite = dict(GRANITE_HF, architectures=["LlamaForCausalLM", "GraniteMoeHybridForCausalLM"])
    assert parse_hf_config(granite).family == "granitemoehybrid"
    assert parse_hf_config({k: v for k, v in _base().items() if k != "architectures"})
    with pytest.raises(FileNotFoundError):
        load_model_config(tmp_path)


def test_readme_lists_every_supported_architecture():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme.split("| family (`model_type`) |", 1)[1].split("\n\n", 1)[0]
    for name in supported_architectures():
        assert f"`{name}`" in table, name
    for family in FAMILIES:
        assert f"| `{family}`" in table, family


def test_equal_configs_hash_and_compile_as_one():
    first, second = parse_hf_config(_base()), parse_hf_config(_base())
    other = parse_hf_config(_base(rms_norm_eps=1e-5))
    assert first is not second and first == second and hash(first) == hash(second)
    assert first != other

    @functools.partial(jax.jit, static_argnums=0)
    def scaled(cfg, x):
        return x * cfg.arch.rms_norm_eps

    scaled(first, 1.0)
    scaled(second, 1.0)
    assert scaled._cache_size() == 1
    scaled(other, 1.0)
    assert scaled._cache_size() == 2


def test_unhashable_config_is_rejected():
    cfg = parse_hf_config(_base())
    with pytest.raises(TypeError, match="hash by value"):
        dataclasses.replace(cfg, layer_roles=list(cfg.layer_roles))
