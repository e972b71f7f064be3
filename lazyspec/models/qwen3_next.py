"""The Qwen3-Next family (Qwen3NextForCausalLM): Gated DeltaNet + gated attention + MoE.

Every layer is ``x = x + mixer(norm(x)); x = x + mlp(norm(x))`` with zero-centred RMSNorms
(scale ``1 + w``); the mixer is a GDN layer (``layers/gdn.py``) or gated full attention with
q/k norms and partial RoPE (``layers/attention.py``); the MLP is a sparse MoE with a shared
expert (``layers/moe.py``) or a dense SwiGLU MLP. The optional MTP head (``mtp.*``) is one
more attention decoder layer fed ``fc([norm(embed(next_token)), norm(hidden)])``.

The module exposes the family contract of ``interface.py``: ``parse_config``,
``load_params``, ``init_params``, ``forward``, ``reference_forward``, ``compute_logits``,
``mtp_forward``, ``compute_mtp_logits`` and ``lm_head_columns`` (the draft head's reduced
lm_head of a speculative token map).

Params (HF module names, linears as in ``layers/mlp.linear``): ``{"embed_tokens": [V, H],
"norm": [H], "lm_head": linear (absent when tied), "layers": [{"input_layernorm",
"post_attention_layernorm", "linear_attn" | "self_attn", "mlp"}, ...], "mtp": {...}}``.
"""

from __future__ import annotations

import functools
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
    layer_roles,
    pool_sizes,
    require,
)
from lazyspec.models.decoder import (
    Decoder,
    Mixer,
    Mlp,
    Step,
    attention_mixer,
    decoder_layer,
    family_forwards,
)
from lazyspec.models.interface import (
    ForwardInputs,
    KVPools,
    LayerStates,
    real_tokens,
)
from lazyspec.models.layers.attention import AttentionSpec, attention_plan
from lazyspec.models.layers.gdn import GDNSpec, gdn_mixer, gdn_plan
from lazyspec.models.layers.linear import linear
from lazyspec.models.layers.mlp import mlp_plan, swiglu_mlp
from lazyspec.models.layers.moe import MoESpec, moe_plan, sparse_moe
from lazyspec.models.layers.residual import ResidualStream, add
from lazyspec.models.plan import Params, Placement, TensorSpec, init_plan, linear_spec, load_plan

FAMILY = "qwen3_next"
MTP_PROBE = "mtp.fc.weight"  # present in checkpoints that ship the MTP head
_ROLES = {"linear_attention": RECURRENT, "full_attention": ATTENTION}


# ---------------------------------------------------------------- config


@dataclass(frozen=True)
class Qwen3NextArch:
    """Qwen3-Next details beyond ModelConfig (``ModelConfig.arch``)."""

    rms_norm_eps: float
    attention: AttentionSpec
    gdn: GDNSpec
    moe: MoESpec | None  # None when num_experts == 0
    intermediate_size: int  # dense MLP width
    mlp_kinds: tuple[str, ...]  # "moe" | "dense" per layer
    mtp_mlp_kind: str  # the MTP layer's MLP: "moe" whenever the model has experts


def _layer_roles(hf: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """Roles from ``layer_types``, else transformers' ``full_attention_interval`` rule."""
    types = hf.get("layer_types")
    if types is None:
        interval = int(hf.get("full_attention_interval", 4))
        types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(num_layers)
        ]
    return layer_roles(types, num_layers, _ROLES)


def _mlp_kinds(hf: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """ "moe" unless in mlp_only_layers, off the decoder_sparse_step grid, or no experts."""
    num_experts = int(require(hf, "num_experts", FAMILY))
    mlp_only = set(hf.get("mlp_only_layers") or [])
    step = int(hf.get("decoder_sparse_step", 1))
    return tuple(
        "moe" if i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 else "dense"
        for i in range(num_layers)
    )


def _rope(hf: dict[str, Any], head_dim: int) -> tuple[float, int]:
    """(theta, rotary_dim) from ``rope_parameters`` or the older top-level fields."""
    rope = dict(hf.get("rope_scaling") or {})
    rope.update(hf.get("rope_parameters") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"unsupported rope_type {rope_type!r}; only 'default' is implemented")
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    factor = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)))
    return theta, int(head_dim * factor)


def _moe_spec(hf: dict[str, Any], hidden: int) -> MoESpec | None:
    if int(require(hf, "num_experts", FAMILY)) == 0:
        return None
    return MoESpec(
        hidden_size=hidden,
        num_experts=int(hf["num_experts"]),
        top_k=int(require(hf, "num_experts_per_tok", FAMILY)),
        intermediate_size=int(require(hf, "moe_intermediate_size", FAMILY)),
        shared_intermediate_size=int(require(hf, "shared_expert_intermediate_size", FAMILY)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
    )


def parse_config(hf: dict[str, Any]) -> ModelConfig:
    """A Qwen3-Next ``config.json`` dict -> ModelConfig; ValueError names a missing field."""
    num_layers = int(require(hf, "num_hidden_layers", FAMILY))
    kinds = _mlp_kinds(hf, num_layers)
    return build_config(
        hf,
        family=FAMILY,
        mlp_kinds=kinds,
        moe=_moe_spec(hf, int(require(hf, "hidden_size", FAMILY))),
        mtp_mlp_kind="moe" if int(hf["num_experts"]) > 0 else "dense",
        num_mtp_layers=int(hf.get("num_nextn_predict_layers") or 0),
    )


def build_config(
    hf: dict[str, Any],
    *,
    family: str,
    mlp_kinds: tuple[str, ...],
    moe: MoESpec | None,
    mtp_mlp_kind: str,
    num_mtp_layers: int,
    split_projections: bool = False,
    tie_word_embeddings: bool | None = None,
) -> ModelConfig:
    """The ModelConfig of a Qwen3-Next-style text model (``hf`` its text config dict).

    The caller decides what differs between the families built on this one: the MLP kind
    of every layer, the MoE spec, the MTP head, the GDN projection layout, and the tying of
    embeddings when the outer config owns it (None: ``hf``'s own field).
    """
    req = lambda key: require(hf, key, family)  # noqa: E731
    if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias", False):
        raise ValueError(f"unsupported hidden_act={hf.get('hidden_act')!r} / attention_bias")
    hidden, num_layers = int(req("hidden_size")), int(req("num_hidden_layers"))
    heads, kv_heads = int(req("num_attention_heads")), int(req("num_key_value_heads"))
    head_dim = int(hf.get("head_dim") or hidden // heads)
    eps = float(hf.get("rms_norm_eps", 1e-6))
    theta, rotary_dim = _rope(hf, head_dim)
    attention = AttentionSpec(
        heads,
        kv_heads,
        head_dim,
        rotary_dim,
        theta,
        qk_norm=True,
        zero_centered_qk_norm=True,
        output_gate=True,
        norm_eps=eps,
    )
    gdn = GDNSpec(
        hidden,
        int(req("linear_num_key_heads")),
        int(req("linear_num_value_heads")),
        int(req("linear_key_head_dim")),
        int(req("linear_value_head_dim")),
        int(hf.get("linear_conv_kernel_dim", 4)),
        eps,
        split_projections=split_projections,
    )
    if heads % kv_heads or gdn.num_v_heads % gdn.num_k_heads:
        raise ValueError(
            f"head counts do not divide: {heads}/{kv_heads}, {gdn.num_v_heads}/{gdn.num_k_heads}"
        )
    arch = Qwen3NextArch(
        rms_norm_eps=eps,
        attention=attention,
        gdn=gdn,
        moe=moe,
        intermediate_size=int(req("intermediate_size")) if "dense" in mlp_kinds else 0,
        mlp_kinds=mlp_kinds,
        mtp_mlp_kind=mtp_mlp_kind,
    )
    if tie_word_embeddings is None:
        tie_word_embeddings = bool(hf.get("tie_word_embeddings", False))
    return ModelConfig(
        family=family,
        vocab_size=int(req("vocab_size")),
        hidden_size=hidden,
        layer_roles=_layer_roles(hf, num_layers),
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
        **pool_sizes(attention, gdn),
        eos_token_ids=eos_ids(hf),
        tie_word_embeddings=tie_word_embeddings,
        num_mtp_layers=num_mtp_layers,
        arch=arch,
    )


# ---------------------------------------------------------------- checkpoint plans


def _norm_spec(name: str, size: int) -> TensorSpec:
    return TensorSpec(f"{name}.weight", (size,), init="zeros")  # zero-centred: scale 1 + w


def _layer_plan(cfg: ModelConfig, prefix: str, recurrent: bool, mlp_kind: str) -> Params:
    arch: Qwen3NextArch = cfg.arch
    h = cfg.hidden_size
    plan = {
        "input_layernorm": _norm_spec(f"{prefix}.input_layernorm", h),
        "post_attention_layernorm": _norm_spec(f"{prefix}.post_attention_layernorm", h),
    }
    if recurrent:
        plan["linear_attn"] = gdn_plan(f"{prefix}.linear_attn", arch.gdn)
    else:
        plan["self_attn"] = attention_plan(f"{prefix}.self_attn", h, arch.attention)
    if mlp_kind == "moe":
        plan["mlp"] = moe_plan(f"{prefix}.mlp", arch.moe)
    else:
        plan["mlp"] = mlp_plan(f"{prefix}.mlp", h, arch.intermediate_size)
    return plan


def _mtp_plan(cfg: ModelConfig) -> Params:
    h = cfg.hidden_size
    return {
        "pre_fc_norm_embedding": _norm_spec("mtp.pre_fc_norm_embedding", h),
        "pre_fc_norm_hidden": _norm_spec("mtp.pre_fc_norm_hidden", h),
        "fc": linear_spec("mtp.fc", 2 * h, h),
        "layers": [
            _layer_plan(cfg, f"mtp.layers.{j}", False, cfg.arch.mtp_mlp_kind)
            for j in range(cfg.num_mtp_layers)
        ],
        "norm": _norm_spec("mtp.norm", h),
    }


def param_plan(cfg: ModelConfig, with_mtp: bool, prefix: str = "model") -> Params:
    """The checkpoint plan of the whole model (``mtp`` only when ``with_mtp``).

    ``prefix`` holds the decoder's modules (``model.language_model`` in a vision-language
    checkpoint); ``lm_head`` and ``mtp`` sit at the top level either way.
    """
    plan = {
        "embed_tokens": TensorSpec(
            f"{prefix}.embed_tokens.weight",
            (cfg.vocab_size, cfg.hidden_size),
            axes=("vocab", "embed"),
        ),
        "norm": _norm_spec(f"{prefix}.norm", cfg.hidden_size),
        "layers": [
            _layer_plan(cfg, f"{prefix}.layers.{i}", role == RECURRENT, cfg.arch.mlp_kinds[i])
            for i, role in enumerate(cfg.layer_roles)
        ],
    }
    if not cfg.tie_word_embeddings:
        plan["lm_head"] = linear_spec(
            "lm_head", cfg.hidden_size, cfg.vocab_size, axes=("embed", "vocab")
        )
    if with_mtp:
        plan["mtp"] = _mtp_plan(cfg)
    return plan


def load_params(
    cfg: ModelConfig,
    reader,
    dtype=jnp.float32,
    prefix: str = "model",
    place: Placement | None = None,
) -> Params:
    """Params read tensor by tensor from a ``SafetensorsReader`` and cast to ``dtype``.

    The MTP head is loaded when the config declares one and the checkpoint has it; the
    result then holds ``"mtp"``. Missing or misshapen tensors raise ValueError. ``prefix``
    as in ``param_plan``.
    """
    with_mtp = cfg.has_mtp and MTP_PROBE in reader
    return load_plan(param_plan(cfg, with_mtp, prefix), reader, dtype, place)


def weight_plan(cfg: ModelConfig, params: Params) -> Params:
    """The plan ``params`` were built from (its ``axes`` drive the shardings); reads only
    which top-level keys ``params`` has (``mtp``, ``lm_head``)."""
    return param_plan(cfg, "mtp" in params)


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> Params:
    """Random params (normal(0, scale) matrices, HF-style norms and GDN gates)."""
    return init_plan(param_plan(cfg, cfg.has_mtp), key, dtype, scale)


# ---------------------------------------------------------------- forward passes


def _stream(cfg: ModelConfig) -> ResidualStream:
    """Zero-centred RMSNorms, whose add and norm may run in ``Kernels.residual_norm``."""
    return ResidualStream(cfg.arch.rms_norm_eps, zero_centered=True, launch=True)


def norm(x: jax.Array, weight: jax.Array, cfg: ModelConfig) -> jax.Array:
    return _stream(cfg).norm(x, weight)


def _gates(lp: Params) -> jax.Array | None:
    """The fused gate projection of a GDN layer (``in_proj_ba``), None where split."""
    gates = lp["linear_attn"].get("in_proj_ba")
    return None if gates is None else gates["weight"]


def _gdn_kind(spec: GDNSpec) -> Mixer:
    """The GDN mixer in the step's form and kernels; ``gates``: its gate projection from
    the input norm's launch, ``parts``: ``out_proj`` left in float32 partial sums."""

    def run(lp, h, conv0, ssm0, step: Step, parts: int, gates) -> tuple[jax.Array, LayerStates]:
        options = step.recurrent_options(step.kernels.gdn_state_update)
        options.update(gated_norm=step.kernels.gated_norm, ba=gates, out_parts=parts)
        out, states = gdn_mixer(
            lp["linear_attn"], spec, h, conv0, ssm0, step.inputs.num_new, **options
        )
        return out, LayerStates(*states)

    return Mixer(run, RECURRENT, router=_gates)


def _mlps(arch: Qwen3NextArch) -> dict[str, Mlp]:
    """The sparse MoE (routed experts in the step's kernels, routed from the norm's logits
    where it computed them) and the dense SwiGLU MLP."""

    def moe(lp, h, step: Step, logits):
        flat = None if logits is None else logits.reshape(-1, logits.shape[-1])
        return sparse_moe(lp["mlp"], arch.moe, h, step.kernels.moe_experts, step.real, flat)

    def dense(lp, h, step: Step, logits):
        return swiglu_mlp(lp["mlp"], h)

    return {"moe": Mlp(moe, router=lambda lp: lp["mlp"]["gate"]), "dense": Mlp(dense)}


@functools.cache
def decoder(cfg: ModelConfig) -> Decoder:
    """The declared layers: GDN or gated attention, then the layer's MLP kind."""
    arch: Qwen3NextArch = cfg.arch
    mixer_kinds = {RECURRENT: "gdn", ATTENTION: "attention"}
    layers = tuple(zip((mixer_kinds[r] for r in cfg.layer_roles), arch.mlp_kinds, strict=True))
    mixers = {"gdn": _gdn_kind(arch.gdn), "attention": attention_mixer(arch.attention)}
    return Decoder(layers, _stream(cfg), mixers, _mlps(arch))


# ``extend`` runs the chunked GDN form, ``decode`` / ``verify`` the token-by-token form whose
# state update runs in ``kernels.gdn_state_update`` when it has one (``decoder.py``)
forward, reference_forward = family_forwards(decoder)


def _lm_head(params: Params, h: jax.Array) -> jax.Array:
    if "lm_head" in params:
        return linear(params["lm_head"], h).astype(jnp.float32)
    embed = params["embed_tokens"]
    return jnp.matmul(h.astype(embed.dtype), embed.T).astype(jnp.float32)


def compute_logits(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Final norm then lm_head (the embedding when tied): float32 ``[..., vocab]``."""
    return _lm_head(params, norm(hidden, params["norm"], cfg))


def mtp_forward(
    params: Params,
    cfg: ModelConfig,
    hidden: jax.Array,
    next_tokens: jax.Array,
    inputs: ForwardInputs,
    mtp_kv: KVPools,
    *,
    step: int = 0,
    kernels: Kernels = XLA_KERNELS,
) -> tuple[jax.Array, KVPools]:
    """The MTP draft layer: position t combines ``hidden[t]`` with ``next_tokens[t]``.

    ``hidden`` is the target's stream before its final norm ``[B, T, H]``; the layer's
    attention uses ``inputs`` (positions, KV indices) over its own pools ``mtp_kv`` (one per
    MTP layer; layer ``step % num_mtp_layers`` runs); its attention and routed experts run
    in ``kernels`` as the target's layers do. Returns (MTP hidden before ``mtp.norm``,
    mtp_kv).
    """
    if "mtp" not in params:
        raise ValueError("these params have no MTP head (checkpoint without mtp.* tensors)")
    mp = params["mtp"]
    layer = step % len(mp["layers"])
    embeds = params["embed_tokens"][next_tokens]
    combined = jnp.concatenate(
        [
            norm(embeds, mp["pre_fc_norm_embedding"], cfg),
            norm(hidden.astype(embeds.dtype), mp["pre_fc_norm_hidden"], cfg),
        ],
        axis=-1,
    )
    x = linear(mp["fc"], combined)
    k_pools, v_pools = list(mtp_kv.k), list(mtp_kv.v)
    pools = KVPools([k_pools[layer]], [v_pools[layer]])
    step = Step("draft", inputs, pools, None, kernels=kernels, real=real_tokens(inputs))
    draft = decoder(cfg)
    with jax.named_scope("mtp_layer"):
        # one product out of the attention: no partial sums in the draft layer
        kinds = ("attention", cfg.arch.mtp_mlp_kind)
        x, out = decoder_layer(draft, mp["layers"][layer], kinds, x, None, step, False)
        x = add(draft.stream, x, out)
    k_pools[layer], v_pools[layer] = step.k[0], step.v[0]
    return x, KVPools(k_pools, v_pools)


def compute_mtp_logits(
    params: Params, cfg: ModelConfig, mtp_hidden: jax.Array, lm_head: jax.Array | None = None
) -> jax.Array:
    """``mtp.norm`` then the shared lm_head: float32 ``[..., vocab]``; with ``lm_head``
    (``[hidden, K]``, from ``lm_head_columns``) only those K columns' logits ``[..., K]``."""
    h = norm(mtp_hidden, params["mtp"]["norm"], cfg)
    if lm_head is None:
        return _lm_head(params, h)
    return jnp.matmul(h.astype(lm_head.dtype), lm_head).astype(jnp.float32)


def lm_head_columns(params: Params, cfg: ModelConfig, token_ids: jax.Array) -> jax.Array:
    """The lm_head's columns of ``token_ids`` (the embedding's rows when tied) as one
    ``[hidden, K]`` matrix: ``compute_mtp_logits(..., lm_head=)`` scores only those ids."""
    if "lm_head" in params:
        return params["lm_head"]["weight"][:, token_ids]
    return params["embed_tokens"][token_ids].T
