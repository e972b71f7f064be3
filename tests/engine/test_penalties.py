"""Frequency / presence / repetition penalties on the device: the processed logits against a
numpy reference row by row, the history a verify position sees, and the token-count seeds a
newly admitted row gets (the engine-level checks are in test_sampling_params.py,
test_spec_decoding.py and test_retraction.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lazyspec.engine.sampling import NEG_INF, TokenHistory, processed_logits, verify_history
from lazyspec.engine.steps import seed_counts
from lazyspec.scheduler.batch import COUNT_SEED_TOKENS, MASK_IDS, count_seeds
from lazyspec.scheduler.request import MAX_LOGIT_BIAS, Req, SamplingParams
from lazyspec.testing.tiny_models import processed_logits_reference
from tests.engine.test_sampling import sampling_arrays

VOCAB = 50
EOS_IDS = (2,)
ROWS = [  # (sampling, prompt length, outputs so far)
    (SamplingParams(frequency_penalty=1.3, presence_penalty=0.4), 6, 9),
    (SamplingParams(repetition_penalty=1.7), 8, 5),
    (SamplingParams(repetition_penalty=0.6, presence_penalty=-1.5), 4, 12),
    (SamplingParams(frequency_penalty=-0.7, logit_bias=((3, 2.0),), min_new_tokens=20), 5, 7),
    (SamplingParams(), 7, 10),  # no penalties: unchanged
]


def _rows_arrays(rows) -> dict:
    return dict(
        frequency_penalty=np.array([s.frequency_penalty for s, *_ in rows], np.float32),
        presence_penalty=np.array([s.presence_penalty for s, *_ in rows], np.float32),
        repetition_penalty=np.array([s.repetition_penalty for s, *_ in rows], np.float32),
    )


def test_processed_logits_equal_the_numpy_reference_per_row():
    rng = np.random.default_rng(0)
    num_rows = len(ROWS)
    # tokens drawn from a small range so that prompt and outputs repeat and overlap
    prompts = [list(rng.integers(0, 12, size=n)) for _, n, _ in ROWS]
    outputs = [list(rng.integers(0, 12, size=n)) for *_, n in ROWS]
    logits = rng.normal(0, 3, size=(num_rows, 1, VOCAB)).astype(np.float32)
    counts = np.stack([np.bincount(o, minlength=VOCAB) for o in outputs]).astype(np.int32)
    in_prompt = np.zeros((num_rows, VOCAB), bool)
    for b, prompt in enumerate(prompts):
        in_prompt[b, prompt] = True
    bias_ids = np.full((num_rows, MAX_LOGIT_BIAS), -1, np.int32)
    bias_values = np.zeros((num_rows, MAX_LOGIT_BIAS), np.float32)
    bias_ids[3, 0], bias_values[3, 0] = 3, 2.0
    mask_ids = np.full((num_rows, MASK_IDS), -1, np.int32)
    mask_ids[3, 0] = EOS_IDS[0]
    min_len = np.array([0, 0, 0, len(prompts[3]) + 20, 0], np.int32)
    params = sampling_arrays(
        num_rows,
        0.0,
        bias_ids=bias_ids,
        bias_values=bias_values,
        mask_ids=mask_ids,
        min_len=min_len,
        **_rows_arrays(ROWS),
    )
    positions = np.array([[len(p) + len(o) - 1] for p, o in zip(prompts, outputs)], np.int32)
    history = TokenHistory(jnp.asarray(counts)[:, None], jnp.asarray(in_prompt))
    got = np.asarray(jax.jit(processed_logits)(jnp.asarray(logits), params, positions, history))
    for b, (sampling, *_) in enumerate(ROWS):
        want = processed_logits_reference(logits[b, 0], sampling, prompts[b], outputs[b], EOS_IDS)
        np.testing.assert_allclose(got[b, 0], want, rtol=1e-6, atol=1e-5, err_msg=f"row {b}")
        changed = not np.allclose(want, logits[b, 0])
        assert changed == (b != len(ROWS) - 1), b  # every processed row differs; the last not


def test_a_verify_position_counts_the_drafts_before_it():
    rng = np.random.default_rng(1)
    counts = rng.integers(0, 3, size=(2, VOCAB)).astype(np.int32)
    in_prompt = rng.random((2, VOCAB)) < 0.2
    drafts = np.array([[4, 4, 9], [7, 1, 7]], np.int32)
    history = verify_history(jnp.asarray(counts), jnp.asarray(in_prompt), jnp.asarray(drafts), 4)
    got = np.asarray(history.output_counts)
    assert got.shape == (2, 4, VOCAB)
    for b in range(2):
        for j in range(4):
            want = counts[b] + np.bincount(drafts[b, :j], minlength=VOCAB)
            np.testing.assert_array_equal(got[b, j], want, err_msg=f"row {b} position {j}")
    np.testing.assert_array_equal(np.asarray(history.in_prompt), in_prompt)


def test_count_seeds_reset_the_row_and_write_its_history():
    """A resumed request's seeds: its prompt marked, its outputs so far counted, the row's
    previous contents gone, the other rows untouched; more distinct tokens than one seed
    carries take several."""
    vocab, rows = 3000, 4
    rng = np.random.default_rng(2)
    prompt = [int(t) for t in rng.permutation(vocab)[:1500]]  # > COUNT_SEED_TOKENS distinct
    outputs = [5, 5, 7, prompt[0], 2999, 5]
    req = Req(rid="r", input_ids=prompt, sampling=SamplingParams(frequency_penalty=1.0))
    req.output_ids, req.req_row = outputs, 2
    seeds = count_seeds(req)
    assert len(seeds) == 2 and len(set(prompt) | set(outputs)) > COUNT_SEED_TOKENS
    assert [bool(s.reset) for s in seeds] == [True, False]
    stale = rng.integers(0, 5, size=(rows, vocab)).astype(np.int32)
    stale_prompt = rng.random((rows, vocab)) < 0.5
    counts, in_prompt = jnp.asarray(stale), jnp.asarray(stale_prompt)
    apply = jax.jit(seed_counts)
    for seed in seeds:
        counts, in_prompt = apply(counts, in_prompt, seed)
    counts, in_prompt = np.asarray(counts), np.asarray(in_prompt)
    np.testing.assert_array_equal(counts[2], np.bincount(outputs, minlength=vocab))
    want_prompt = np.zeros(vocab, bool)
    want_prompt[prompt] = True
    np.testing.assert_array_equal(in_prompt[2], want_prompt)
    others = [0, 1, 3]
    np.testing.assert_array_equal(counts[others], stale[others])
    np.testing.assert_array_equal(in_prompt[others], stale_prompt[others])


def test_the_grammar_mask_comes_after_the_penalties_and_the_bias():
    """The grammar mask is the last stage: a grammar row's forbidden tokens are exactly -inf
    whatever the earlier stages did (a +100 bias, penalties on seen tokens); its allowed
    tokens and the rows without a grammar keep the values of the stages before the mask."""
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(0, 3, size=(2, 1, VOCAB)).astype(np.float32))
    bias_ids = np.full((2, MAX_LOGIT_BIAS), -1, np.int32)
    bias_values = np.zeros((2, MAX_LOGIT_BIAS), np.float32)
    bias_ids[:, 0], bias_values[:, 0] = 3, 100.0
    params = sampling_arrays(
        2,
        0.0,
        bias_ids=bias_ids,
        bias_values=bias_values,
        repetition_penalty=np.full(2, 0.5, np.float32),
        frequency_penalty=np.full(2, -1.0, np.float32),
        constrained=np.array([True, False]),
    )
    counts = np.zeros((2, VOCAB), np.int32)
    counts[:, [3, 7]] = 4
    history = TokenHistory(jnp.asarray(counts)[:, None], jnp.zeros((2, VOCAB), bool))
    allowed_ids = [1, 5, 9]
    words = np.zeros((2, 1, (VOCAB + 31) // 32), np.int32)
    for t in allowed_ids:
        words[:, 0, t // 32] |= 1 << (t % 32)
    positions = jnp.zeros((2, 1), jnp.int32)
    run = jax.jit(processed_logits)
    unmasked = np.asarray(run(logits, params, positions, history))
    got = np.asarray(run(logits, params, positions, history, jnp.asarray(words)))
    assert unmasked[0, 0].argmax() == 3  # the bias wins without the mask
    forbidden = np.setdiff1d(np.arange(VOCAB), allowed_ids)
    # exactly -inf: a penalty after the mask would scale the seen tokens' -inf (3 and 7)
    assert (got[0, 0, forbidden] == np.float32(NEG_INF)).all()
    np.testing.assert_array_equal(got[0, 0, allowed_ids], unmasked[0, 0, allowed_ids])
    np.testing.assert_array_equal(got[1], unmasked[1])
    assert not np.allclose(unmasked[:, 0, 7], np.asarray(logits)[:, 0, 7])  # penalized
