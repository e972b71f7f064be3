"""``forward(..., mode="extend", keep_chunk=...)`` returns exactly the selected entries of
the full per-chunk states, for both families, and changes nothing else."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.models.interface import ForwardInputs
from lazyspec.models.model import empty_caches
from lazyspec.testing.tiny_models import tiny_model

CHUNK = 16
WIDTH = 64  # 4 chunks per row


def _ragged_inputs(rng, vocab: int, lengths: list[int]) -> ForwardInputs:
    rows = len(lengths)
    positions = np.tile(np.arange(WIDTH, dtype=np.int32), (rows, 1))
    valid = positions < np.asarray(lengths)[:, None]
    kv_rows = 1 + np.arange(rows)[:, None] * WIDTH + positions  # row 0 is the null row
    return ForwardInputs(
        tokens=jnp.asarray(rng.integers(0, vocab, (rows, WIDTH)), jnp.int32),
        positions=jnp.asarray(positions),
        num_new=jnp.asarray(lengths, jnp.int32),
        kv_write_idx=jnp.asarray(np.where(valid, kv_rows, 2**30), jnp.int32),
        kv_read_idx=jnp.asarray(kv_rows, jnp.int32),
        ctx_len=jnp.asarray(lengths, jnp.int32),
    )


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_keep_chunk_selects_per_row(family):
    model = tiny_model(family)
    cfg, fam = model.config, model.family
    rng = np.random.default_rng(5)
    lengths = [64, 37, 16, 5]
    inputs = _ragged_inputs(rng, cfg.vocab_size, lengths)
    kv, rec = empty_caches(cfg, 1 + len(lengths) * WIDTH, len(lengths), jnp.float32)
    rec = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.1, x.dtype), rec)
    keep = jnp.asarray([3, 1, 0, 2], jnp.int32)

    def run(keep_chunk):
        return fam.forward(
            model.params,
            cfg,
            inputs,
            kv,
            rec,
            mode="extend",
            chunk_size=CHUNK,
            keep_chunk=keep_chunk,
        )

    hidden, kv_all, full = run(None)
    hidden_kept, kv_kept, kept = run(keep)
    assert full.chunks.ssm.shape[2] == WIDTH // CHUNK and kept.chunks.ssm.shape[2] == 1
    rows = np.arange(len(lengths))
    for name in ("conv", "ssm"):
        want = np.asarray(getattr(full.chunks, name))[:, rows, np.asarray(keep)]
        np.testing.assert_array_equal(np.asarray(getattr(kept.chunks, name))[:, :, 0], want)
        np.testing.assert_array_equal(
            np.asarray(getattr(kept.final, name)), np.asarray(getattr(full.final, name))
        )
    np.testing.assert_array_equal(np.asarray(hidden_kept), np.asarray(hidden))
    for a, b in zip(jax.tree.leaves(kv_kept), jax.tree.leaves(kv_all)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
