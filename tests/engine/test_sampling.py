"""Speculative rejection sampling at temperature > 0 emits tokens distributed as the target.

``verify_and_sample`` gets greedy (one-hot) drafts, so q is a point mass at the draft: the
draft is accepted with probability p(d) and a rejection resamples from the residual
max(p - q, 0) = p with d removed. The emitted token at each position must then follow p;
checked by a chi-square statistic over many rows (distinct seeds) against the critical value
at p = 0.001."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lazyspec.engine.sampling import SamplingArrays, verify_and_sample
from lazyspec.scheduler.batch import MASK_IDS, neutral_sampling
from lazyspec.scheduler.request import MAX_LOGIT_BIAS

VOCAB = 6
NUM_ROWS = 20_000
TEMPERATURE = 0.7
CHI2_CRITICAL_P001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}  # chi-square(df)
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


def sampling_arrays(num_rows: int, temperature: float, **rows) -> SamplingArrays:
    """Rows with no bias and no min_new_tokens unless ``rows`` gives other arrays."""
    fields = vars(neutral_sampling(num_rows))
    fields["temperature"] = np.full(num_rows, temperature, np.float32)
    fields["seed"] = np.arange(num_rows, dtype=np.uint32)
    fields.update(rows)
    return SamplingArrays(**{k: jnp.asarray(v) for k, v in fields.items()})


def _emitted(params: SamplingArrays | None = None) -> tuple[np.ndarray, np.ndarray]:
    drafts = np.argmax(DRAFT_LOGITS, axis=-1).astype(np.int32)
    logits = jnp.broadcast_to(jnp.asarray(TARGET_LOGITS), (NUM_ROWS, *TARGET_LOGITS.shape))
    rows = np.arange(NUM_ROWS)
    positions = (100 + rows % 13)[:, None] + np.arange(TARGET_LOGITS.shape[0])[None, :]
    params = params or sampling_arrays(NUM_ROWS, TEMPERATURE)
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


def test_bias_and_min_tokens_shape_the_speculative_distribution():
    """Position 0 (absolute 100 + rows % 13) is before each row's min_len, so token 1 is
    masked there; position 1 sees only the logit bias (+1.5 on token 4). Both the
    accept test and the resample use that processed distribution."""
    bias_ids = np.full((NUM_ROWS, MAX_LOGIT_BIAS), -1, np.int32)
    bias_values = np.zeros((NUM_ROWS, MAX_LOGIT_BIAS), np.float32)
    bias_ids[:, 0], bias_values[:, 0] = 4, 1.5
    mask_ids = np.full((NUM_ROWS, MASK_IDS), -1, np.int32)
    mask_ids[:, 0] = 1
    rows = np.arange(NUM_ROWS)
    # masked while position + 1 < min_len: position 0 (100 + rows % 13) only
    min_len = (102 + rows % 13).astype(np.int32)
    params = sampling_arrays(
        NUM_ROWS,
        TEMPERATURE,
        min_len=min_len,
        mask_ids=mask_ids,
        bias_ids=bias_ids,
        bias_values=bias_values,
    )
    tokens, accept_len = _emitted(params)
    processed = TARGET_LOGITS.astype(np.float64).copy()
    processed[:, 4] += 1.5
    p = [np.exp(row / TEMPERATURE - np.max(row / TEMPERATURE)) for row in processed]
    p0 = p[0].copy()
    p0[1] = 0.0
    p0, p1 = p0 / p0.sum(), p[1] / p[1].sum()
    critical = CHI2_CRITICAL_P001[VOCAB - 1]
    assert not np.any(tokens[:, 0] == 1)
    nonzero = p0 > 0
    first = _chi2(np.searchsorted(np.flatnonzero(nonzero), tokens[:, 0]), p0[nonzero])
    assert first < CHI2_CRITICAL_P001[VOCAB - 2], (first, p0)
    accepted = accept_len >= 2
    second = _chi2(tokens[accepted, 1], p1)
    assert second < critical, (second, p1)
    # the bound has power: the unbiased target is rejected at position 1
    assert _chi2(tokens[accepted, 1], _target_probs(1)) > 10 * critical


def test_greedy_rows_take_the_processed_argmax():
    """Greedy: a +bias token wins; a masked argmax loses while the row is short; the draft
    is accepted iff it is the processed argmax."""
    logits = jnp.asarray(np.tile(TARGET_LOGITS, (2, 1, 1)))  # argmax per position: 1, 2, 3
    bias_ids = np.full((2, MAX_LOGIT_BIAS), -1, np.int32)
    bias_values = np.zeros((2, MAX_LOGIT_BIAS), np.float32)
    bias_ids[0, 0], bias_values[0, 0] = 5, 100.0
    mask_ids = np.full((2, MASK_IDS), -1, np.int32)
    mask_ids[1, :2] = [1, 2]
    params = sampling_arrays(
        2,
        0.0,
        min_len=np.array([0, 12], np.int32),  # row 1: positions 10 masked, 11 not
        mask_ids=mask_ids,
        bias_ids=bias_ids,
        bias_values=bias_values,
    )
    drafts = jnp.asarray([[5, 5], [3, 2]], jnp.int32)
    positions = jnp.asarray([[10, 11, 12], [10, 11, 12]], jnp.int32)
    tokens, accept_len = jax.jit(verify_and_sample)(logits, drafts, positions, params)
    # row 0: token 5 everywhere; row 1: position 10 masks 1 and 2 -> argmax 3, accepted;
    # position 11 unmasked -> argmax 2, accepted; bonus at 12 -> 3
    assert np.asarray(tokens).tolist() == [[5, 5, 5], [3, 2, 3]]
    assert np.asarray(accept_len).tolist() == [3, 3]


def _bitmask(allowed_per_position: list[set[int]]) -> np.ndarray:
    """xgrammar's layout, one int32 word per position (the vocabulary is < 32)."""
    return np.array([[sum(1 << t for t in allowed)] for allowed in allowed_per_position], np.int32)


def test_grammar_masks_constrain_each_verify_position_of_their_rows_only():
    logits = jnp.asarray(np.tile(TARGET_LOGITS, (2, 1, 1)))  # argmax per position: 1, 2, ...
    masks = _bitmask([{3, 4}, {0, 4}, {5}])  # position j: the state after j drafts
    allowed = jnp.asarray(np.stack([masks, masks]))  # [B, D, W]
    params = sampling_arrays(2, 0.0, constrained=np.array([True, False]))
    drafts = jnp.asarray([[3, 2], [1, 2]], jnp.int32)
    positions = jnp.asarray([[10, 11, 12], [10, 11, 12]], jnp.int32)
    tokens, accept_len = jax.jit(verify_and_sample)(
        logits, drafts, positions, params, allowed=allowed
    )
    # row 0: position 0 allows {3, 4} -> argmax 3 = the draft, accepted; position 1 allows
    # {0, 4} -> 4, so draft 2 is rejected and 4 is the bonus. Row 1 has no grammar: its
    # drafts match the plain argmax and the bonus is position 2's argmax
    bonus = int(np.argmax(TARGET_LOGITS[2]))
    assert np.asarray(tokens).tolist() == [[3, 4, -1], [1, 2, bonus]]
    assert np.asarray(accept_len).tolist() == [2, 3]


def _penalized(logits: np.ndarray, counts: np.ndarray, in_prompt: np.ndarray) -> np.ndarray:
    """The penalties on one position's logits, in float64 (OpenAI's frequency / presence on
    output counts, SGLang's repetition on tokens of the prompt or the outputs)."""
    out = logits.astype(np.float64).copy()
    seen = (counts > 0) | in_prompt
    out[seen] = np.where(out[seen] > 0, out[seen] / PENALTIES[2], out[seen] * PENALTIES[2])
    return out - PENALTIES[0] * counts - PENALTIES[1] * (counts > 0)


PENALTIES = (0.6, 0.4, 1.4)  # frequency, presence, repetition


def test_penalties_and_a_grammar_shape_the_speculative_distribution():
    """Temperature 0.7 with penalties over a history (outputs and prompt) and a grammar mask
    per verify position: the accepted-or-resampled token at position 0 follows the processed
    target, and at position 1 (draft 0 accepted) the target processed with draft 0 counted
    as an output. Computed here in numpy, independently of the engine's stages."""
    from lazyspec.engine.sampling import verify_history

    drafts = np.argmax(DRAFT_LOGITS, axis=-1).astype(np.int32)  # 3, then 1
    counts = np.array([0, 2, 1, 0, 0, 0], np.int32)  # outputs so far: token 1 twice, 2 once
    in_prompt = np.array([True, False, False, False, False, True])
    allowed = [{0, 1, 2, 3, 4}, {1, 2, 3, 4, 5}]  # position 0 bans 5, position 1 bans 0
    masks = np.array([[sum(1 << t for t in a)] for a in allowed + [set(range(VOCAB))]], np.int32)
    rows = np.arange(NUM_ROWS)
    positions = (100 + rows % 13)[:, None] + np.arange(TARGET_LOGITS.shape[0])[None, :]
    history = verify_history(
        jnp.asarray(np.tile(counts, (NUM_ROWS, 1))),
        jnp.asarray(np.tile(in_prompt, (NUM_ROWS, 1))),
        jnp.asarray(np.tile(drafts, (NUM_ROWS, 1))),
        TARGET_LOGITS.shape[0],
    )
    params = sampling_arrays(
        NUM_ROWS,
        TEMPERATURE,
        frequency_penalty=np.full(NUM_ROWS, PENALTIES[0], np.float32),
        presence_penalty=np.full(NUM_ROWS, PENALTIES[1], np.float32),
        repetition_penalty=np.full(NUM_ROWS, PENALTIES[2], np.float32),
        constrained=np.ones(NUM_ROWS, bool),
    )
    logits = jnp.broadcast_to(jnp.asarray(TARGET_LOGITS), (NUM_ROWS, *TARGET_LOGITS.shape))
    tokens, accept_len = jax.jit(verify_and_sample)(
        logits,
        jnp.broadcast_to(jnp.asarray(drafts), (NUM_ROWS, len(drafts))),
        jnp.asarray(positions, jnp.int32),
        params,
        history,
        jnp.asarray(np.broadcast_to(masks, (NUM_ROWS, *masks.shape))),
    )
    tokens, accept_len = np.asarray(tokens), np.asarray(accept_len)

    def expected(position: int, counts_then: np.ndarray) -> np.ndarray:
        scaled = _penalized(TARGET_LOGITS[position], counts_then, in_prompt) / TEMPERATURE
        p = np.exp(scaled - scaled.max())
        p[[t for t in range(VOCAB) if t not in allowed[position]]] = 0.0
        return p / p.sum()

    p0 = expected(0, counts)
    p1 = expected(1, counts + np.eye(VOCAB, dtype=np.int32)[drafts[0]])
    assert not np.any(tokens[:, 0] == 5)  # banned by the grammar at position 0
    first = _chi2(tokens[:, 0], p0[:5])
    assert first < CHI2_CRITICAL_P001[VOCAB - 2], (first, p0)
    accepted = accept_len >= 2
    assert not np.any(tokens[accepted, 1] == 0)  # banned at position 1
    second = _chi2(tokens[accepted, 1] - 1, p1[1:])
    assert second < CHI2_CRITICAL_P001[VOCAB - 2], (second, p1)
    # the bound has power: without the penalties (the grammar alone), or at position 1
    # without draft 0 counted, the emitted tokens are rejected
    no_penalty = _target_probs(0)[:5] / _target_probs(0)[:5].sum()
    assert _chi2(tokens[:, 0], no_penalty) > 10 * CHI2_CRITICAL_P001[VOCAB - 2]
    stale = expected(1, counts)
    assert _chi2(tokens[accepted, 1] - 1, stale[1:]) > 5 * CHI2_CRITICAL_P001[VOCAB - 2]


def _top_k_top_p_probs(position: int, top_k: int, top_p: float) -> np.ndarray:
    """numpy: the target at ``position`` kept to its top_k tokens, then to the smallest
    prefix (by probability) whose mass reaches top_p, renormalised."""
    p = _target_probs(position)
    order = np.argsort(-p)
    keep = np.zeros(VOCAB, bool)
    keep[order[: top_k if top_k > 0 else VOCAB]] = True
    q = np.where(keep, p, 0.0) / np.where(keep, p, 0.0).sum()
    before = np.cumsum(q[order]) - q[order]
    keep[order[before >= top_p]] = False
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def test_top_k_and_top_p_rows_beside_plain_rows():
    """A batch of thirds: top_k = 3, top_p = 0.6, and plain rows. Position 0 of each follows
    its filtered target; the plain rows draw the very tokens they draw in a batch where no
    row filters (which skips the sort over the vocabulary)."""
    third = NUM_ROWS // 3
    kind = np.arange(NUM_ROWS) // third  # 0: top_k, 1: top_p, 2 (and the rest): plain
    top_k = np.where(kind == 0, 3, -1).astype(np.int32)
    top_p = np.where(kind == 1, 0.6, 1.0).astype(np.float32)
    tokens, _ = _emitted(sampling_arrays(NUM_ROWS, TEMPERATURE, top_k=top_k, top_p=top_p))
    plain_only, _ = _emitted()
    critical = CHI2_CRITICAL_P001
    for which, (k, p) in enumerate([(3, 1.0), (-1, 0.6)]):
        want = _top_k_top_p_probs(0, k, p)
        kept = np.flatnonzero(want > 0)
        got = tokens[kind == which, 0]
        assert set(np.unique(got)) <= set(kept), (which, np.unique(got), kept)
        stat = _chi2(np.searchsorted(kept, got), want[kept])
        assert stat < critical[len(kept) - 1], (which, stat, want)
    plain = kind >= 2
    assert np.array_equal(tokens[plain], plain_only[plain])
    assert _chi2(tokens[plain, 0], _target_probs(0)) < critical[VOCAB - 1]


def _min_p_probs(position: int, min_p: float, top_k: int = -1) -> np.ndarray:
    """SGLang's order: temperature, top-k, then min-p against the most likely token."""
    q = _top_k_top_p_probs(position, top_k, 1.0)
    q = np.where(q >= min_p * q.max(), q, 0.0)
    return q / q.sum()


def test_min_p_rows_shape_the_speculative_distribution():
    """Rows with min_p = 0.45, rows with top_k = 4 then min_p = 0.25, and plain rows. Each
    follows its filtered target at both verify positions: the accept test and the resample
    use the min-p distribution (with 0.45, position 1's draft is outside it and never
    accepted). The plain rows draw what they draw where no row asks for min-p."""
    third = NUM_ROWS // 3
    kind = np.arange(NUM_ROWS) // third  # 0: min_p, 1: top_k then min_p, 2 (and the rest): plain
    cases = [(0.45, -1), (0.25, 4)]
    min_p = np.array([0.45, 0.25, 0.0, 0.0], np.float32)[kind]
    top_k = np.where(kind == 1, 4, -1).astype(np.int32)
    tokens, accept_len = _emitted(sampling_arrays(NUM_ROWS, TEMPERATURE, min_p=min_p, top_k=top_k))
    plain_only, _ = _emitted()
    drafts = np.argmax(DRAFT_LOGITS, axis=-1)
    for which, (p, k) in enumerate(cases):
        rows = kind == which
        want = [_min_p_probs(0, p, k), _min_p_probs(1, p, k)]
        assert np.count_nonzero(want[0]) < np.count_nonzero(_top_k_top_p_probs(0, k, 1.0))
        assert want[0][drafts[0]] > 0
        assert (want[1][drafts[1]] == 0) == (which == 0)
        assert (accept_len[rows] > 2).any() == (which == 1)  # draft 1 accepted only if kept
        accepted = rows & (accept_len >= 2)
        for got, q in ((tokens[rows, 0], want[0]), (tokens[accepted, 1], want[1])):
            kept = np.flatnonzero(q > 0)
            assert set(np.unique(got)) <= set(kept), (which, np.unique(got), kept)
            stat = _chi2(np.searchsorted(kept, got), q[kept])
            assert stat < CHI2_CRITICAL_P001[len(kept) - 1], (which, stat, q)
    plain = kind >= 2
    assert np.array_equal(tokens[plain], plain_only[plain])


def _has_cond(fn, *args) -> bool:
    """Whether ``fn``'s jaxpr (nested ones included) holds a ``lax.cond``."""

    def walk(jaxpr) -> bool:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "cond":
                return True
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else [param]:
                    inner = getattr(sub, "jaxpr", None)
                    if inner is not None and walk(getattr(inner, "jaxpr", inner)):
                        return True
        return False

    return walk(jax.make_jaxpr(fn)(*args).jaxpr)


def test_small_batches_sample_without_conditionals_and_draw_the_same_tokens():
    """A small verify batch (at most BRANCH_FREE_MAX_POSITIONS positions) has no
    ``lax.cond`` (a GPU waits on the host for its predicate) and emits, row for row, what
    the same rows emit inside a large batch, whose stages skip by ``lax.cond``: greedy,
    plain, top-k, top-p, min-p and grammar rows, at temperature 0 and 0.7."""
    num_rows = 64
    rng = np.random.default_rng(3)
    kind = np.arange(num_rows) % 6  # 0 greedy, 1 plain, 2 top-k, 3 top-p, 4 grammar, 5 min-p
    params = sampling_arrays(
        num_rows,
        TEMPERATURE,
        top_k=np.where(kind == 2, 2, -1).astype(np.int32),
        top_p=np.where(kind == 3, 0.5, 1.0).astype(np.float32),
        min_p=np.where(kind == 5, 0.3, 0.0).astype(np.float32),
        constrained=kind == 4,
        seed=rng.integers(0, 2**32, num_rows, dtype=np.uint32),
    )
    greedy_rows = jnp.asarray(np.where(kind == 0, 0.0, TEMPERATURE), jnp.float32)
    params = dataclasses.replace(params, temperature=greedy_rows)
    logits = jnp.asarray(rng.standard_normal((num_rows, 2, VOCAB)), jnp.float32)
    drafts = jnp.asarray(rng.integers(0, VOCAB, (num_rows, 1)), jnp.int32)
    positions = jnp.asarray(50 + np.arange(num_rows)[:, None] + np.arange(2)[None, :], jnp.int32)
    allowed = jnp.asarray(rng.integers(1, 2**VOCAB, (num_rows, 2, 1)), jnp.int32)

    def run(rows: slice):
        part = jax.tree.map(lambda x: x[rows], params)
        args = (logits[rows], drafts[rows], positions[rows], part, None, allowed[rows])
        return _has_cond(verify_and_sample, *args), jax.jit(verify_and_sample)(*args)

    large_cond, (large_tokens, large_accept) = run(slice(None))
    assert large_cond  # the large batch takes the skipping path: the comparison has a point
    for start in range(0, num_rows, 4):  # 4 rows x 2 positions: the branch-free bound
        small_cond, (tokens, accept) = run(slice(start, start + 4))
        assert not small_cond
        np.testing.assert_array_equal(tokens, large_tokens[start : start + 4])
        np.testing.assert_array_equal(accept, large_accept[start : start + 4])
