"""A scripted draft head: proposes a fixed token per absolute position.

It stands in for the MTP head of a tiny random model, whose drafts are almost never
accepted: with the target's own greedy continuation as the script (and chosen positions
corrupted) every accept length 1..D and every crossing offset can be driven on purpose.
The target model is untouched; only ``mtp_forward`` / ``compute_mtp_logits`` change.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

_FAMILIES: dict[int, SimpleNamespace] = {}


def scripted_model(model, script: np.ndarray):
    """``model`` with its draft head replaced by ``script[q]`` = proposal for position q."""
    key = id(model.family)
    if key not in _FAMILIES:
        _FAMILIES[key] = _scripted_family(model.family, model.config.vocab_size)
    params = dict(model.params)
    params["script"] = jnp.asarray(script, jnp.int32)
    return SimpleNamespace(
        config=model.config, params=params, tokenizer=None, family=_FAMILIES[key]
    )


def _scripted_family(base, vocab: int) -> SimpleNamespace:

    def mtp_forward(params, cfg, hidden, next_tokens, inputs, mtp_kv):
        # An MTP input at position p predicts the token at p + 2; carry that position.
        encoded = jnp.zeros(hidden.shape, jnp.float32)
        encoded = encoded.at[..., 0].set((inputs.positions + 2).astype(jnp.float32))
        return encoded, mtp_kv

    def compute_mtp_logits(params, cfg, mtp_hidden):
        script_arr = params["script"]
        pos = jnp.clip(jnp.round(mtp_hidden[..., 0]).astype(jnp.int32), 0, script_arr.shape[0] - 1)
        return 10.0 * jax.nn.one_hot(script_arr[pos], vocab, dtype=jnp.float32)

    return SimpleNamespace(
        forward=base.forward,
        compute_logits=base.compute_logits,
        reference_forward=base.reference_forward,
        mtp_forward=mtp_forward,
        compute_mtp_logits=compute_mtp_logits,
    )


def make_script(
    sequence: list[int], length: int, corrupt_prob: float, vocab: int, seed: int
) -> np.ndarray:
    """The true sequence with each position corrupted (to a different token) w.p. p."""
    rng = np.random.default_rng(seed)
    script = np.zeros(length, np.int32)
    script[: len(sequence)] = sequence
    corrupt = rng.random(len(sequence)) < corrupt_prob
    script[: len(sequence)][corrupt] = (np.asarray(sequence)[corrupt] + 1) % vocab
    return script
