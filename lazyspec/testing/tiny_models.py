"""Tiny random-weight models (no torch needed) and their cache-free greedy oracle."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from lazyspec.models.registry import family_module, parse_hf_config
from lazyspec.scheduler.request import SamplingParams

# the widths every tiny config shares
TINY_WIDTHS = dict(
    vocab_size=128,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    eos_token_id=2,
    max_position_embeddings=4096,
)

NEMOTRON_HF = dict(
    TINY_WIDTHS,
    model_type="nemotron_h",
    head_dim=8,
    intermediate_size=48,
    mamba_num_heads=4,
    mamba_head_dim=8,
    ssm_state_size=16,
    n_groups=2,
    conv_kernel=4,
    chunk_size=64,
    layer_norm_epsilon=1e-5,
    layers_block_type=["mamba", "attention", "mamba", "mlp"],
)


QWEN_HF = dict(
    TINY_WIDTHS,
    model_type="qwen3_next",
    intermediate_size=48,
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    head_dim=16,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=32,
    rms_norm_eps=1e-6,
    num_nextn_predict_layers=1,
    partial_rotary_factor=0.25,
    rope_theta=10000.0,
)


# Near unit-gain weights: at init_params' default 0.02 the residual stream is little more
# than the embedding and greedy output would not depend on the context (nor on the cache).
GRANITE_INIT_SCALE = 0.2
GRANITE_HF = dict(
    TINY_WIDTHS,
    model_type="granitemoehybrid",
    intermediate_size=24,
    shared_intermediate_size=40,
    num_hidden_layers=3,
    layer_types=["mamba", "attention", "mamba"],
    mamba_n_heads=4,
    mamba_d_head=16,
    mamba_d_state=16,
    mamba_n_groups=1,
    mamba_d_conv=4,
    mamba_expand=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    rms_norm_eps=1e-5,
    embedding_multiplier=2.0,
    residual_multiplier=0.5,
    attention_multiplier=0.125,
    logits_scaling=4.0,
    position_embedding_type="nope",
    tie_word_embeddings=False,
)


QWEN35_HF = dict(
    {k: v for k, v in QWEN_HF.items() if k not in ("num_nextn_predict_layers", "rope_theta")},
    model_type="qwen3_5_moe_text",
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 0]},
    mtp_num_hidden_layers=1,
)


# family -> its tiny config
TINY_HF = {
    "nemotron_h": NEMOTRON_HF,
    "qwen3_next": QWEN_HF,
    "granitemoehybrid": GRANITE_HF,
    "qwen3_5": QWEN35_HF,
}


def build_tiny_model(hf: dict, seed: int = 0) -> SimpleNamespace:
    """A random-weight model of the HF config ``hf`` (Granite's at ``GRANITE_INIT_SCALE``),
    built anew on every call: a config of its own has programs of its own to compile."""
    cfg = parse_hf_config(dict(hf))
    module = family_module(cfg.family)
    kw = {"scale": GRANITE_INIT_SCALE} if cfg.family == "granitemoehybrid" else {}
    params = module.init_params(cfg, jax.random.PRNGKey(seed), **kw)
    return SimpleNamespace(config=cfg, params=params, tokenizer=None, family=module)


@functools.cache
def tiny_model(family: str = "nemotron_h", seed: int = 0):
    """A random-weight tiny model of ``family`` (``TINY_HF``; the Qwen3-Next and Qwen3.5
    ones, MoE, have an MTP head), one per (family, seed)."""
    if family not in TINY_HF:
        raise ValueError(family)
    return build_tiny_model(TINY_HF[family], seed)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _logits_at(family, cfg, params, tokens, index):
    hidden = family.reference_forward(params, cfg, tokens)
    return family.compute_logits(params, cfg, hidden[:, index])


# the prefill chunk and checkpoint interval of the tiny engines that tests size themselves
TINY_CHUNKS = dict(mamba_track_interval=64, chunked_prefill_size=64)


# ``small_engine``'s settings: room for a few requests of a tiny model
SMALL_ENGINE = dict(
    mamba_track_interval=16,
    mamba_chunk_size=16,
    chunked_prefill_size=64,
    max_running_requests=4,
    max_total_tokens=4096,
    context_length=256,
    skip_warmup=True,
)


# speculation as the engine tests run it: the MTP head drafting three tokens
SPEC = dict(speculative_algorithm="NEXTN", speculative_num_steps=3)


def small_engine(
    model, strategy: str = "extra_buffer", overlap: bool = True, spec: bool = False, **settings
):
    """An ``Engine`` of ``model`` with ``SMALL_ENGINE``'s settings, the checkpoint
    ``strategy``, the overlapped loop on or off and ``SPEC``'s speculation with ``spec``;
    ``settings`` add to them or replace them."""
    from lazyspec.engine.engine import Engine  # the engine imports the models, not this

    return Engine(
        model=model,
        mamba_scheduler_strategy=strategy,
        disable_overlap_schedule=not overlap,
        **{**SMALL_ENGINE, **(SPEC if spec else {}), **settings},
    )


def serve_greedy_lengths(engine, prompt: list[int], lengths, check=None) -> list:
    """``prompt`` served once per length in ``lengths`` on ``engine``, all queued at once,
    greedy with EOS ignored for that many new tokens (``check`` as ``run_until_done``'s);
    the finished requests, in ``lengths``' order."""
    reqs = [
        engine.add_request(
            input_ids=prompt, sampling_params={"max_new_tokens": n, "ignore_eos": True}
        )
        for n in lengths
    ]
    engine.run_until_done(reqs, check=check)
    return reqs


def reference_greedy(
    model, prompt: list[int], num_new: int, pad_len: int = 512
) -> tuple[list[int], list[float]]:
    """Greedy continuation by full cache-free recompute (the oracle), with logprobs."""
    ids = list(prompt)
    out, logprobs = [], []
    for _ in range(num_new):
        tokens = np.zeros((1, pad_len), np.int32)
        tokens[0, : len(ids)] = ids
        index = len(ids) - 1
        logits = _logits_at(model.family, model.config, model.params, jnp.asarray(tokens), index)
        logits = np.asarray(logits)[0]
        token = int(np.argmax(logits))
        logp = logits - np.max(logits)
        logp = logp - np.log(np.sum(np.exp(logp)))
        out.append(token)
        logprobs.append(float(logp[token]))
        ids.append(token)
    return out, logprobs


def processed_logits_reference(
    logits: np.ndarray,
    sampling: SamplingParams,
    prompt: list[int],
    outputs: list[int],
    eos_ids: tuple[int, ...],
) -> np.ndarray:
    """One position's logits [V] processed as the device does, in numpy float32: the
    repetition penalty over the tokens of ``prompt`` and ``outputs`` (the outputs before
    this position), frequency / presence penalties over ``outputs``, the logit bias, then
    the EOS / stop ids at -1e30 while fewer than ``min_new_tokens`` are out."""
    logits = np.array(logits, np.float32)
    counts = np.bincount(np.asarray(outputs, np.int64), minlength=logits.size)
    seen = counts > 0
    seen[np.asarray(prompt, np.int64)] = True
    p = np.float32(sampling.repetition_penalty)
    logits = np.where(seen, np.where(logits > 0, logits / p, logits * p), logits)
    logits = logits - np.float32(sampling.frequency_penalty) * counts.astype(np.float32)
    logits = logits - np.float32(sampling.presence_penalty) * (counts > 0).astype(np.float32)
    for token, bias in sampling.logit_bias:
        logits[token] += np.float32(bias)
    if len(outputs) < sampling.min_new_tokens:
        logits[[*eos_ids, *sampling.stop_token_ids]] = -1e30
    return logits.astype(np.float32)


def reference_processed_greedy(
    model, prompt: list[int], sampling: SamplingParams, pad_len: int = 256
) -> list[int]:
    """Greedy by full cache-free recompute on the processed logits
    (``processed_logits_reference``), stopping as the engine does: at an EOS id (unless
    ``ignore_eos``), a stop id, or ``max_new_tokens``."""
    eos_ids = tuple(model.config.eos_token_ids)
    ids, out = list(prompt), []
    for _ in range(sampling.max_new_tokens):
        tokens = np.zeros((1, pad_len), np.int32)
        tokens[0, : len(ids)] = ids
        index = len(ids) - 1
        logits = _logits_at(model.family, model.config, model.params, jnp.asarray(tokens), index)
        logits = processed_logits_reference(np.asarray(logits)[0], sampling, prompt, out, eos_ids)
        token = int(np.argmax(logits))
        out.append(token)
        ids.append(token)
        if token in sampling.stop_token_ids or (not sampling.ignore_eos and token in eos_ids):
            break
    return out
