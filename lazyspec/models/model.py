"""A loaded model (config, params, tokenizer, family module) and cache-free oracles.

``registry.load_model`` builds a ``Model`` from a Hugging Face folder.

``reference_logits`` recomputes a whole sequence with no cache machinery at all (scan
reference mixers, dense causal attention): the oracle every cache test compares against.
``incremental_logits`` runs the device contract the engine uses (chunked prefill with
carried recurrent state and a KV pool, then one-token decode steps) on a single sequence.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lazyspec.models.config import ModelConfig
from lazyspec.models.interface import ForwardInputs, KVPools, StateRows

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Model:
    """Everything needed to run a model: config, params pytree, tokenizer, family module."""

    config: ModelConfig
    params: dict
    tokenizer: Any  # tokenizers.Tokenizer or None
    family: ModuleType

    @property
    def has_mtp(self) -> bool:
        return "mtp" in self.params


@partial(jax.jit, static_argnums=(0, 1))
def _reference_logits(family: ModuleType, cfg: ModelConfig, params, tokens):
    hidden = family.reference_forward(params, cfg, tokens)
    return family.compute_logits(params, cfg, hidden)


@partial(jax.jit, static_argnums=(0, 1), static_argnames=("mode",))
def _forward_logits(family: ModuleType, cfg: ModelConfig, params, inputs, kv, rec, *, mode):
    hidden, kv, out = family.forward(params, cfg, inputs, kv, rec, mode=mode)
    return family.compute_logits(params, cfg, hidden), kv, out.final


def reference_logits(model: Model, input_ids: Sequence[int]) -> np.ndarray:
    """Float32 logits ``[len, vocab]`` of one sequence, recomputed with no cache."""
    tokens = jnp.asarray(np.asarray(input_ids, dtype=np.int32)[None])
    return np.asarray(_reference_logits(model.family, model.config, model.params, tokens)[0])


def empty_caches(
    cfg: ModelConfig, num_kv_rows: int, batch: int, kv_dtype, state_dtype=jnp.float32
) -> tuple[KVPools, StateRows]:
    """Zeroed KV pools (``num_kv_rows`` rows each) and recurrent state rows for ``batch``
    rows."""
    kv_shape = (num_kv_rows, cfg.num_kv_heads, cfg.head_dim)
    num_attn, num_rec = len(cfg.attention_layer_ids), len(cfg.recurrent_layer_ids)
    kv = KVPools(
        [jnp.zeros(kv_shape, kv_dtype) for _ in range(num_attn)],
        [jnp.zeros(kv_shape, kv_dtype) for _ in range(num_attn)],
    )
    rec = StateRows(
        jnp.zeros((num_rec, batch, *cfg.conv_state_shape), state_dtype),
        jnp.zeros((num_rec, batch, *cfg.ssm_state_shape), state_dtype),
    )
    return kv, rec


def single_row_inputs(
    tokens: Sequence[int],
    start: int,
    context_len: int,
    *,
    bucket: int | None = None,
    vocab_size: int = 1,
) -> ForwardInputs:
    """Inputs for one row whose new tokens sit at positions ``start..``.

    KV row = position + 1 (row 0 is the null row); the context is read from rows
    ``1..context_len``. With ``bucket`` the row is padded to that many token slots, filled
    with random ids below ``vocab_size`` (they must not change anything).
    """
    num = len(tokens)
    width = num if bucket is None else bucket
    if width < num:
        raise ValueError(f"bucket {bucket} is smaller than the {num} new tokens")
    padded = np.random.default_rng(num).integers(0, vocab_size, width).astype(np.int32)
    padded[:num] = np.asarray(tokens, np.int32)
    positions = np.arange(start, start + width, dtype=np.int32)
    return ForwardInputs(
        tokens=jnp.asarray(padded[None]),
        positions=jnp.asarray(positions[None]),
        num_new=jnp.asarray([num], jnp.int32),
        kv_write_idx=jnp.asarray(np.where(positions < start + num, positions + 1, 2**30)[None]),
        kv_read_idx=jnp.asarray(np.arange(1, context_len + 1, dtype=np.int32)[None]),
        ctx_len=jnp.asarray([start + num], jnp.int32),
    )


def incremental_logits(
    model: Model,
    prompt_ids: Sequence[int],
    decode_ids: Sequence[int],
    prefill_chunk: int | None = None,
    *,
    bucket: int | None = None,
    context_len: int | None = None,
) -> np.ndarray:
    """Logits ``[len(prompt) + len(decode), vocab]`` through the cached device contract.

    The prompt is prefilled in ``extend`` mode (in pieces of ``prefill_chunk`` tokens when
    given; each piece padded to ``bucket`` token slots when given) carrying the recurrent
    state and a KV pool between calls; then each of ``decode_ids`` is fed in ``decode``
    mode, one token per call (teacher forcing). ``context_len`` (default: the total length)
    sizes the KV pool; fixing ``bucket`` and ``context_len`` lets calls share compilations.
    """
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids must hold at least one token")
    if prefill_chunk is not None and prefill_chunk <= 0:
        raise ValueError(f"prefill_chunk must be positive, got {prefill_chunk}")
    cfg, params = model.config, model.params
    total = len(prompt_ids) + len(decode_ids)
    context_len = total if context_len is None else context_len
    if context_len < total:
        raise ValueError(f"context_len {context_len} is shorter than the {total} tokens")
    kv, rec = empty_caches(cfg, context_len + 1, 1, params["embed_tokens"].dtype)
    vocab = cfg.vocab_size
    piece = prefill_chunk or len(prompt_ids)
    calls = [
        (list(prompt_ids[s : s + piece]), s, "extend", bucket)
        for s in range(0, len(prompt_ids), piece)
    ]
    calls += [([t], len(prompt_ids) + j, "decode", None) for j, t in enumerate(decode_ids)]
    logits = []
    for tokens, start, mode, width in calls:
        inputs = single_row_inputs(tokens, start, context_len, bucket=width, vocab_size=vocab)
        step_logits, kv, rec = _forward_logits(
            model.family, cfg, params, inputs, kv, rec, mode=mode
        )
        logits.append(np.asarray(step_logits[0, : len(tokens)]))
    return np.concatenate(logits, axis=0)
