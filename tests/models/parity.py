"""What the parity tests against transformers share: the two random sequences and
transformers' logits of them, the reference check, and the ragged extend batch (rows of
different lengths over the two sequences, each row in a KV block of its own, padding slots
and a padding row)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lazyspec.models import load_model, reference_logits
from lazyspec.models.interface import ForwardInputs
from lazyspec.models.model import empty_caches


def rel_err(got, want) -> float:
    """max |got - want| / max |want|, in float64."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def transformers_case(folder: Path, hf_model: Any, vocab: int, seq_len: int) -> tuple:
    """(our model loaded from ``folder``, two random token sequences [2, seq_len],
    ``hf_model``'s logits of them [2, seq_len, vocab])."""
    import torch

    tokens = np.random.default_rng(17).integers(0, vocab, (2, seq_len))
    with torch.no_grad():
        want = hf_model(input_ids=torch.tensor(tokens)).logits.numpy()
    return load_model(folder), tokens, want


def check_reference_logits(model: Any, tokens: np.ndarray, want: np.ndarray, tol: float) -> None:
    """``reference_logits`` of each sequence matches ``want``'s within ``tol``."""
    for row in range(2):
        got = reference_logits(model, tokens[row])
        assert got.shape == want[row].shape
        assert rel_err(got, want[row]) <= tol


def ragged_inputs(
    tokens: np.ndarray, vocab: int, row_lengths: Sequence[int], seq_len: int
) -> ForwardInputs:
    """One extend batch of ``seq_len`` columns: row r holds the first ``row_lengths[r]``
    tokens of sequence ``tokens[r % 2]`` (0: a padding row) and owns the KV rows
    ``1 + r * seq_len + position``; padding slots carry random token ids and write no KV."""
    rng = np.random.default_rng(23)
    num_rows = len(row_lengths)
    batch = rng.integers(0, vocab, (num_rows, seq_len)).astype(np.int32)
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (num_rows, seq_len))
    read_idx = 1 + np.arange(num_rows, dtype=np.int32)[:, None] * seq_len + positions
    write_idx = np.where(positions < np.array(row_lengths)[:, None], read_idx, 2**30)
    for r, n in enumerate(row_lengths):
        batch[r, :n] = tokens[r % 2, :n]
    lengths = np.array(row_lengths, np.int32)
    return ForwardInputs(
        tokens=jnp.asarray(batch),
        positions=jnp.asarray(positions),
        num_new=jnp.asarray(lengths),
        kv_write_idx=jnp.asarray(write_idx.astype(np.int32)),
        kv_read_idx=jnp.asarray(read_idx),
        ctx_len=jnp.asarray(lengths),
    )


def ragged_extend(
    model: Any,
    tokens: np.ndarray,
    row_lengths: Sequence[int],
    seq_len: int,
    padding_state_seed: int | None = None,
) -> tuple[np.ndarray, Any, Any]:
    """``model``'s extend forward over ``ragged_inputs`` from empty caches (with
    ``padding_state_seed``, the padding row, the last, from a random state drawn with it):
    (logits [rows, seq_len, vocab], the forward's states, the recurrent rows it started from)."""
    cfg, family = model.config, model.family
    inputs = ragged_inputs(tokens, cfg.vocab_size, row_lengths, seq_len)
    kv, rec = empty_caches(cfg, len(row_lengths) * seq_len + 1, len(row_lengths), jnp.float32)
    if padding_state_seed is not None:
        rng = np.random.default_rng(padding_state_seed)
        rec.ssm = rec.ssm.at[:, -1].set(rng.standard_normal(rec.ssm[:, -1].shape))
        rec.conv = rec.conv.at[:, -1].set(rng.standard_normal(rec.conv[:, -1].shape))

    @jax.jit
    def run(params, inputs, kv, rec):
        hidden, kv, out = family.forward(params, cfg, inputs, kv, rec, mode="extend")
        return family.compute_logits(params, cfg, hidden), out

    logits, out = jax.tree.map(np.asarray, run(model.params, inputs, kv, rec))
    return logits, out, rec
