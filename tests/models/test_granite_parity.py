"""Granite 4.0-H against transformers' GraniteMoeHybridForCausalLM (torch, CPU, fp32), and
carried state against the full forward.

Each tiny config (``tiny_granite.TINY_CONFIGS``: MoE without positional embedding, RoPE with
biases and a dt clamp, dense) is saved by save_pretrained and loaded through ``load_model``
(registry, parser, SafetensorsReader). Logits are compared as max |ours - theirs| /
max |theirs| <= 1e-4 through (1) ``reference_logits``, (2) one ragged extend batch with a
padding row, (3) extend in two pieces, decode steps and a verify window with carried KV and
state (the RoPE config only, to keep the run short).
"""

from __future__ import annotations

import json
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.models import granite
from lazyspec.models.config import ATTENTION, RECURRENT
from lazyspec.models.model import empty_caches, single_row_inputs
from lazyspec.models.registry import parse_hf_config
from tests.models.parity import check_reference_logits, ragged_extend, rel_err, transformers_case
from tests.models.tiny_granite import TINY_CONFIGS, hf_config_dict, save_tiny_granite

TOL = 1e-4
SEQ_LEN = 150
ROW_LENGTHS = (150, 97, 64, 1, 0)  # row r uses sequence r % 2; 0 = padding row
CONTEXT = 160


@pytest.fixture(scope="module", params=list(TINY_CONFIGS))
def case(request, tmp_path_factory):
    """(our model, two token sequences, transformers' logits [2, SEQ_LEN, vocab])."""
    pytest.importorskip("torch")
    pattern, overrides = TINY_CONFIGS[request.param]
    folder = tmp_path_factory.mktemp(f"granite_{request.param}")
    hf_model = save_tiny_granite(folder, pattern, overrides, seed=len(pattern))
    return transformers_case(folder, hf_model, hf_model.config.vocab_size, SEQ_LEN)


@partial(jax.jit, static_argnames=("cfg", "mode"))
def _forward_logits(params, cfg, inputs, kv, rec, mode):
    hidden, kv, out = granite.forward(params, cfg, inputs, kv, rec, mode=mode)
    return granite.compute_logits(params, cfg, hidden), kv, out


@pytest.mark.parity
def test_reference_logits_match_transformers(case):
    assert np.std(case[2]) > 0.1  # logits are not trivially flat
    check_reference_logits(*case, TOL)


@pytest.mark.parity
def test_ragged_extend_forward_matches_transformers(case):
    model, tokens, want = case
    cfg = model.config
    # the padding row keeps its random state bit for bit
    logits, out, rec = ragged_extend(model, tokens, ROW_LENGTHS, SEQ_LEN, padding_state_seed=29)
    for r, n in enumerate(ROW_LENGTHS[:-1]):
        assert rel_err(logits[r, :n], want[r % 2, :n]) <= TOL, f"row {r} ({n} tokens)"
    np.testing.assert_array_equal(out.final.ssm[:, -1], rec.ssm[:, -1])
    np.testing.assert_array_equal(out.final.conv[:, -1], rec.conv[:, -1])
    assert out.chunks.ssm.shape[:3] == (len(cfg.recurrent_layer_ids), len(ROW_LENGTHS), 2)


@pytest.mark.parity
@pytest.mark.parametrize("case", ["MM*M*"], indirect=True)  # RoPE: positions must carry over
def test_extend_decode_verify_with_carried_state_match_transformers(case):
    """Extend 70 tokens in two padded pieces, decode 12 one at a time, verify 4: every
    position's logits equal transformers' full forward."""
    model, tokens, want = case
    cfg, seq = model.config, tokens[1]
    kv, rec = empty_caches(cfg, CONTEXT + 1, 1, jnp.float32)
    calls = [(0, 40, "extend", 64), (40, 70, "extend", 64)]
    calls += [(s, s + 1, "decode", None) for s in range(70, 82)] + [(82, 86, "verify", None)]
    got = []
    for start, end, mode, bucket in calls:
        inputs = single_row_inputs(
            seq[start:end], start, CONTEXT, bucket=bucket, vocab_size=cfg.vocab_size
        )
        logits, kv, out = _forward_logits(model.params, cfg, inputs, kv, rec, mode)
        rec = out.final
        got.append(np.asarray(logits[0, : end - start]))
    assert rel_err(np.concatenate(got), want[1, :86]) <= TOL
    steps = np.stack(out.steps.ssm)  # the verify's state after its last token is the final
    np.testing.assert_allclose(steps[:, 0, -1], np.asarray(out.final.ssm[:, 0]), atol=1e-7)


def test_parse_config_roles_shapes_and_errors():
    hf = dict(hf_config_dict("M*M", dict(mamba_n_groups=2)), model_type="granitemoehybrid")
    cfg = parse_hf_config(hf)
    assert cfg.family == "granitemoehybrid" and not cfg.has_mtp
    assert cfg.layer_roles == (RECURRENT, ATTENTION, RECURRENT)
    assert cfg.ssm_state_shape == (4, 16, 16)
    assert cfg.conv_state_shape == (4 * 16 + 2 * 2 * 16, 3)
    assert cfg.arch.attention.scale == 0.125 and cfg.arch.attention.rotary_dim == 0
    assert cfg.arch.moe.num_experts == 4
    current = dict(hf, layer_types=["linear_attention", "full_attention", "linear_attention"])
    assert parse_hf_config(current) == cfg
    auto = dict(hf, mamba_d_head="auto", time_step_limit=[0.0, {"__float__": "Infinity"}])
    assert parse_hf_config(json.loads(json.dumps(auto))) == cfg  # as save_pretrained writes it
    assert parse_hf_config(dict(hf, num_local_experts=0)).arch.moe is None
    for field in ("mamba_d_state", "hidden_size", "num_local_experts"):
        with pytest.raises(ValueError, match=field):
            parse_hf_config({k: v for k, v in hf.items() if k != field})
    with pytest.raises(ValueError, match="mamba_d_head"):
        parse_hf_config(dict(hf, mamba_d_head=8))
    with pytest.raises(ValueError, match="position_embedding_type"):
        parse_hf_config(dict(hf, position_embedding_type="alibi"))
    with pytest.raises(ValueError, match="GraniteMoeHybridForCausalLM"):
        parse_hf_config(dict(hf, model_type="granitemoe"))  # names the supported ones
