"""The Granite 4.0-H family (GraniteMoeHybridForCausalLM): Mamba2 or attention, then MoE.

Every layer is ``h = h + r * mixer(norm(h)); h = h + r * ffn(norm(h))`` with plain RMSNorms
and the residual multiplier ``r``. The mixer is a Mamba2 mixer (``layers/mamba2.py``) or GQA
attention (``layers/attention.py``) whose softmax scale is ``attention_multiplier`` and which
has rotary embedding only when ``position_embedding_type`` is "rope" (Granite 4.0-H: none).
The ffn is a shared SwiGLU MLP plus, when the config has experts, softmax-top-k routed
SwiGLU experts (``layers/moe.routed_experts``); dense variants (no experts) run the shared
MLP alone. Embeddings are scaled by ``embedding_multiplier`` and logits divided by
``logits_scaling``. No MTP head.

The module exposes the family contract of ``interface.py``: ``parse_config``,
``load_params`` and ``init_params`` (from ``granite_params``), ``forward``,
``reference_forward`` and ``compute_logits``.

Params (HF module names, linears as in ``layers/mlp.linear``): ``{"embed_tokens": [V, D],
"norm": [D], "lm_head": linear (absent when tied), "layers": [{"input_layernorm",
"post_attention_layernorm", "mamba" | "self_attn", "shared_mlp", "block_sparse_moe" (with
experts)}, ...]}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from lazyspec.kernels.backend import XLA_KERNELS, Kernels
from lazyspec.models.config import (
    ATTENTION,
    RECURRENT,
    ModelConfig,
    eos_ids,
    require,
    time_step_limit,
)
from lazyspec.models.granite_params import (  # noqa: F401 (family API)
    init_params,
    load_params,
    weight_plan,
)
from lazyspec.models.interface import (
    ForwardInputs,
    KVPools,
    LayerStates,
    PoolView,
    RecurrentOut,
    StateRows,
    after_layer,
    for_mode,
    keep_chunk_states,
    real_tokens,
    recurrent_out,
)
from lazyspec.models.layers.attention import (
    AttentionSpec,
    attention_forward,
    attention_reference,
)
from lazyspec.models.layers.linear import linear
from lazyspec.models.layers.mamba2 import Mamba2Dims, mamba2_mixer
from lazyspec.models.layers.mlp import swiglu_mlp
from lazyspec.models.layers.moe import MoESpec, routed_experts
from lazyspec.models.layers.norms import rms_norm
from lazyspec.models.plan import Params

FAMILY = "granitemoehybrid"
MODES = ("extend", "decode", "verify")
# layer_types names: transformers' current ones and the legacy ones of released configs.
_ROLES = {
    "linear_attention": RECURRENT,
    "mamba": RECURRENT,
    "full_attention": ATTENTION,
    "attention": ATTENTION,
}


@dataclass(frozen=True)
class GraniteArch:
    """Granite 4.0-H details beyond ModelConfig (``ModelConfig.arch``)."""

    rms_norm_eps: float
    mamba: Mamba2Dims | None  # None without Mamba2 layers
    attention: AttentionSpec | None  # None without attention layers
    moe: MoESpec | None  # None for dense variants (num_local_experts == 0)
    shared_intermediate_size: int
    mamba_bias: bool  # in_proj / out_proj biases
    conv_bias: bool
    embedding_multiplier: float
    residual_multiplier: float
    logits_scaling: float


# ---------------------------------------------------------------- config


def _layer_roles(hf: dict[str, Any]) -> tuple[str, ...]:
    """Roles from ``layer_types`` (or ``layers_block_type``); all Mamba2 when absent."""
    num_layers = int(require(hf, "num_hidden_layers", FAMILY))
    types = hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * num_layers
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries, num_hidden_layers={num_layers}")
    unknown = sorted(set(types) - set(_ROLES))
    if unknown:
        raise ValueError(f"unknown Granite layer_types {unknown}; expected {sorted(_ROLES)}")
    return tuple(_ROLES[t] for t in types)


def _mamba_dims(hf: dict[str, Any], hidden: int, eps: float) -> Mamba2Dims:
    heads = int(require(hf, "mamba_n_heads", FAMILY))
    inner = int(hf.get("mamba_expand", 2)) * hidden
    head_dim = hf.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim in (None, "auto") else int(head_dim)
    low, high = time_step_limit(hf.get("time_step_limit"))
    dims = Mamba2Dims(
        hidden_size=hidden,
        num_heads=heads,
        head_dim=head_dim,
        state_size=int(require(hf, "mamba_d_state", FAMILY)),
        n_groups=int(hf.get("mamba_n_groups", 1)),
        conv_kernel=int(hf.get("mamba_d_conv", 4)),
        norm_eps=eps,
        dt_min=low,
        dt_max=high,
    )
    if heads * head_dim != inner or heads % dims.n_groups:
        raise ValueError(
            f"mamba_n_heads {heads} x mamba_d_head {head_dim} must equal mamba_expand * "
            f"hidden_size {inner}, and mamba_n_groups {dims.n_groups} divide the heads"
        )
    return dims


def _attention_spec(hf: dict[str, Any], hidden: int, eps: float) -> AttentionSpec:
    heads = int(require(hf, "num_attention_heads", FAMILY))
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads {heads} not divisible by {kv_heads} KV heads")
    head_dim = int(hf.get("head_dim") or hidden // heads)
    position = hf.get("position_embedding_type")
    if position not in (None, "nope", "rope"):
        raise ValueError(f"unsupported position_embedding_type {position!r}; None, nope or rope")
    rope = dict(hf.get("rope_scaling") or {})
    rope.update(hf.get("rope_parameters") or {})
    if position == "rope" and rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"unsupported rope_type {rope.get('rope_type')!r}; only 'default'")
    return AttentionSpec(
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rotary_dim=head_dim if position == "rope" else 0,
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=eps,
        bias=bool(hf.get("attention_bias", False)),
        scaling=float(hf.get("attention_multiplier", 1.0)),
    )


def _moe_spec(hf: dict[str, Any], hidden: int, shared: int) -> MoESpec | None:
    num_experts = int(require(hf, "num_local_experts", FAMILY))
    if num_experts == 0:
        return None
    top_k = int(hf.get("num_experts_per_tok", 2))
    if not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be in 1..{num_experts}")
    return MoESpec(
        hidden_size=hidden,
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=int(require(hf, "intermediate_size", FAMILY)),
        shared_intermediate_size=shared,
        norm_topk_prob=True,  # softmax over the top-k logits
    )


def parse_config(hf: dict[str, Any]) -> ModelConfig:
    """A Granite 4.0-H ``config.json`` dict -> ModelConfig; ValueError names a missing field."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {hf.get('hidden_act')!r}; only 'silu'")
    hidden = int(require(hf, "hidden_size", FAMILY))
    eps = float(hf.get("rms_norm_eps", 1e-6))
    roles = _layer_roles(hf)
    mamba = _mamba_dims(hf, hidden, eps) if RECURRENT in roles else None
    attention = _attention_spec(hf, hidden, eps) if ATTENTION in roles else None
    shared = int(require(hf, "shared_intermediate_size", FAMILY))
    arch = GraniteArch(
        rms_norm_eps=eps,
        mamba=mamba,
        attention=attention,
        moe=_moe_spec(hf, hidden, shared),
        shared_intermediate_size=shared,
        mamba_bias=bool(hf.get("mamba_proj_bias", False)),
        conv_bias=bool(hf.get("mamba_conv_bias", True)),
        embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
        logits_scaling=float(hf.get("logits_scaling", 1.0)),
    )
    return ModelConfig(
        family=FAMILY,
        vocab_size=int(require(hf, "vocab_size", FAMILY)),
        hidden_size=hidden,
        layer_roles=roles,
        num_attention_heads=attention.num_heads if attention else 0,
        num_kv_heads=attention.num_kv_heads if attention else 0,
        head_dim=attention.head_dim if attention else 0,
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        conv_dim=mamba.conv_dim if mamba else 0,
        conv_kernel=mamba.conv_kernel if mamba else 1,
        ssm_heads=mamba.num_heads if mamba else 0,
        ssm_dim_a=mamba.head_dim if mamba else 0,
        ssm_dim_b=mamba.state_size if mamba else 0,
        eos_token_ids=eos_ids(hf),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        num_mtp_layers=0,
        arch=arch,
    )


# ---------------------------------------------------------------- forward passes


def _ffn(
    lp: Params, cfg: ModelConfig, x: jax.Array, kernels: Kernels, real: jax.Array | None
) -> jax.Array:
    """Shared MLP plus (with experts) the routed experts, for x ``[..., D]``; those run in
    ``kernels.moe_experts`` when it has one, padding tokens (``real``) routed like token 0."""
    out = swiglu_mlp(lp["shared_mlp"], x)
    if "block_sparse_moe" in lp:
        flat = x.reshape(-1, x.shape[-1])
        moe = routed_experts(lp["block_sparse_moe"], cfg.arch.moe, flat, kernels.moe_experts, real)
        out = out + moe.reshape(x.shape)
    return out


def _run_layers(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,
    mamba_fn,
    attention_fn,
    kernels: Kernels = XLA_KERNELS,
    real: jax.Array | None = None,
):
    """Embed, then every layer; the mixers go through the two callbacks ``(params, x)``;
    ``real`` as in ``_ffn``."""
    arch: GraniteArch = cfg.arch
    eps, residual = arch.rms_norm_eps, arch.residual_multiplier
    h = params["embed_tokens"][tokens] * arch.embedding_multiplier
    for i, role in enumerate(cfg.layer_roles):
        lp = params["layers"][i]
        with jax.named_scope(f"layer{i}_{'mamba' if role == RECURRENT else 'attention'}"):
            x = rms_norm(h, lp["input_layernorm"], eps)
            if role == RECURRENT:
                out = mamba_fn(lp["mamba"], x)
            else:
                out = attention_fn(lp["self_attn"], x)
            h = h + out.astype(h.dtype) * residual
            out = _ffn(lp, cfg, rms_norm(h, lp["post_attention_layernorm"], eps), kernels, real)
            h = h + out.astype(h.dtype) * residual
    return h


def forward(
    params: Params,
    cfg: ModelConfig,
    inputs: ForwardInputs,
    kv: KVPools,
    rec: StateRows | PoolView,
    *,
    mode: str,
    chunk_size: int = 64,
    kernels: Kernels = XLA_KERNELS,
    keep_chunk: jax.Array | None = None,
) -> tuple[jax.Array, KVPools, RecurrentOut]:
    """The device contract of ``interface.py``: (hidden before the final norm, kv, states).

    ``extend`` runs the chunked Mamba2 form (``RecurrentOut.chunks``: the state after every
    ``chunk_size`` new tokens of the row, or only ``keep_chunk``'s); ``decode`` / ``verify``
    the T-step form (``verify`` also fills ``RecurrentOut.steps``), whose SSM update runs in
    ``kernels.mamba2_state_update``, the attention in ``kernels.paged_attention`` and the
    routed experts in ``kernels.moe_experts`` when it has them. ``decode`` from a
    ``PoolView`` writes each layer's new state into the pools (``RecurrentOut.pools``).
    Pure: returns new pools.
    """
    if mode not in MODES:
        raise ValueError(f"unknown forward mode {mode!r}; expected one of {MODES}")
    arch: GraniteArch = cfg.arch
    form = "chunked" if mode == "extend" else "steps"
    k_pools, v_pools, states = list(kv.k), list(kv.v), []
    attention_ids = iter(range(len(k_pools)))
    view = for_mode(rec, mode)  # in decode from pools: as the layers so far wrote them

    def mamba_fn(mixer, x):
        nonlocal view
        r = len(states)
        out, st = mamba2_mixer(
            mixer,
            arch.mamba,
            x,
            *view.layer(r),
            inputs.num_new,
            form=form,
            chunk_size=chunk_size,
            state_update=kernels.mamba2_state_update,
            conv_update=kernels.conv_update,
        )
        conv_trace, ssm_trace = st.trace_conv, st.trace_ssm
        if mode == "extend":
            conv_trace = keep_chunk_states(conv_trace, keep_chunk)
            ssm_trace = keep_chunk_states(ssm_trace, keep_chunk)
        states.append(LayerStates(st.conv, st.ssm, conv_trace, ssm_trace))
        view = after_layer(view, r, st.conv, st.ssm, st.ssm_pool, st.conv_pool)
        return out

    def attention_fn(mixer, x):
        a = next(attention_ids)
        out, k_pools[a], v_pools[a] = attention_forward(
            mixer,
            arch.attention,
            x,
            inputs.positions,
            inputs.num_new,
            inputs.kv_write_idx,
            inputs.kv_read_idx,
            inputs.ctx_len,
            k_pools[a],
            v_pools[a],
            kernels.paged_attention,
            kernels.attention_prologue,
        )
        return out

    hidden = _run_layers(
        params, cfg, inputs.tokens, mamba_fn, attention_fn, kernels, real_tokens(inputs)
    )
    return hidden, KVPools(k=k_pools, v=v_pools), recurrent_out(states, view, mode)


def reference_forward(params: Params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Whole sequences ``[B, T]`` from empty states with no cache machinery: token-by-token
    Mamba2 scans and dense causal attention. Returns the hidden stream before the final norm
    ``[B, T, D]``."""
    arch: GraniteArch = cfg.arch
    batch, num_tokens = tokens.shape
    num_new = jnp.full((batch,), num_tokens, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32), (batch, num_tokens))

    def mamba_fn(mixer, x):
        dims = arch.mamba
        conv0 = jnp.zeros((batch, dims.conv_dim, dims.conv_kernel - 1), jnp.float32)
        ssm0 = jnp.zeros((batch, dims.num_heads, dims.head_dim, dims.state_size), jnp.float32)
        return mamba2_mixer(mixer, dims, x, conv0, ssm0, num_new, form="reference")[0]

    def attention_fn(mixer, x):
        return attention_reference(mixer, arch.attention, x, positions)

    return _run_layers(params, cfg, tokens, mamba_fn, attention_fn)


def compute_logits(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Final RMSNorm, lm_head (the embedding when tied), then ``/ logits_scaling``: float32
    ``[..., V]``."""
    x = rms_norm(hidden, params["norm"], cfg.arch.rms_norm_eps)
    if "lm_head" in params:
        logits = linear(params["lm_head"], x).astype(jnp.float32)
    else:
        embed = params["embed_tokens"]
        logits = jnp.matmul(x.astype(embed.dtype), embed.T).astype(jnp.float32)
    return logits / cfg.arch.logits_scaling
