"""The ragged extend batch of the parity tests: rows of different lengths over two token
sequences, each row in a KV block of its own, padding slots and a padding row."""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from lazyspec.models.interface import ForwardInputs


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
