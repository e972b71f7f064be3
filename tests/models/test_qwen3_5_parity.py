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

import numpy as np
import pytest

from lazyspec.models import load_model, reference_logits
from lazyspec.models.model import incremental_logits
from tests.models.ragged import ragged_extend
from tests.models.test_qwen3_next_parity import ROW_LENGTHS, SEQ_LEN, _rel_err
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
    tokens = np.random.default_rng(17).integers(0, vocab, (2, SEQ_LEN))
    with torch.no_grad():
        want = hf_model(input_ids=torch.tensor(tokens)).logits.numpy()
    return load_model(folder), tokens, want


def test_reference_logits_match_transformers(case):
    model, tokens, want = case
    assert model.config.family == "qwen3_5"
    for row in range(2):
        got = reference_logits(model, tokens[row])
        assert got.shape == want[row].shape
        assert _rel_err(got, want[row]) <= TOL


def test_ragged_extend_forward_matches_transformers(case):
    model, tokens, want = case
    logits, _, _ = ragged_extend(model, tokens, ROW_LENGTHS, SEQ_LEN)
    for r, n in enumerate(ROW_LENGTHS[:-1]):
        assert _rel_err(logits[r, :n], want[r % 2, :n]) <= TOL, f"row {r} ({n} tokens)"


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
    assert _rel_err(got, want[0, : prompt_len + num_decode]) <= TOL


def test_vision_language_checkpoint_skips_the_vision_tower(tmp_path, caplog):
    save_tiny_qwen35(tmp_path, "vl_moe")
    with caplog.at_level(logging.INFO, logger="lazyspec.models.qwen3_5"):
        model = load_model(tmp_path)
    assert "skipping" in caplog.text and "model.visual." in caplog.text
    assert model.config.arch.moe is not None and not model.config.tie_word_embeddings
