"""``export_hf_folder``: params -> HF folder -> ``load_model`` is the identity.

Random tiny Qwen3-Next params (every leaf random, norms included) are exported and loaded
back: fp32 gives bit-identical params and logits (MoE + MTP head, and a dense model with
tied embeddings and no head); bf16 gives the bf16-rounded params. The tokenizer files and
the chat template are checked, malformed params raise ValueError, and transformers itself
loads the folder and computes the same logits (parity marker).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from lazyspec.models import load_model, qwen3_next, reference_logits
from lazyspec.testing.bpe import byte_level_bpe
from lazyspec.training.export import export_hf_folder
from tests.models.tiny_qwen import config_dict

VOCAB = 320
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def tokenizer():
    texts = ["def f(x):\n    return x + 1\n"] * 20 + ["import os\n"] * 20
    tok = byte_level_bpe(texts, VOCAB, SPECIALS)
    assert tok.get_vocab_size() <= VOCAB
    return tok


def _random_params(config: dict, seed: int, scale: float = 0.2):
    """Params of ``config`` with every leaf random (norm weights and gates too)."""
    cfg = qwen3_next.parse_config(config)
    params = qwen3_next.init_params(cfg, jax.random.key(seed), jnp.float32, scale=scale)
    rng = np.random.default_rng(seed)
    params = jax.tree.map(
        lambda p: p + 0.3 * rng.standard_normal(p.shape).astype(np.float32) if p.ndim == 1 else p,
        params,
    )
    return cfg, params


def _assert_trees_equal(got, want, cast=None):
    got_leaves, got_tree = jax.tree.flatten(got)
    want_leaves, want_tree = jax.tree.flatten(want)
    assert got_tree == want_tree
    for g, w in zip(got_leaves, want_leaves):
        w = np.asarray(w)
        if cast is not None:
            w = w.astype(cast).astype(np.float32)
        assert g.shape == w.shape and np.array_equal(np.asarray(g), w)


@pytest.mark.parametrize("name, with_mtp", [("moe", True), ("dense", False)])
def test_fp32_round_trip_is_exact(tmp_path, tokenizer, name, with_mtp):
    config = config_dict(
        name, vocab_size=VOCAB, num_nextn_predict_layers=int(with_mtp), eos_token_id=None
    )
    cfg, params = _random_params(config, seed=3)
    assert ("mtp" in params) == with_mtp and ("lm_head" in params) == (name == "moe")
    export_hf_folder(params, config, tokenizer, tmp_path, dtype="float32")
    model = load_model(tmp_path)
    assert model.has_mtp == with_mtp and model.config.num_mtp_layers == int(with_mtp)
    assert model.config.eos_token_ids == (tokenizer.token_to_id("<|endoftext|>"),)
    _assert_trees_equal(model.params, params)
    tokens = np.random.default_rng(5).integers(0, VOCAB, 70)
    want = np.asarray(
        jax.jit(
            lambda p, t: qwen3_next.compute_logits(p, cfg, qwen3_next.reference_forward(p, cfg, t))
        )(params, jnp.asarray(tokens[None]))
    )[0]
    got = reference_logits(model, tokens)
    assert np.array_equal(got, want) and np.std(want) > 0.1


def test_bf16_export_holds_the_rounded_params(tmp_path, tokenizer):
    config = config_dict("moe", vocab_size=VOCAB, num_nextn_predict_layers=1)
    _, params = _random_params(config, seed=4)
    export_hf_folder(params, config, tokenizer, tmp_path / "fp32", dtype="float32")
    export_hf_folder(params, config, tokenizer, tmp_path / "bf16")
    _assert_trees_equal(load_model(tmp_path / "bf16").params, params, cast=ml_dtypes.bfloat16)
    size = lambda d: (tmp_path / d / "model.safetensors").stat().st_size  # noqa: E731
    assert 0.45 < size("bf16") / size("fp32") < 0.55
    from safetensors import safe_open

    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), framework="np") as f:
        names = set(f.keys())
        assert f.get_tensor("mtp.fc.weight").dtype == ml_dtypes.bfloat16
    expected = {
        "mtp.layers.0.mlp.experts.3.down_proj.weight",
        "mtp.pre_fc_norm_hidden.weight",
        "model.layers.0.linear_attn.conv1d.weight",
        "model.layers.2.mlp.experts.0.up_proj.weight",
        "model.layers.3.self_attn.q_norm.weight",
        "lm_head.weight",
    }
    assert expected <= names
    assert not any("gate_up_proj" in n for n in names)  # per-expert layout only


def test_config_and_tokenizer_files(tmp_path, tokenizer):
    config = config_dict("dense", vocab_size=VOCAB, num_nextn_predict_layers=1)
    _, params = _random_params(config, seed=6)
    export_hf_folder(params, config, tokenizer, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "qwen3_next"
    assert written["architectures"] == ["Qwen3NextForCausalLM"]
    assert written["num_nextn_predict_layers"] == 1 and written["dtype"] == "bfloat16"
    assert written["eos_token_id"] == 2 and "max_position_embeddings" in written
    tok_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    eos = tokenizer.id_to_token(2)
    assert tok_config["eos_token"] == eos and tok_config["bos_token"] == eos
    import jinja2

    chat = jinja2.Template(tok_config["chat_template"]).render(
        messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    loaded = load_model(tmp_path).tokenizer
    text = "def f(x):\n    return os.path\n"
    assert loaded.encode(text).ids == tokenizer.encode(text).ids
    assert loaded.decode(loaded.encode(text).ids) == text


def test_malformed_params_raise(tmp_path, tokenizer):
    config = config_dict("moe", vocab_size=VOCAB, num_nextn_predict_layers=1)
    _, params = _random_params(config, seed=7)
    bad = jax.tree.map(lambda p: p, params)
    bad["layers"][3]["self_attn"]["o_proj"]["weight"] = jnp.zeros((5, 5))
    with pytest.raises(ValueError, match="model.layers.3.self_attn.o_proj.weight"):
        export_hf_folder(bad, config, tokenizer, tmp_path)
    bad = jax.tree.map(lambda p: p, params)
    del bad["layers"][0]["linear_attn"]["dt_bias"]
    with pytest.raises(ValueError, match="checkpoint plan"):
        export_hf_folder(bad, config, tokenizer, tmp_path)
    bad = jax.tree.map(lambda p: p, params)
    experts = bad["layers"][1]["mlp"]["experts"]
    experts["gate_proj"] = experts["gate_proj"][:3]
    with pytest.raises(ValueError, match="experts"):
        export_hf_folder(bad, config, tokenizer, tmp_path)
    with pytest.raises(ValueError, match="float16"):
        export_hf_folder(params, config, tokenizer, tmp_path, dtype="float16")


@pytest.mark.parity
def test_transformers_loads_the_exported_folder(tmp_path, tokenizer):
    torch = pytest.importorskip("torch")
    from transformers import AutoTokenizer, Qwen3NextForCausalLM

    config = config_dict("moe", vocab_size=VOCAB, num_nextn_predict_layers=1)
    _, params = _random_params(config, seed=8, scale=0.1)  # 0.2 amplifies fp32 noise past 1e-4
    export_hf_folder(params, config, tokenizer, tmp_path, dtype="float32")
    hf_model = Qwen3NextForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    tokens = np.random.default_rng(9).integers(0, VOCAB, 90)
    with torch.no_grad():
        want = hf_model(torch.tensor(tokens[None])).logits[0].numpy()
    got = reference_logits(load_model(tmp_path), tokens)
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) <= 1e-4
    hf_tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf_tokenizer.eos_token == tokenizer.id_to_token(2)  # the config's eos_token_id
    text = "def f(x):\n    return x\n"
    assert hf_tokenizer(text)["input_ids"] == tokenizer.encode(text).ids
