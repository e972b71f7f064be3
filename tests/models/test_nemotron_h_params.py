"""Nemotron-H's weight plan: random init and checkpoint loading agree leaf by leaf.

``init_params`` and ``load_params`` read one plan; these tests hold them to the same tree,
shapes and dtypes (float32-kept leaves included) on checkpoints saved by transformers, and
check that the other checkpoint layouts (fused experts, ``model.`` names, no lm_head) load
to the same params.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.models import nemotron_h
from lazyspec.models.loader import SafetensorsReader
from lazyspec.models.plan import DT_INIT_RANGE
from lazyspec.models.registry import load_model_config
from tests.models.tiny_nemotron import TINY_CONFIGS, hf_config_dict, save_tiny_nemotron

# Kept in float32 whatever the model dtype: the MoE router and its bias, Mamba2's decay terms.
FLOAT32_LEAVES = {"router", "router_bias", "dt_bias", "A_log", "D"}


def leaf_facts(params) -> tuple[object, dict[str, tuple[tuple[int, ...], str]]]:
    """(tree structure, path -> (shape, dtype name)) of a params tree."""
    leaves, treedef = jax.tree.flatten_with_path(params)
    facts = {jax.tree_util.keystr(p): (tuple(x.shape), jnp.dtype(x.dtype).name) for p, x in leaves}
    return treedef, facts


def float32_names(facts: dict[str, tuple[tuple[int, ...], str]]) -> set[str]:
    """The last key of every float32 leaf."""
    return {
        path.rsplit("['", 1)[1][:-2] for path, (_, dtype) in facts.items() if dtype == "float32"
    }


def test_init_keeps_float32_leaves_and_draws_mamba2_constants():
    pattern, overrides = TINY_CONFIGS["ME*M-"]
    cfg = nemotron_h.parse_config(hf_config_dict(pattern, overrides))
    params = nemotron_h.init_params(cfg, jax.random.key(0), jnp.bfloat16)
    _, facts = leaf_facts(params)
    assert float32_names(facts) == FLOAT32_LEAVES
    assert {dtype for _, dtype in facts.values()} == {"float32", "bfloat16"}
    mixer = params["layers"][0]["mixer"]
    dt = np.asarray(jax.nn.softplus(mixer["dt_bias"]))
    assert np.all(dt >= DT_INIT_RANGE[0] * 0.999) and np.all(dt <= DT_INIT_RANGE[1] * 1.001)
    a = np.exp(np.asarray(mixer["A_log"]))
    assert np.all(a >= 1.0) and np.all(a <= 16.0) and np.ptp(a) > 0
    np.testing.assert_array_equal(np.asarray(mixer["D"]), 1.0)
    big = nemotron_h.parse_config(hf_config_dict("M" * 16, dict(n_groups=1, hidden_size=256)))
    out_proj = nemotron_h.init_params(big, jax.random.key(1))["layers"][0]["mixer"]["out_proj"]
    assert np.std(np.asarray(out_proj["weight"])) == pytest.approx(0.02 / 4, rel=0.05)


@pytest.mark.parity
@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_init_and_load_agree_leaf_by_leaf(tmp_path, name):
    pattern, overrides = TINY_CONFIGS[name]
    save_tiny_nemotron(tmp_path, pattern, overrides)
    cfg = load_model_config(tmp_path)
    loaded = nemotron_h.load_params(cfg, SafetensorsReader(tmp_path), jnp.bfloat16)
    init = nemotron_h.init_params(cfg, jax.random.key(0), jnp.bfloat16)
    if cfg.tie_word_embeddings:  # transformers saves lm_head anyway, and loading keeps it
        assert "lm_head" not in init
        del loaded["lm_head"]
    loaded_tree, loaded_facts = leaf_facts(loaded)
    init_tree, init_facts = leaf_facts(init)
    assert init_tree == loaded_tree
    assert init_facts == loaded_facts
    expected = {"dt_bias", "A_log", "D"} | ({"router", "router_bias"} if "E" in pattern else set())
    assert float32_names(init_facts) == expected


@pytest.mark.parity
def test_checkpoint_layouts_load_alike(tmp_path):
    """Fused expert tensors, ``model.`` names and a missing (tied) lm_head all load."""
    from safetensors.numpy import load_file, save_file

    pattern, overrides = TINY_CONFIGS["ME*M-"]
    save_tiny_nemotron(tmp_path, pattern, overrides)
    cfg = load_model_config(tmp_path)
    want = nemotron_h.load_params(cfg, SafetensorsReader(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    experts = "backbone.layers.1.mixer.experts"
    changed = {k: v for k, v in tensors.items() if ".experts." not in k and k != "lm_head.weight"}
    for proj in ("up_proj", "down_proj"):
        num_experts = cfg.arch.moe.num_experts
        per_expert = [tensors[f"{experts}.{e}.{proj}.weight"] for e in range(num_experts)]
        changed[f"{experts}.{proj}"] = np.stack(per_expert)
    changed = {k.replace("backbone.", "model."): v for k, v in changed.items()}
    save_file(changed, str(tmp_path / "model.safetensors"))
    got = nemotron_h.load_params(cfg, SafetensorsReader(tmp_path))
    assert cfg.tie_word_embeddings and "lm_head" not in got
    del want["lm_head"]
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
