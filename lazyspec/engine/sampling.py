"""Device-side sampling: frequency / presence / repetition penalties, logit bias,
min_new_tokens masking, grammar bitmasks, greedy, temperature, top-k, top-p, min-p,
per-request seeds, and the speculative accept rule (greedy match, or rejection sampling
against a one-hot draft). Plain sampling and the accept rule both use the processed
distribution (``processed_logits`` then temperature / top-k / top-p / min-p, SGLang's order);
greedy rows take the argmax of the processed logits (min-p never drops the most likely
token, so it changes nothing for them).

``processed_logits`` is one function per stage, in SGLang's order: penalties (repetition,
then frequency / presence) on the raw logits, the logit bias, the min_new_tokens mask, then
the grammar bitmask (last, so nothing re-enables a token the grammar forbids).

Randomness is a pure function of (request seed, absolute position, purpose), so a request's
samples do not depend on how it was batched or on the checkpoint strategy.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from lazyspec.scheduler.batch import ExtendBatch, SamplingRows
from lazyspec.scheduler.request import TOP_LOGPROBS

NEG_INF = -1e30
PURPOSE_SAMPLE = 0
PURPOSE_ACCEPT = 1

# XLA on GPUs runs a ``lax.cond`` by copying its predicate to the host and waiting for it, so
# the thread that dispatches a step cannot run ahead of the device and the overlapped loop
# loses its overlap (one H200, batch 1: the decode step's dispatch took 4.1 ms with the
# sampling conds, 2.3 ms without; BENCHMARKS.md, "Host path"). Batches of at most this many
# sampled positions do the work a cond would skip (cheap at that size) and select per row.
BRANCH_FREE_MAX_POSITIONS = 8


def _branch_free(x: jax.Array) -> bool:
    """Whether ``x [..., V]`` (one vocabulary row per sampled position) is small enough to
    compute every branch of a stage rather than skip one with a ``lax.cond``."""
    return math.prod(x.shape[:-1]) <= BRANCH_FREE_MAX_POSITIONS


def _rows_where(wanted: jax.Array, fn, x: jax.Array) -> jax.Array:
    """``fn(x)`` on the rows where ``wanted`` (leading axes of ``x``), ``x`` elsewhere. A
    large batch with no such row skips ``fn`` (``lax.cond``); a small one computes it
    always (``BRANCH_FREE_MAX_POSITIONS``)."""

    def apply(x):
        return jnp.where(wanted.reshape(wanted.shape + (1,) * (x.ndim - wanted.ndim)), fn(x), x)

    if _branch_free(x):
        return apply(x)
    return jax.lax.cond(jnp.any(wanted), apply, lambda x: x, x)


# Per-row sampling parameters: the host batches' ``SamplingRows`` (temperature [B] float32,
# 0 = greedy; top_p [B]; top_k [B] int32, <= 0 = off; min_p [B], 0 = off; seed [B] uint32;
# min_len [B] and mask_ids [B, M]; bias_ids / bias_values [B, K]; frequency / presence /
# repetition penalties [B] float32; constrained [B] bool: the row has a grammar), as a pytree.
SamplingArrays = SamplingRows
jax.tree_util.register_dataclass(
    SamplingArrays,
    data_fields=[f.name for f in dataclasses.fields(SamplingArrays)],
    meta_fields=[],
)


@jax.tree_util.register_dataclass
@dataclass
class TokenHistory:
    """What the penalties see at each position: the outputs before it and the prompt."""

    output_counts: jax.Array  # [B, T, V] int32: times each token was output before position t
    in_prompt: jax.Array  # [B, V] bool: the prompt holds the token


def verify_history(output_counts, in_prompt, drafts, num_pos: int) -> TokenHistory:
    """The history at the D verify positions: the row's counts ([B, V], every output so far)
    plus the drafts before each position (drafts [B, D-1]: position j is reached only with
    drafts 0..j-1 accepted, so they are outputs by then)."""
    vocab = output_counts.shape[-1]
    draft_counts = jnp.cumsum(jax.nn.one_hot(drafts, vocab, dtype=jnp.int32), axis=1)
    counts = jnp.concatenate([output_counts[:, None], output_counts[:, None] + draft_counts], 1)
    return TokenHistory(output_counts=counts[:, :num_pos], in_prompt=in_prompt)


def penalized_logits(logits: jax.Array, params: SamplingArrays, history: TokenHistory):
    """[B, T, V] float32 logits with each row's penalties applied: a token of the prompt or
    of the outputs so far has its logit divided by repetition_penalty when positive and
    multiplied by it otherwise; then frequency * count and presence * (count > 0) are
    subtracted (counts of outputs only). Rows with penalties (0, 0, 1) are unchanged."""
    counts = history.output_counts
    seen = (counts > 0) | history.in_prompt[:, None]
    repetition = params.repetition_penalty[:, None, None]
    repeated = jnp.where(logits > 0, logits / repetition, logits * repetition)
    logits = jnp.where(seen, repeated, logits)
    frequency = params.frequency_penalty[:, None, None] * counts.astype(jnp.float32)
    presence = params.presence_penalty[:, None, None] * (counts > 0).astype(jnp.float32)
    return logits - frequency - presence


def biased_logits(logits: jax.Array, params: SamplingArrays) -> jax.Array:
    """[B, T, V] logits plus each row's logit bias (at most MAX_LOGIT_BIAS tokens)."""
    batch, _, vocab = logits.shape
    rows = jnp.arange(batch)[:, None]
    bias_ids = jnp.where(params.bias_ids >= 0, params.bias_ids, vocab)  # vocab: dropped
    bias = (
        jnp.zeros((batch, vocab), jnp.float32)
        .at[rows, bias_ids]
        .add(params.bias_values, mode="drop")
    )
    return logits + bias[:, None]


def min_tokens_masked(logits: jax.Array, params: SamplingArrays, positions) -> jax.Array:
    """[B, T, V] logits at positions [B, T] with the row's EOS / stop ids at -inf where it
    has fewer than min_new_tokens outputs (the token sampled at position p is output number
    p + 1 - prompt length)."""
    batch, _, vocab = logits.shape
    rows = jnp.arange(batch)[:, None]
    mask_ids = jnp.where(params.mask_ids >= 0, params.mask_ids, vocab)
    masked = jnp.zeros((batch, vocab), bool).at[rows, mask_ids].set(True, mode="drop")
    early = (positions + 1 < params.min_len[:, None])[..., None]  # [B, T, 1]
    return jnp.where(early & masked[:, None], NEG_INF, logits)


def _filtered_logits(logits: jax.Array, temperature, top_p, top_k, min_p) -> jax.Array:
    """Temperature-scaled logits with top-k / top-p, then min-p, masked to -inf ([..., V],
    per-row params) on the rows that ask for them (top_k on and < V, or top_p < 1; min_p >
    0). A large batch with no such row skips the sort over the vocabulary, and one with no
    min-p row the min-p pass, as SGLang skips them (``_rows_where``)."""
    vocab = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)[..., None]
    filters = ((top_k > 0) & (top_k < vocab)) | (top_p < 1.0)
    scaled = _rows_where(filters, lambda x: _top_k_top_p(x, top_p, top_k), scaled)
    return _rows_where(min_p > 0, lambda x: _min_p(x, min_p), scaled)


def _min_p(scaled: jax.Array, min_p) -> jax.Array:
    """SGLang's min-p: a token stays if its probability is at least ``min_p`` times the most
    likely token's (p / p_max = exp(logit - max logit); top-k / top-p keep the most likely
    token, so their renormalization leaves the ratio as it was)."""
    ratio = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))
    return jnp.where(ratio < min_p[..., None], NEG_INF, scaled)


def _top_k_top_p(scaled: jax.Array, top_p, top_k) -> jax.Array:
    vocab = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[..., None], axis=-1)
    scaled = jnp.where(scaled < kth, NEG_INF, scaled)
    probs_sorted = jax.nn.softmax(jnp.where(sorted_desc < kth, NEG_INF, sorted_desc), axis=-1)
    cumulative = jnp.cumsum(probs_sorted, axis=-1)
    # keep the smallest prefix whose mass reaches top_p (always at least one token)
    keep_sorted = (cumulative - probs_sorted) < top_p[..., None]
    num_keep = jnp.maximum(jnp.sum(keep_sorted, axis=-1), 1)
    threshold = jnp.take_along_axis(sorted_desc, (num_keep - 1)[..., None], axis=-1)
    return jnp.where(scaled < threshold, NEG_INF, scaled)


def _key(seed, position, purpose):
    key = jax.random.fold_in(jax.random.PRNGKey(0), seed)
    key = jax.random.fold_in(key, position)
    return jax.random.fold_in(key, purpose)


def grammar_masked(logits: jax.Array, allowed: jax.Array | None, constrained) -> jax.Array:
    """[B, T, V] logits with the tokens outside each constrained row's bitmask at -inf.

    ``allowed [B, T, W]`` int32 words (xgrammar's layout: token t allowed iff bit t % 32 of
    word t // 32 is set), one per position; ``constrained [B]`` bool. Rows without a grammar
    are unchanged; a large batch with none skips the unpacking (``_rows_where``)."""
    if allowed is None:
        return logits
    vocab = logits.shape[-1]

    def apply(logits):
        shifts = jnp.arange(32, dtype=jnp.int32)
        bits = (allowed[..., None] >> shifts) & 1  # [B, T, W, 32]
        ok = bits.reshape(*allowed.shape[:2], -1)[..., :vocab] != 0
        return jnp.where(constrained[:, None, None] & ~ok, NEG_INF, logits)

    return _rows_where(constrained, apply, logits)


def processed_logits(
    logits: jax.Array,
    params: SamplingArrays,
    positions,
    history: TokenHistory | None = None,
    allowed: jax.Array | None = None,
) -> jax.Array:
    """[B, T, V] logits at absolute positions [B, T], float32, through every stage:
    penalties (given the ``history``; None: no penalties), logit bias, min_new_tokens, then
    for rows with a grammar the tokens outside ``allowed`` [B, T, W] at -inf (None: no
    grammar masks)."""
    logits = logits.astype(jnp.float32)
    if history is not None:
        logits = penalized_logits(logits, params, history)
    logits = biased_logits(logits, params)
    logits = min_tokens_masked(logits, params, positions)
    return grammar_masked(logits, allowed, params.constrained)


def target_probs(logits: jax.Array, params: SamplingArrays) -> jax.Array:
    """The sampling distribution per position: ``processed_logits``' [B, T, V] float32
    output -> probs under each row's temperature, top-k, top-p and min-p (greedy rows:
    one-hot at their argmax)."""
    t = params.temperature[:, None]
    filtered = _filtered_logits(
        logits, t, params.top_p[:, None], params.top_k[:, None], params.min_p[:, None]
    )
    probs = jax.nn.softmax(filtered, axis=-1)
    one_hot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=probs.dtype)
    return jnp.where((t == 0)[..., None], one_hot, probs)


def sample_from(probs: jax.Array, seed, position, greedy, purpose=PURPOSE_SAMPLE) -> jax.Array:
    """Sample one token per row from probs [B, V] with keys from (seed, position).
    ``greedy`` [B]: rows whose probs are one-hot at their argmax (they take the argmax: the
    token a draw would give them); a large batch of only such rows draws no noise over the
    vocabulary (``lax.cond``), a small one always draws (``BRANCH_FREE_MAX_POSITIONS``)."""

    def draw(probs):
        keys = jax.vmap(_key, in_axes=(0, 0, None))(seed, position, purpose)
        logp = jnp.log(jnp.maximum(probs, 1e-30))
        logp = jnp.where(probs > 0, logp, NEG_INF)
        return jax.vmap(lambda k, lp: jax.random.categorical(k, lp))(keys, logp).astype(jnp.int32)

    argmax = lambda probs: jnp.argmax(probs, axis=-1).astype(jnp.int32)  # noqa: E731
    if _branch_free(probs):
        return jnp.where(greedy, argmax(probs), draw(probs))
    return jax.lax.cond(jnp.all(greedy), argmax, draw, probs)


def verify_and_sample(
    logits,
    drafts,
    positions,
    params: SamplingArrays,
    history: TokenHistory | None = None,
    allowed=None,
):
    """Accept a chain of drafts against the target and sample the bonus token.

    logits [B, D, V] at the D verify positions; drafts [B, D-1] (the proposals for positions
    1..D-1); positions [B, D] absolute positions of the verify inputs; ``history`` the
    penalties' view at each position (``verify_history``; None: no penalties). The draft is one-hot
    (argmax of the draft head), so rejection sampling accepts draft d at step i with
    probability p_i(d) and, on rejection, resamples from p_i with d removed; greedy rows
    accept iff d is the target argmax. Returns (tokens [B, D], accept_len [B]) where
    tokens[b, :accept_len[b]] are the emitted tokens (accepted drafts then the bonus).
    ``allowed`` [B, D, W]: position j's grammar bitmask, the state after the first j drafts
    (a draft outside its position's mask has probability 0 and is rejected). A negative
    draft is no draft: it is rejected, and the bonus token is sampled from the whole
    distribution.
    """
    batch, num_pos, _ = logits.shape
    processed = processed_logits(logits, params, positions, history, allowed)
    probs = target_probs(processed, params)  # [B, D, V]
    num_drafts = num_pos - 1
    greedy = (params.temperature == 0)[:, None]
    if num_drafts > 0:
        present = drafts >= 0
        safe_drafts = jnp.maximum(drafts, 0)
        p_draft = jnp.take_along_axis(probs[:, :num_drafts], safe_drafts[..., None], axis=-1)
        p_draft = jnp.where(present, p_draft[..., 0], 0.0)
        keys = jax.vmap(jax.vmap(_key, in_axes=(None, 0, None)), in_axes=(0, 0, None))(
            params.seed, positions[:, :num_drafts], PURPOSE_ACCEPT
        )
        u = jax.vmap(jax.vmap(lambda k: jax.random.uniform(k)))(keys)
        # greedy rows' probs are one-hot at the processed argmax
        ok = jnp.where(greedy, p_draft > 0.5, u < p_draft)
        num_accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    else:
        num_accepted = jnp.zeros((batch,), jnp.int32)
    rows = jnp.arange(batch)
    bonus_probs = probs[rows, num_accepted]  # [B, V]
    if num_drafts > 0:
        rejected = num_accepted < num_drafts
        rejected_draft = drafts[rows, jnp.minimum(num_accepted, num_drafts - 1)]
        removed = bonus_probs.at[rows, jnp.maximum(rejected_draft, 0)].set(0.0)
        removed = removed / jnp.maximum(jnp.sum(removed, axis=-1, keepdims=True), 1e-30)
        use_removed = rejected & ~greedy[:, 0] & (rejected_draft >= 0)
        bonus_probs = jnp.where(use_removed[:, None], removed, bonus_probs)
    bonus = sample_from(bonus_probs, params.seed, positions[rows, num_accepted], greedy[:, 0])
    padded_drafts = jnp.concatenate([drafts, jnp.zeros((batch, 1), drafts.dtype)], axis=1)
    idx = jnp.arange(num_pos)[None, :]
    tokens = jnp.where(idx < num_accepted[:, None], padded_drafts, -1)
    tokens = jnp.where(idx == num_accepted[:, None], bonus[:, None], tokens)
    return tokens.astype(jnp.int32), (num_accepted + 1).astype(jnp.int32)


def greedy_verify(logits: jax.Array, drafts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``verify_and_sample`` for rows that are all greedy with unprocessed logits
    (``DecodeBatch.greedy``): a draft is accepted iff it is the target's argmax, and the
    bonus token is the argmax at the first rejected position. Same returns."""
    num_pos = logits.shape[1]
    target = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, D]
    num_drafts = num_pos - 1
    ok = (drafts == target[:, :num_drafts]) & (drafts >= 0)
    num_accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    idx = jnp.arange(num_pos)[None, :]
    tokens = jnp.where(idx <= num_accepted[:, None], target, -1)
    return tokens, (num_accepted + 1).astype(jnp.int32)


def top_logprobs(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The TOP_LOGPROBS most likely tokens per position: (logprobs, ids), each [..., K]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    values, ids = jax.lax.top_k(logp, TOP_LOGPROBS)
    return values, ids.astype(jnp.int32)


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """log softmax(logits)[token] per position (raw logits, temperature 1); [B, T]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    safe = jnp.maximum(tokens, 0)
    return jnp.take_along_axis(logp, safe[..., None], axis=-1)[..., 0]


PROMPT_LOGPROB_BLOCK = 256  # positions whose logits a prompt-logprob pass holds at once


def prompt_logprobs(fam, cfg, params, hidden, batch: ExtendBatch, positions):
    """Logprobs (raw logits, temperature 1) of each chunk position's next prompt token and
    the position's top alternatives: ([B, T], [B, T, K], [B, T, K]). Computed only when a
    row asks (``logprob_start``), over blocks of positions so that the logits of a whole
    chunk are never held; zeros otherwise."""
    num_rows, num_tokens = batch.tokens.shape
    targets = jnp.concatenate([batch.tokens[:, 1:], batch.next_token[:, None]], axis=1)
    t_idx = jnp.arange(num_tokens)[None, :]
    wanted = (positions + 1 >= batch.logprob_start[:, None]) & (t_idx < batch.num_new[:, None])
    block = math.gcd(num_tokens, PROMPT_LOGPROB_BLOCK)
    num_blocks = num_tokens // block

    def blocks(x):  # [B, T, ...] -> [T / block, B, block, ...]
        x = x.reshape(num_rows, num_blocks, block, *x.shape[2:])
        return jnp.moveaxis(x, 1, 0)

    def unblock(x):
        return jnp.moveaxis(x, 0, 1).reshape(num_rows, num_tokens, *x.shape[3:])

    def one_block(args):
        hidden_block, target_block = args
        logits = fam.compute_logits(params, cfg, hidden_block)
        values, ids = top_logprobs(logits)
        return token_logprobs(logits, target_block), values, ids

    def compute(_):
        out = jax.lax.map(one_block, (blocks(hidden), blocks(targets)))
        return tuple(unblock(x) for x in out)

    def skip(_):
        return (
            jnp.zeros((num_rows, num_tokens), jnp.float32),
            jnp.zeros((num_rows, num_tokens, TOP_LOGPROBS), jnp.float32),
            jnp.zeros((num_rows, num_tokens, TOP_LOGPROBS), jnp.int32),
        )

    return jax.lax.cond(jnp.any(wanted), compute, skip, None)
