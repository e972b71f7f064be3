"""A scripted draft head: proposes a fixed token per absolute position.

It stands in for the MTP head of a tiny random model, whose drafts are almost never
accepted: with the target's own greedy continuation as the script (and chosen positions
corrupted) every accept length 1..D and every crossing offset can be driven on purpose.
The target model is untouched; only ``mtp_forward`` / ``compute_mtp_logits`` change.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType, SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np


def scripted_model(model, script: np.ndarray):
    """``model`` with its draft head replaced by ``script[q]`` = proposal for position q."""
    params = dict(model.params)
    params["script"] = jnp.asarray(script, jnp.int32)
    family = ScriptedFamily(model.family, model.config.vocab_size)
    return SimpleNamespace(config=model.config, params=params, tokenizer=None, family=family)


@dataclass(frozen=True)
class ScriptedFamily:
    """``base``'s target model with the scripted draft head. Hashed by value (the base module
    and the vocabulary), so the jitted steps treat equal ones as one family."""

    base: ModuleType
    vocab: int

    def forward(self, *args, **kwargs):
        return self.base.forward(*args, **kwargs)

    def compute_logits(self, *args, **kwargs):
        return self.base.compute_logits(*args, **kwargs)

    def reference_forward(self, *args, **kwargs):
        return self.base.reference_forward(*args, **kwargs)

    def weight_plan(self, cfg, params):
        """The base model's plan, plus the script (replicated)."""
        from lazyspec.models.plan import TensorSpec

        base = {name: value for name, value in params.items() if name != "script"}
        plan = dict(self.base.weight_plan(cfg, base))
        plan["script"] = TensorSpec("script", tuple(params["script"].shape))
        return plan

    def mtp_forward(self, params, cfg, hidden, next_tokens, inputs, mtp_kv, kernels=None):
        # An MTP input at position p predicts the token at p + 2; carry that position.
        encoded = jnp.zeros(hidden.shape, jnp.float32)
        encoded = encoded.at[..., 0].set((inputs.positions + 2).astype(jnp.float32))
        return encoded, mtp_kv

    def compute_mtp_logits(self, params, cfg, mtp_hidden):
        script_arr = params["script"]
        pos = jnp.clip(jnp.round(mtp_hidden[..., 0]).astype(jnp.int32), 0, script_arr.shape[0] - 1)
        return 10.0 * jax.nn.one_hot(script_arr[pos], self.vocab, dtype=jnp.float32)


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
