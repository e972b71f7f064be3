"""Parity with transformers' Qwen3NextForCausalLM (torch, CPU, fp32).

Each tiny config (see ``tiny_qwen.TINY_CONFIGS``) is built with random weights, saved with
save_pretrained and loaded through our loader. Two random 150-token sequences (three
64-token chunks, the last partial) are scored by transformers in one batch; ours must match
within max|error| / max|logit| <= 1e-4 through (1) ``reference_logits`` (scan mixers, dense
attention, no cache) and (2) one ragged extend-mode ``forward`` batch whose rows hold 150,
65, 64, 63 and 1 tokens plus a padding row.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.models.parity import check_reference_logits, ragged_extend, rel_err, transformers_case
from tests.models.tiny_qwen import TINY_CONFIGS, save_tiny_qwen

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.parity

TOL = 1e-4
SEQ_LEN = 150
ROW_LENGTHS = (150, 65, 64, 63, 1, 0)  # row r uses sequence r % 2; 0 = padding row


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def case(request, tmp_path_factory):
    """(our model, the two token sequences, transformers' logits [2, SEQ_LEN, vocab])."""
    folder = tmp_path_factory.mktemp(f"qwen_{request.param}")
    hf_model, _ = save_tiny_qwen(folder, request.param, seed=len(request.param))
    return transformers_case(folder, hf_model, hf_model.config.vocab_size, SEQ_LEN)


def test_reference_logits_match_transformers(case):
    check_reference_logits(*case, TOL)


def test_ragged_extend_forward_matches_transformers(case):
    model, tokens, want = case
    # the padding row starts from a random state, which it must keep bit for bit
    logits, out, rec = ragged_extend(model, tokens, ROW_LENGTHS, SEQ_LEN, padding_state_seed=29)
    for r, n in enumerate(ROW_LENGTHS[:-1]):
        assert rel_err(logits[r, :n], want[r % 2, :n]) <= TOL, f"row {r} ({n} tokens)"
    assert np.array_equal(out.final.ssm[:, -1], np.asarray(rec.ssm[:, -1]))
    assert np.array_equal(out.final.conv[:, -1], np.asarray(rec.conv[:, -1]))
    assert out.chunks.ssm.shape[2] == SEQ_LEN // 64
