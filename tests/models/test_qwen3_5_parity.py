"""Parity with transformers' Qwen3.5 models (torch, CPU, fp32).

Each tiny config of ``tiny_qwen35.TINY_CONFIGS`` (dense, MoE, vision-language MoE) is built
with random weights, saved with save_pretrained and loaded through our loader. Two random
150-token sequences are scored by transformers in one batch; ours must match within
max|error| / max|logit| <= 1e-4 through (1) ``reference_logits``, (2) one ragged
extend-mode ``forward`` batch (as in ``test_qwen3_next_parity``) and (3) a chunked prefill
then token-by-token decode with carried state (``incremental_logits``).
"""

from __future__ import annotations

import logging

import pytest

from lazyspec.models import load_model
from lazyspec.models.model import incremental_logits
from tests.models.parity import check_reference_logits, ragged_extend, rel_err, transformers_case
from tests.models.test_qwen3_next_parity import ROW_LENGTHS, SEQ_LEN
from tests.models.tiny_qwen35 import TINY_CONFIGS, save_tiny_qwen35

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.parity

TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def case(request, tmp_path_factory):
    """(our model, the two token sequences, transformers' logits [2, SEQ_LEN, vocab])."""
    folder = tmp_path_factory.mktemp(f"qwen35_{request.param}")
    hf_model, _ = save_tiny_qwen35(folder, request.param, seed=len(request.param))
    vocab = hf_model.config.get_text_config().vocab_size
    return transformers_case(folder, hf_model, vocab, SEQ_LEN)


def test_reference_logits_match_transformers(case):
    assert case[0].config.family == "qwen3_5"
    check_reference_logits(*case, TOL)


def test_ragged_extend_forward_matches_transformers(case):
    model, tokens, want = case
    logits, _, _ = ragged_extend(model, tokens, ROW_LENGTHS, SEQ_LEN)
    for r, n in enumerate(ROW_LENGTHS[:-1]):
        assert rel_err(logits[r, :n], want[r % 2, :n]) <= TOL, f"row {r} ({n} tokens)"


def test_prefill_then_decode_matches_transformers(case):
    """65 prompt tokens in 64-token chunks, then 20 single-token decode steps."""
    model, tokens, want = case
    prompt_len, num_decode = 65, 20
    got = incremental_logits(
        model,
        tokens[0, :prompt_len],
        tokens[0, prompt_len : prompt_len + num_decode],
        64,
        bucket=128,
        context_len=128,
    )
    assert rel_err(got, want[0, : prompt_len + num_decode]) <= TOL


def test_vision_language_checkpoint_skips_the_vision_tower(tmp_path, caplog):
    save_tiny_qwen35(tmp_path, "vl_moe")
    with caplog.at_level(logging.INFO, logger="lazyspec.models.qwen3_5"):
        model = load_model(tmp_path)
    assert "skipping" in caplog.text and "model.visual." in caplog.text
    assert model.config.arch.moe is not None and not model.config.tie_word_embeddings
