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

from lazyspec.models import load_model, reference_logits
from tests.models.ragged import ragged_extend
from tests.models.tiny_qwen import TINY_CONFIGS, save_tiny_qwen

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.parity

TOL = 1e-4
SEQ_LEN = 150
ROW_LENGTHS = (150, 65, 64, 63, 1, 0)  # row r uses sequence r % 2; 0 = padding row


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def case(request, tmp_path_factory):
    """(our model, the two token sequences, transformers' logits [2, SEQ_LEN, vocab])."""
    folder = tmp_path_factory.mktemp(f"qwen_{request.param}")
    hf_model, _ = save_tiny_qwen(folder, request.param, seed=len(request.param))
    vocab = hf_model.config.vocab_size
    tokens = np.random.default_rng(17).integers(0, vocab, (2, SEQ_LEN))
    with torch.no_grad():
        want = hf_model(torch.tensor(tokens)).logits.numpy()
    return load_model(folder), tokens, want


def test_reference_logits_match_transformers(case):
    model, tokens, want = case
    for row in range(2):
        got = reference_logits(model, tokens[row])
        assert got.shape == want[row].shape
        assert _rel_err(got, want[row]) <= TOL


def test_ragged_extend_forward_matches_transformers(case):
    model, tokens, want = case
    # the padding row starts from a random state, which it must keep bit for bit
    logits, out, rec = ragged_extend(model, tokens, ROW_LENGTHS, SEQ_LEN, padding_state_seed=29)
    for r, n in enumerate(ROW_LENGTHS[:-1]):
        assert _rel_err(logits[r, :n], want[r % 2, :n]) <= TOL, f"row {r} ({n} tokens)"
    assert np.array_equal(out.final.ssm[:, -1], np.asarray(rec.ssm[:, -1]))
    assert np.array_equal(out.final.conv[:, -1], np.asarray(rec.conv[:, -1]))
    assert out.chunks.ssm.shape[2] == SEQ_LEN // 64
