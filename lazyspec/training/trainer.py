"""Training-time forward and losses for a Qwen3-Next model with its MTP head.

The forward runs whole sequences ``[B, T]`` from empty states with no cache machinery: the
chunked GDN form (``layers/gdn.py``, form ``"chunked"``) and dense causal attention. It
computes the same function as ``qwen3_next.reference_forward`` (the token-by-token oracle),
only faster, and is differentiable end to end. ``gdn_form="scan"`` runs the token-by-token
GDN instead (CPU training runs' default, ``scripts/train_tiny.py``).

The MTP loss trains the head exactly as the engine runs it (``qwen3_next.mtp_forward``):
the head's input at position t combines the target's hidden stream at t (before the final
norm) with the embedding of token t+1, its attention is causal over MTP positions with the
same RoPE positions as the target, and its logits at t predict token t+2.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lazyspec.models.config import ModelConfig
from lazyspec.models.decoder import decoder_layer, reference_step, run_reference
from lazyspec.models.layers.linear import linear
from lazyspec.models.layers.residual import add
from lazyspec.models.plan import Params
from lazyspec.models.qwen3_next import compute_logits, compute_mtp_logits, decoder, norm

DEFAULT_MTP_WEIGHT = 0.3
GDN_FORMS = {"chunked": "chunked", "scan": "reference"}  # training name -> gdn_mixer form
# Leaves kept in float32 under mixed precision: the embedding (so the residual stream stays
# float32) and the small conv taps; every other matrix is cast for the matmuls.
_KEEP_FP32 = ("embed_tokens", "conv1d")


def cast_for_compute(params: Params, dtype: Any) -> Params:
    """A copy of ``params`` whose matrices (ndim >= 2) are cast to ``dtype``.

    Vectors (norm weights, ``A_log``, ``dt_bias``), the embedding and the conv taps keep
    their dtype. Gradients flow back through the cast to the original (float32) leaves.
    """

    def cast(path, leaf):
        names = {getattr(key, "key", None) for key in path}
        if leaf.ndim < 2 or names & set(_KEEP_FP32):
            return leaf
        return leaf.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, params)


def training_forward(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,
    *,
    gdn_form: str = "chunked",
    chunk_size: int = 64,
) -> jax.Array:
    """Hidden stream before the final norm ``[B, T, hidden]`` of whole sequences ``[B, T]``.

    Equals ``qwen3_next.reference_forward`` (same params, same tokens) with either
    ``gdn_form`` ("chunked" or "scan"); pure.
    """
    if cfg.family != "qwen3_next":
        raise ValueError(f"training_forward supports qwen3_next models, got {cfg.family!r}")
    if gdn_form not in GDN_FORMS:
        raise ValueError(f"unknown gdn_form {gdn_form!r}; expected one of {sorted(GDN_FORMS)}")
    form = {"form": GDN_FORMS[gdn_form], "chunk_size": chunk_size}
    return run_reference(decoder(cfg), cfg, params, tokens, **form)


def mtp_next_tokens(tokens: jax.Array) -> jax.Array:
    """The MTP's token input: ``tokens[:, t + 1]`` at position t (the last one repeated)."""
    return jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)


def mtp_training_hidden(
    params: Params, cfg: ModelConfig, hidden: jax.Array, tokens: jax.Array
) -> jax.Array:
    """The MTP layer's output (before ``mtp.norm``) at every position ``[B, T, hidden]``.

    Position t reads ``(hidden[t], embed(tokens[t + 1]))`` and attends causally over MTP
    positions ``<= t``, as ``qwen3_next.mtp_forward`` does over its KV pool. The last
    position's token input is a repeat and its output is never scored.
    """
    if "mtp" not in params:
        raise ValueError(
            "these params have no MTP head: build the config with num_nextn_predict_layers=1"
        )
    mp = params["mtp"]
    embeds = params["embed_tokens"][mtp_next_tokens(tokens)]
    combined = jnp.concatenate(
        [
            norm(embeds, mp["pre_fc_norm_embedding"], cfg),
            norm(hidden.astype(embeds.dtype), mp["pre_fc_norm_hidden"], cfg),
        ],
        axis=-1,
    )
    x = linear(mp["fc"], combined)
    draft, kinds = decoder(cfg), ("attention", cfg.arch.mtp_mlp_kind)
    with jax.named_scope("mtp_layer"):
        x, out = decoder_layer(draft, mp["layers"][0], kinds, x, None, reference_step(cfg, tokens))
        return add(draft.stream, x, out)


def token_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean of ``-log softmax(logits)[target]`` over every position (float32)."""
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


def lm_loss(params: Params, cfg: ModelConfig, hidden: jax.Array, tokens: jax.Array) -> jax.Array:
    """Next-token loss: logits at t predict ``tokens[t + 1]`` (t < T - 1)."""
    logits = compute_logits(params, cfg, hidden[:, :-1])
    return token_cross_entropy(logits, tokens[:, 1:])


def mtp_loss(params: Params, cfg: ModelConfig, hidden: jax.Array, tokens: jax.Array) -> jax.Array:
    """MTP loss: the head's logits at t predict ``tokens[t + 2]`` (t < T - 2)."""
    mtp_hidden = mtp_training_hidden(params, cfg, hidden, tokens)
    logits = compute_mtp_logits(params, cfg, mtp_hidden[:, :-2])
    return token_cross_entropy(logits, tokens[:, 2:])


def total_loss(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,
    *,
    mtp_weight: float = DEFAULT_MTP_WEIGHT,
    compute_dtype: Any = None,
    gdn_form: str = "chunked",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``lm + mtp_weight * mtp`` and the parts ``{"loss", "lm", "mtp"}``.

    With ``compute_dtype`` the matmuls run in that dtype (``cast_for_compute``); params
    without an MTP head give ``mtp = 0``.
    """
    if tokens.shape[1] < 3:
        raise ValueError(f"sequences need at least 3 tokens for the MTP loss, got {tokens.shape}")
    run = params if compute_dtype is None else cast_for_compute(params, compute_dtype)
    hidden = training_forward(run, cfg, tokens, gdn_form=gdn_form)
    lm = lm_loss(run, cfg, hidden, tokens)
    mtp = mtp_loss(run, cfg, hidden, tokens) if "mtp" in run else jnp.zeros((), jnp.float32)
    loss = lm + mtp_weight * mtp
    return loss, {"loss": loss, "lm": lm, "mtp": mtp}


# ---------------------------------------------------------------- optimisation


def make_optimizer(
    learning_rate: float,
    num_steps: int,
    *,
    warmup_steps: int = 200,
    weight_decay: float = 0.1,
    clip_norm: float = 1.0,
    final_fraction: float = 0.1,
) -> optax.GradientTransformation:
    """AdamW (b2 = 0.95) with linear warm-up then cosine decay, after global-norm clipping.

    Weight decay applies to matrices only (norm weights, gates and biases are exempt).
    """
    if learning_rate <= 0 or num_steps <= 0:
        raise ValueError(f"learning_rate={learning_rate} and num_steps={num_steps} must be > 0")
    warmup_steps = max(1, min(warmup_steps, num_steps // 2))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        learning_rate,
        warmup_steps,
        max(num_steps, warmup_steps + 1),
        end_value=learning_rate * final_fraction,
    )
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(clip_norm),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=decay_mask),
    )


def make_train_step(
    cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    *,
    mtp_weight: float = DEFAULT_MTP_WEIGHT,
    compute_dtype: Any = None,
    gdn_form: str = "chunked",
):
    """A jitted ``(params, opt_state, tokens) -> (params, opt_state, metrics)``.

    ``params`` and ``opt_state`` are donated; ``metrics`` holds the loss parts and the
    gradient's global norm (before clipping).
    """

    loss = _loss_of(cfg, mtp_weight, compute_dtype, gdn_form)

    def step(params, opt_state, tokens):
        (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, dict(metrics, grad_norm=optax.tree.norm(grads))

    return jax.jit(step, donate_argnums=(0, 1))


def make_eval_step(
    cfg: ModelConfig,
    *,
    mtp_weight: float = DEFAULT_MTP_WEIGHT,
    compute_dtype: Any = None,
    gdn_form: str = "chunked",
):
    """A jitted ``(params, tokens) -> metrics`` (the loss parts, no update)."""

    loss = _loss_of(cfg, mtp_weight, compute_dtype, gdn_form)
    return jax.jit(lambda params, tokens: loss(params, tokens)[1])


def _loss_of(cfg: ModelConfig, mtp_weight: float, compute_dtype: Any, gdn_form: str):
    """``total_loss`` of ``cfg`` with these settings, as ``(params, tokens) -> (loss,
    metrics)``."""

    def loss(params, tokens):
        return total_loss(
            params,
            cfg,
            tokens,
            mtp_weight=mtp_weight,
            compute_dtype=compute_dtype,
            gdn_form=gdn_form,
        )

    return loss


# ---------------------------------------------------------------- data and evaluation


def sample_windows(
    tokens: np.ndarray, num_windows: int, seq_len: int, rng: np.random.Generator
) -> np.ndarray:
    """``num_windows`` random windows ``[num_windows, seq_len]`` (int32) of a token stream."""
    if tokens.size < seq_len:
        raise ValueError(
            f"the token stream ({tokens.size} tokens) is shorter than seq_len={seq_len}"
        )
    starts = rng.integers(0, tokens.size - seq_len + 1, num_windows)
    return tokens[starts[:, None] + np.arange(seq_len)].astype(np.int32)


def validation_windows(tokens: np.ndarray, seq_len: int, max_windows: int) -> np.ndarray:
    """Consecutive non-overlapping windows from the start of ``tokens`` (at most
    ``max_windows``): a fixed evaluation set ``[N, seq_len]`` (int32)."""
    count = min(tokens.size // seq_len, max_windows)
    if count == 0:
        raise ValueError(
            f"the validation stream ({tokens.size} tokens) is shorter than seq_len={seq_len}"
        )
    return tokens[: count * seq_len].reshape(count, seq_len).astype(np.int32)


def evaluate(eval_step, params: Params, windows: np.ndarray, batch_size: int) -> dict[str, float]:
    """Mean loss parts over the full batches of ``windows`` (a partial last batch is left
    out so one shape is compiled; fewer windows than ``batch_size`` form one batch)."""
    size = min(batch_size, windows.shape[0])
    num_batches = windows.shape[0] // size
    totals: dict[str, float] = {}
    for b in range(num_batches):
        metrics = eval_step(params, jnp.asarray(windows[b * size : (b + 1) * size]))
        for key, value in metrics.items():
            totals[key] = totals.get(key, 0.0) + float(value)
    return {key: value / num_batches for key, value in totals.items()}


def unigram_baseline(train: np.ndarray, val: np.ndarray, vocab_size: int) -> dict[str, float]:
    """The train-token unigram model (add-one smoothed): its entropy and its cross-entropy
    on the validation tokens, both in nats/token."""
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1.0
    probs = counts / counts.sum()
    return {
        "train_entropy": float(-np.sum(probs * np.log(probs))),
        "val_cross_entropy": float(-np.mean(np.log(probs[val]))),
    }
