"""Speculative rejection sampling at temperature > 0 emits tokens distributed as the target.

``verify_and_sample`` gets greedy (one-hot) drafts, so q is a point mass at the draft: the
draft is accepted with probability p(d) and a rejection resamples from the residual
max(p - q, 0) = p with d removed. The emitted token at each position must then follow p;
checked by a chi-square statistic over many rows (distinct seeds) against the critical value
at p = 0.001."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lazyspec.engine.sampling import SamplingArrays, verify_and_sample

VOCAB = 6
NUM_ROWS = 20_000
TEMPERATURE = 0.7
CHI2_CRITICAL_P001 = {4: 18.467, 5: 20.515}  # upper 0.1 % points of chi-square(df)
# target logits at the three verify positions; the drafts are the argmax of other logits
TARGET_LOGITS = np.array(
    [
        [0.3, 1.2, -0.5, 0.8, -1.0, 0.1],
        [-0.2, 0.4, 1.0, -0.7, 0.6, 0.0],
        [0.5, -0.3, 0.2, 0.9, -0.4, 0.1],
    ],
    np.float32,
)
DRAFT_LOGITS = np.array([[0, 0, 0, 2.0, 0, 0], [0, 1.5, 0, 0, 0, 0]], np.float32)


def _target_probs(position: int) -> np.ndarray:
    scaled = TARGET_LOGITS[position].astype(np.float64) / TEMPERATURE
    e = np.exp(scaled - scaled.max())
    return e / e.sum()


def _chi2(tokens: np.ndarray, probs: np.ndarray) -> float:
    observed = np.bincount(tokens, minlength=len(probs))
    expected = probs * len(tokens)
    assert expected.min() >= 20, expected  # the chi-square approximation holds
    return float(np.sum((observed - expected) ** 2 / expected))


def _emitted() -> tuple[np.ndarray, np.ndarray]:
    drafts = np.argmax(DRAFT_LOGITS, axis=-1).astype(np.int32)
    logits = jnp.broadcast_to(jnp.asarray(TARGET_LOGITS), (NUM_ROWS, *TARGET_LOGITS.shape))
    rows = np.arange(NUM_ROWS)
    positions = (100 + rows % 13)[:, None] + np.arange(TARGET_LOGITS.shape[0])[None, :]
    params = SamplingArrays(
        temperature=jnp.full(NUM_ROWS, TEMPERATURE, jnp.float32),
        top_p=jnp.ones(NUM_ROWS, jnp.float32),
        top_k=jnp.full(NUM_ROWS, -1, jnp.int32),
        seed=jnp.asarray(rows, jnp.uint32),
    )
    tokens, accept_len = jax.jit(verify_and_sample)(
        logits,
        jnp.broadcast_to(jnp.asarray(drafts), (NUM_ROWS, len(drafts))),
        jnp.asarray(positions, jnp.int32),
        params,
    )
    return np.asarray(tokens), np.asarray(accept_len)


def test_emitted_tokens_follow_the_target_distribution():
    tokens, accept_len = _emitted()
    drafts = np.argmax(DRAFT_LOGITS, axis=-1)
    p0, p1 = _target_probs(0), _target_probs(1)
    assert drafts[0] != np.argmax(p0) and drafts[1] != np.argmax(p1)  # drafts are not the mode
    critical = CHI2_CRITICAL_P001[VOCAB - 1]
    first = _chi2(tokens[:, 0], p0)
    assert first < critical, (first, np.bincount(tokens[:, 0], minlength=VOCAB) / NUM_ROWS, p0)
    assert np.array_equal(tokens[:, 0] == drafts[0], accept_len >= 2)  # d0 emitted iff accepted
    # position 1 given that draft 0 was accepted: the accepted draft 1 or the resample
    accepted = accept_len >= 2
    assert abs(accepted.mean() - p0[drafts[0]]) < 4 * np.sqrt(p0[drafts[0]] / NUM_ROWS)
    second = _chi2(tokens[accepted, 1], p1)
    assert second < critical, (second, p1)
    # the bound has power: resampling from p itself (d not removed) is rejected
    wrong = (1 - p0[drafts[0]]) * p0 + p0[drafts[0]] * np.eye(VOCAB)[drafts[0]]
    assert _chi2(tokens[:, 0], wrong) > 10 * critical
