"""Loading Qwen3-Next checkpoints: tensor mapping, both expert layouts, MTP detection,
clear errors for missing / misshapen tensors, bf16 files and bf16 params. No torch."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from lazyspec.models import load_model, reference_logits
from lazyspec.models.model import incremental_logits
from tests.models.tiny_qwen import add_tensors, config_dict, write_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen_mtp")
    tensors = write_checkpoint(folder, config_dict("moe", num_nextn_predict_layers=1), seed=1)
    return folder, tensors


def test_tensors_land_where_the_math_expects(checkpoint):
    folder, tensors = checkpoint
    model = load_model(folder)
    p = model.params
    np.testing.assert_array_equal(p["embed_tokens"], tensors["model.embed_tokens.weight"])
    np.testing.assert_array_equal(p["lm_head"]["weight"], tensors["lm_head.weight"].T)
    attn = p["layers"][3]["self_attn"]
    np.testing.assert_array_equal(
        attn["q_proj"]["weight"], tensors["model.layers.3.self_attn.q_proj.weight"].T
    )
    np.testing.assert_array_equal(attn["k_norm"], tensors["model.layers.3.self_attn.k_norm.weight"])
    gdn = p["layers"][1]["linear_attn"]
    np.testing.assert_array_equal(
        gdn["conv1d"], tensors["model.layers.1.linear_attn.conv1d.weight"][:, 0]
    )
    np.testing.assert_array_equal(gdn["A_log"], tensors["model.layers.1.linear_attn.A_log"])
    experts = p["layers"][2]["mlp"]["experts"]
    for e in range(4):
        name = f"model.layers.2.mlp.experts.{e}"
        np.testing.assert_array_equal(experts["up_proj"][e], tensors[f"{name}.up_proj.weight"].T)
        np.testing.assert_array_equal(
            experts["down_proj"][e], tensors[f"{name}.down_proj.weight"].T
        )
    assert model.has_mtp and model.config.num_mtp_layers == 1
    np.testing.assert_array_equal(p["mtp"]["fc"]["weight"], tensors["mtp.fc.weight"].T)
    np.testing.assert_array_equal(
        p["mtp"]["layers"][0]["mlp"]["experts"]["gate_proj"][1],
        tensors["mtp.layers.0.mlp.experts.1.gate_proj.weight"].T,
    )


def test_fused_expert_layout_loads_the_same(checkpoint, tmp_path):
    folder, _ = checkpoint
    write_checkpoint(
        tmp_path, config_dict("moe", num_nextn_predict_layers=1), seed=1, fused_experts=True
    )
    fused, split = load_model(tmp_path), load_model(folder)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        for layer in (0, 3):
            np.testing.assert_array_equal(
                fused.params["layers"][layer]["mlp"]["experts"][proj],
                split.params["layers"][layer]["mlp"]["experts"][proj],
            )


def test_mtp_reported_only_when_present(tmp_path):
    declared = tmp_path / "declared_missing"
    tensors = write_checkpoint(declared, config_dict("dense", num_nextn_predict_layers=1))
    add_tensors(declared, {}, drop=tuple(k for k in tensors if k.startswith("mtp.")))
    model = load_model(declared)
    assert not model.has_mtp and model.config.num_mtp_layers == 0
    undeclared = tmp_path / "undeclared"
    write_checkpoint(undeclared, config_dict("dense", num_nextn_predict_layers=1))
    config = json.loads((undeclared / "config.json").read_text())
    del config["num_nextn_predict_layers"]
    (undeclared / "config.json").write_text(json.dumps(config))
    assert not load_model(undeclared).has_mtp
    assert "lm_head" not in model.params  # tied embeddings in the dense config


def test_missing_and_misshapen_tensors_are_named(tmp_path):
    name = "model.layers.1.linear_attn.in_proj_ba.weight"
    write_checkpoint(tmp_path, config_dict("moe"))
    add_tensors(tmp_path, {}, drop=(name,))
    with pytest.raises(
        ValueError,
        match=r"no tensor 'model\.layers\.1\.linear_attn\.in_proj_ba"
        r"\.weight' \(expected shape \(8, 32\)\)",
    ):
        load_model(tmp_path)
    add_tensors(tmp_path, {name: np.zeros((8, 31), np.float32)})
    with pytest.raises(
        ValueError,
        match=r"in_proj_ba\.weight' has shape \(8, 31\), "
        r"expected \(8, 32\)",
    ):
        load_model(tmp_path)
    add_tensors(
        tmp_path,
        {name: np.zeros((8, 32), np.float32)},
        drop=("model.layers.0.mlp.experts.3.down_proj.weight",),
    )
    with pytest.raises(ValueError, match=r"experts\.3\.down_proj\.weight"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="float16"):
        load_model(tmp_path, dtype="float16")


def test_bf16_file_and_bf16_params(tmp_path):
    tensors = write_checkpoint(tmp_path, config_dict("dense"), seed=4, dtype=ml_dtypes.bfloat16)
    fp32 = load_model(tmp_path)
    want = tensors["model.layers.0.self_attn.o_proj.weight"].astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(
        fp32.params["layers"][0]["self_attn"]["o_proj"]["weight"], want.astype(np.float32).T
    )
    bf16 = load_model(tmp_path, dtype="bfloat16")
    assert bf16.params["embed_tokens"].dtype == ml_dtypes.bfloat16
    tokens = np.random.default_rng(0).integers(0, 160, 40)
    ref = reference_logits(fp32, tokens)
    for got in (reference_logits(bf16, tokens), incremental_logits(bf16, tokens, [])):
        assert np.all(np.isfinite(got))
        # bf16 keeps ~3 significant digits; a wrong cast or layout would be far off
        assert np.max(np.abs(got - ref)) / np.max(np.abs(ref)) < 0.08
