"""The Nemotron-H family (NemotronHForCausalLM): Mamba2, attention, MLP and MoE blocks.

Every layer is one pre-norm residual block ``h = h + mixer(rms_norm(h))`` whose mixer is a
Mamba2 mixer (``layers/mamba2.py``), GQA attention without positional embedding, a non-gated
relu^2 MLP, or a sigmoid-routed MoE of relu^2 experts plus a shared expert. The module exposes
the family contract of ``interface.py``: ``parse_config``, ``init_params``, ``load_params``,
``forward``, ``compute_logits`` and ``reference_forward``. The checkpoint's MTP head (if any)
is not used yet.

Params: ``{"embed_tokens": [V, D], "norm": [D], "lm_head": linear (absent when tied),
"layers": [{"norm": [D], "mixer": {...}}, ...]}``, linears as in ``layers/mlp.linear``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from lazyspec.models.config import ATTENTION, RECURRENT, STATELESS, ModelConfig, eos_ids
from lazyspec.models.interface import (
    ForwardInputs, KVPools, RecurrentOut, RecurrentState,
)
from lazyspec.models.layers.attention import (
    AttentionSpec, attention_forward, attention_reference,
)
from lazyspec.models.layers.mamba2 import (
    Mamba2Dims, init_mamba2_params, load_mamba2_params, mamba2_mixer,
)
from lazyspec.models.layers.mlp import linear
from lazyspec.models.layers.norms import rms_norm

logger = logging.getLogger(__name__)

FAMILY = "nemotron_h"
MODES = ("extend", "decode", "verify")
BACKENDS = ("xla", "pallas")

# Block names of layers_block_type and of the legacy hybrid_override_pattern characters.
_BLOCK_KINDS = {
    "mamba": "mamba", "linear_attention": "mamba", "M": "mamba",
    "attention": "attention", "full_attention": "attention", "*": "attention",
    "mlp": "mlp", "-": "mlp",
    "moe": "moe", "E": "moe",
}
_ROLES = {"mamba": RECURRENT, "attention": ATTENTION, "mlp": STATELESS, "moe": STATELESS}
# Older Nemotron-H config.json files spell some fields differently.
_LEGACY_NAMES = {
    "n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv", "time_step_min": "mamba_dt_min",
    "use_conv_bias": "mamba_conv_bias", "head_dim": "attention_head_dim",
}
_REQUIRED = object()


@dataclass(frozen=True)
class MoESpec:
    """Sigmoid-routed MoE of relu^2 experts (grouped top-k) plus one shared relu^2 expert."""

    num_experts: int
    top_k: int
    intermediate_size: int
    shared_intermediate_size: int
    latent_size: int | None  # experts run in this width when set (fc1/fc2 latent projections)
    num_groups: int  # expert groups for routing (n_group)
    top_groups: int  # groups kept per token (topk_group)
    norm_top_k: bool
    scaling: float


@dataclass(frozen=True)
class NemotronHArch:
    """Nemotron-H details beyond ModelConfig (``ModelConfig.arch``)."""

    block_kinds: tuple[str, ...]  # "mamba" | "attention" | "mlp" | "moe" per layer
    mamba: Mamba2Dims | None
    attention: AttentionSpec | None
    intermediate_size: int  # dense MLP width (0 without mlp blocks)
    mlp_bias: bool
    mamba_bias: bool  # in_proj / out_proj biases
    conv_bias: bool
    norm_eps: float
    moe: MoESpec | None


def _field(hf: dict[str, Any], key: str, default: Any = _REQUIRED) -> Any:
    """``hf[key]`` (or its legacy name); ValueError naming ``key`` when required and absent."""
    for name in (key, _LEGACY_NAMES.get(key)):
        if name is not None and hf.get(name) is not None:
            return hf[name]
    if default is _REQUIRED:
        raise ValueError(f"{FAMILY} config.json is missing the required field {key!r}")
    return default


def _block_kinds(hf: dict[str, Any]) -> tuple[str, ...]:
    """Per-layer block kinds from ``layers_block_type`` or ``hybrid_override_pattern``."""
    names = hf.get("layers_block_type") or hf.get("layer_types")
    if names is None:
        names = list(_field(hf, "hybrid_override_pattern"))
    unknown = [n for n in names if n not in _BLOCK_KINDS]
    if unknown:
        raise ValueError(f"unknown Nemotron-H block types {unknown!r} in {names!r}")
    return tuple(_BLOCK_KINDS[n] for n in names)


def _mamba_dims(hf: dict[str, Any], eps: float) -> Mamba2Dims:
    dims = Mamba2Dims(
        hidden_size=_field(hf, "hidden_size"),
        num_heads=_field(hf, "mamba_num_heads"),
        head_dim=_field(hf, "mamba_head_dim"),
        state_size=_field(hf, "ssm_state_size"),
        n_groups=_field(hf, "n_groups"),
        conv_kernel=_field(hf, "conv_kernel"),
        norm_eps=eps,
        # transformers' torch path clamps dt to [time_step_min, inf); parity follows it.
        dt_min=float(_field(hf, "time_step_min", 0.001)),
    )
    if dims.num_heads % dims.n_groups:
        raise ValueError(
            f"mamba_num_heads {dims.num_heads} not divisible by n_groups {dims.n_groups}")
    return dims


def _attention_spec(hf: dict[str, Any], eps: float) -> AttentionSpec:
    heads = _field(hf, "num_attention_heads")
    kv_heads = _field(hf, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise ValueError(
            f"num_attention_heads {heads} not divisible by num_key_value_heads {kv_heads}")
    head_dim = _field(hf, "head_dim", _field(hf, "hidden_size") // heads)
    return AttentionSpec(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, norm_eps=eps)


def _moe_spec(hf: dict[str, Any]) -> MoESpec:
    return MoESpec(
        num_experts=_field(hf, "n_routed_experts"),
        top_k=_field(hf, "num_experts_per_tok"),
        intermediate_size=_field(hf, "moe_intermediate_size"),
        shared_intermediate_size=_field(hf, "moe_shared_expert_intermediate_size"),
        latent_size=_field(hf, "moe_latent_size", None),
        num_groups=_field(hf, "n_group", 1),
        top_groups=_field(hf, "topk_group", 1),
        norm_top_k=bool(_field(hf, "norm_topk_prob", True)),
        scaling=float(_field(hf, "routed_scaling_factor", 1.0)),
    )


def parse_config(hf: dict[str, Any]) -> ModelConfig:
    """Parse a Nemotron-H ``config.json`` dict; missing fields raise ValueError naming them."""
    kinds = _block_kinds(hf)
    eps = float(_field(hf, "layer_norm_epsilon", 1e-5))
    act = _field(hf, "mlp_hidden_act", "relu2")
    if act != "relu2":
        raise ValueError(f"unsupported Nemotron-H mlp_hidden_act {act!r}; only 'relu2'")
    mamba = _mamba_dims(hf, eps) if "mamba" in kinds else None
    attention = _attention_spec(hf, eps) if "attention" in kinds else None
    arch = NemotronHArch(
        block_kinds=kinds, mamba=mamba, attention=attention,
        intermediate_size=_field(hf, "intermediate_size") if "mlp" in kinds else 0,
        mlp_bias=bool(_field(hf, "mlp_bias", False)),
        mamba_bias=bool(_field(hf, "use_bias", False)),
        conv_bias=bool(_field(hf, "use_conv_bias", True)),
        norm_eps=eps,
        moe=_moe_spec(hf) if "moe" in kinds else None,
    )
    if _field(hf, "num_nextn_predict_layers", 0):
        logger.warning("Nemotron-H checkpoint declares MTP layers; the MTP head is not used yet")
    return ModelConfig(
        family=FAMILY,
        vocab_size=_field(hf, "vocab_size"),
        hidden_size=_field(hf, "hidden_size"),
        layer_roles=tuple(_ROLES[k] for k in kinds),
        num_attention_heads=attention.num_heads if attention else 0,
        num_kv_heads=attention.num_kv_heads if attention else 0,
        head_dim=attention.head_dim if attention else 0,
        max_position_embeddings=_field(hf, "max_position_embeddings", 4096),
        conv_dim=mamba.conv_dim if mamba else 0,
        conv_kernel=mamba.conv_kernel if mamba else 1,
        ssm_heads=mamba.num_heads if mamba else 0,
        ssm_dim_a=mamba.head_dim if mamba else 0,
        ssm_dim_b=mamba.state_size if mamba else 0,
        eos_token_ids=eos_ids(hf),
        tie_word_embeddings=bool(_field(hf, "tie_word_embeddings", False)),
        num_mtp_layers=0,
        arch=arch,
    )


# ---------------------------------------------------------------- MLP and MoE blocks


def relu2_mlp(params: dict, x: jax.Array) -> jax.Array:
    """``down(relu(up(x))^2)``: the non-gated Nemotron-H MLP."""
    up = jax.nn.relu(linear(params["up_proj"], x))
    return linear(params["down_proj"], up * up)


def route(params: dict, spec: MoESpec, flat: jax.Array) -> jax.Array:
    """Routing weights [N, E] (zero off the chosen experts) for tokens ``flat`` [N, D].

    Scores are sigmoids of the float32 router; choice adds the correction bias, keeps the
    ``top_groups`` groups with the best sum of their two best experts, then the top-k experts.
    The weights are the plain scores of the chosen experts, renormalised and scaled.
    """
    scores = jax.nn.sigmoid(flat.astype(jnp.float32) @ params["router"])
    choice = scores + params["router_bias"]
    if spec.num_groups > 1:
        grouped = choice.reshape(-1, spec.num_groups, spec.num_experts // spec.num_groups)
        group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
        _, group_ids = jax.lax.top_k(group_score, spec.top_groups)
        keep = jnp.any(jax.nn.one_hot(group_ids, spec.num_groups, dtype=bool), axis=1)
        keep = jnp.repeat(keep, spec.num_experts // spec.num_groups, axis=1)
        choice = jnp.where(keep, choice, -jnp.inf)
    _, expert_ids = jax.lax.top_k(choice, spec.top_k)
    weights = jnp.take_along_axis(scores, expert_ids, axis=1)
    if spec.norm_top_k:
        weights = weights / (jnp.sum(weights, axis=1, keepdims=True) + 1e-20)
    weights = weights * spec.scaling
    rows = jnp.arange(flat.shape[0])[:, None]
    return jnp.zeros_like(scores).at[rows, expert_ids].add(weights)


def sparse_moe(params: dict, spec: MoESpec, x: jax.Array) -> jax.Array:
    """Routed relu^2 experts + the shared expert, for x [..., D].

    Every expert runs on every token and the routing weights select (dense; fine for tests
    and small models, a grouped matmul is the faster form).
    """
    flat = x.reshape(-1, x.shape[-1])
    weights = route(params, spec, flat)
    h = linear(params["latent_in"], flat) if "latent_in" in params else flat
    up = jax.nn.relu(jnp.einsum("nd,edi->nei", h, params["experts_up"]))
    down = jnp.einsum("nei,eid->ned", up * up, params["experts_down"])
    routed = jnp.einsum("ned,ne->nd", down.astype(jnp.float32), weights).astype(flat.dtype)
    if "latent_out" in params:
        routed = linear(params["latent_out"], routed)
    out = routed + relu2_mlp(params["shared"], flat)
    return out.reshape(x.shape)


# ---------------------------------------------------------------- parameters


@dataclass(frozen=True)
class _Tensor:
    """One parameter of an attention / MLP / MoE block: its place in params and checkpoint."""

    path: str  # "shared.up_proj.weight" -> params["shared"]["up_proj"]["weight"]
    shape: tuple[int, ...]  # our layout ([in, out] for linear weights)
    name: str  # checkpoint name under the mixer's prefix; "{e}" marks per-expert tensors
    transpose: bool = False  # the checkpoint holds the transpose (torch Linear layout)
    float32: bool = False  # kept in float32 whatever the model dtype


def _linear(path: str, name: str, fan_in: int, fan_out: int, bias: bool) -> list[_Tensor]:
    weight = _Tensor(f"{path}.weight", (fan_in, fan_out), f"{name}.weight", transpose=True)
    return [weight, _Tensor(f"{path}.bias", (fan_out,), f"{name}.bias")] if bias else [weight]


def _block_tensors(kind: str, arch: NemotronHArch, hidden: int) -> list[_Tensor]:
    """Every parameter of an "attention", "mlp" or "moe" block."""
    if kind == "attention":
        spec = arch.attention
        q_width, kv_width = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        widths = {"q_proj": (hidden, q_width), "k_proj": (hidden, kv_width),
                  "v_proj": (hidden, kv_width), "o_proj": (q_width, hidden)}
        return [t for name, (i, o) in widths.items() for t in _linear(name, name, i, o, False)]
    bias = arch.mlp_bias
    if kind == "mlp":
        width = arch.intermediate_size
        return (_linear("up_proj", "up_proj", hidden, width, bias)
                + _linear("down_proj", "down_proj", width, hidden, bias))
    spec = arch.moe
    experts, inner, width = spec.num_experts, spec.latent_size or hidden, spec.intermediate_size
    shared = spec.shared_intermediate_size
    tensors = [
        _Tensor("router", (hidden, experts), "gate.weight", transpose=True, float32=True),
        _Tensor("router_bias", (experts,), "gate.e_score_correction_bias", float32=True),
        _Tensor("experts_up", (experts, inner, width), "experts.{e}.up_proj.weight", True),
        _Tensor("experts_down", (experts, width, inner), "experts.{e}.down_proj.weight", True),
        *_linear("shared.up_proj", "shared_experts.up_proj", hidden, shared, bias),
        *_linear("shared.down_proj", "shared_experts.down_proj", shared, hidden, bias),
    ]
    if spec.latent_size:
        tensors += _linear("latent_in", "fc1_latent_proj", hidden, inner, bias)
        tensors += _linear("latent_out", "fc2_latent_proj", inner, hidden, bias)
    return tensors


def _nest(values: dict[str, jax.Array]) -> dict:
    """{"a.b.weight": w} -> {"a": {"b": {"weight": w}}}."""
    tree: dict = {}
    for path, value in values.items():
        *outer, last = path.split(".")
        node = tree
        for part in outer:
            node = node.setdefault(part, {})
        node[last] = value
    return tree


def _init_block(tensors: list[_Tensor], key: jax.Array, dtype) -> dict:
    """normal(0.02) matrices, zero vectors (biases, router bias)."""
    values = {}
    for k, t in zip(jax.random.split(key, len(tensors)), tensors):
        t_dtype = jnp.float32 if t.float32 else dtype
        values[t.path] = (0.02 * jax.random.normal(k, t.shape, t_dtype) if len(t.shape) > 1
                          else jnp.zeros(t.shape, t_dtype))
    return _nest(values)


def _read(reader, prefix: str, t: _Tensor):
    """One tensor in our layout; experts stacked from per-expert or fused checkpoint tensors."""
    if "{e}" not in t.name:
        shape = t.shape[::-1] if t.transpose else t.shape
        array = reader.get(prefix + t.name, shape)
        return array.T if t.transpose else array
    experts, fan_in, fan_out = t.shape
    fused = prefix + t.name.replace(".{e}", "").removesuffix(".weight")
    if fused in reader:
        return reader.get(fused, (experts, fan_out, fan_in)).transpose(0, 2, 1)
    return jnp.stack([reader.get(prefix + t.name.format(e=e), (fan_out, fan_in)).T
                      for e in range(experts)])


def _load_block(tensors: list[_Tensor], reader, prefix: str, dtype) -> dict:
    return _nest({t.path: jnp.asarray(_read(reader, prefix, t),
                                      jnp.float32 if t.float32 else dtype) for t in tensors})


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random params for ``cfg`` (normal(0.02) matrices, unit norms); for training and tests."""
    return _init_params(cfg, key, jnp.dtype(dtype))


@partial(jax.jit, static_argnums=(0, 2))  # one compile instead of one per eager random op
def _init_params(cfg: ModelConfig, key: jax.Array, dtype) -> dict:
    arch: NemotronHArch = cfg.arch
    keys = jax.random.split(key, cfg.num_layers + 2)
    layers = []
    for i, kind in enumerate(arch.block_kinds):
        if kind == "mamba":
            mixer = init_mamba2_params(arch.mamba, keys[i], dtype, use_bias=arch.mamba_bias,
                                       use_conv_bias=arch.conv_bias,
                                       out_scale=cfg.num_layers**-0.5)
        else:
            mixer = _init_block(_block_tensors(kind, arch, cfg.hidden_size), keys[i], dtype)
        layers.append({"norm": jnp.ones((cfg.hidden_size,), dtype), "mixer": mixer})
    params = {
        "embed_tokens": 0.02 * jax.random.normal(
            keys[-2], (cfg.vocab_size, cfg.hidden_size), dtype),
        "norm": jnp.ones((cfg.hidden_size,), dtype),
        "layers": layers,
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = {"weight": 0.02 * jax.random.normal(
            keys[-1], (cfg.hidden_size, cfg.vocab_size), dtype)}
    return params


def load_params(cfg: ModelConfig, reader, dtype=jnp.float32) -> dict:
    """Params from a ``SafetensorsReader`` over a folder written by NemotronHForCausalLM.

    Tensor names are transformers' (``backbone.*``; ``model.*`` is accepted too). A missing
    tensor raises KeyError naming it; a misshapen one ValueError naming it and both shapes.
    """
    arch: NemotronHArch = cfg.arch
    root = "backbone." if "backbone.embeddings.weight" in reader else "model."
    hidden = cfg.hidden_size

    def get(name, shape):
        return jnp.asarray(reader.get(name, shape), dtype)

    layers = []
    for i, kind in enumerate(arch.block_kinds):
        prefix = f"{root}layers.{i}.mixer."
        if kind == "mamba":
            mixer = load_mamba2_params(arch.mamba, reader.get, prefix, dtype,
                                       use_bias=arch.mamba_bias, use_conv_bias=arch.conv_bias)
        else:
            mixer = _load_block(_block_tensors(kind, arch, hidden), reader, prefix, dtype)
        layers.append({"norm": get(f"{root}layers.{i}.norm.weight", (hidden,)), "mixer": mixer})
    params = {
        "embed_tokens": get(root + "embeddings.weight", (cfg.vocab_size, hidden)),
        "norm": get(root + "norm_f.weight", (hidden,)),
        "layers": layers,
    }
    # transformers' NemotronHForCausalLM never ties lm_head (its tied-keys map is empty) and
    # saves it even with tie_word_embeddings; only a checkpoint without it reuses the embedding.
    if "lm_head.weight" in reader or not cfg.tie_word_embeddings:
        params["lm_head"] = {"weight": get("lm_head.weight", (cfg.vocab_size, hidden)).T}
    return params


# ---------------------------------------------------------------- forward


def _run_blocks(params: dict, cfg: ModelConfig, tokens: jax.Array, mamba_fn, attention_fn):
    """Embed, then every block; mixers with state go through the two callbacks."""
    arch: NemotronHArch = cfg.arch
    h = params["embed_tokens"][tokens]
    for i, kind in enumerate(arch.block_kinds):
        layer = params["layers"][i]
        with jax.named_scope(f"layer{i}_{kind}"):
            x = rms_norm(h, layer["norm"], arch.norm_eps)
            if kind == "mamba":
                out = mamba_fn(layer["mixer"], x)
            elif kind == "attention":
                out = attention_fn(layer["mixer"], x)
            elif kind == "mlp":
                out = relu2_mlp(layer["mixer"], x)
            else:
                out = sparse_moe(layer["mixer"], arch.moe, x)
            h = h + out.astype(h.dtype)
    return h


def forward(params: dict, cfg: ModelConfig, inputs: ForwardInputs, kv: KVPools,
            rec: RecurrentState, *, mode: str, chunk_size: int = 64, backend: str = "xla"):
    """The device contract of ``interface.py``: returns (hidden, kv, RecurrentOut).

    ``extend`` runs the chunked Mamba2 form and reports the state after every ``chunk_size``
    tokens (``chunks``); ``verify`` the T-step form with the state after every position
    (``steps``); ``decode`` the T-step form with the final state only. Pure; pools are
    returned, not mutated.
    """
    if mode not in MODES:
        raise ValueError(f"unknown forward mode {mode!r}; expected one of {MODES}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    arch: NemotronHArch = cfg.arch
    form = "chunked" if mode == "extend" else "steps"
    k_pools, v_pools, states = list(kv.k), list(kv.v), []
    attention_ids = iter(range(len(k_pools)))

    def mamba_fn(mixer, x):
        r = len(states)
        out, state = mamba2_mixer(mixer, arch.mamba, x, rec.conv[r], rec.ssm[r],
                                  inputs.num_new, form=form, chunk_size=chunk_size,
                                  backend=backend)
        states.append(state)
        return out

    def attention_fn(mixer, x):
        a = next(attention_ids)
        out, k_pools[a], v_pools[a] = attention_forward(
            mixer, arch.attention, x, inputs.positions, inputs.num_new, inputs.kv_write_idx,
            inputs.kv_read_idx, inputs.ctx_len, k_pools[a], v_pools[a])
        return out

    hidden = _run_blocks(params, cfg, inputs.tokens, mamba_fn, attention_fn)
    return hidden, KVPools(k=k_pools, v=v_pools), _recurrent_out(states, rec, mode)


def _recurrent_out(states: list, rec: RecurrentState, mode: str) -> RecurrentOut:
    """Stack per-layer mixer states into RecurrentOut ([L_rec, B, ...])."""
    if not states:
        return RecurrentOut(final=rec, steps=None, chunks=None)
    final = RecurrentState(conv=jnp.stack([s.conv for s in states]),
                           ssm=jnp.stack([s.ssm for s in states]))
    trace = RecurrentState(conv=jnp.stack([s.trace_conv for s in states]),
                           ssm=jnp.stack([s.trace_ssm for s in states]))
    return RecurrentOut(final=final, steps=trace if mode == "verify" else None,
                        chunks=trace if mode == "extend" else None)


def compute_logits(params: dict, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Final RMSNorm then lm_head (the embedding when params have none); float32 [..., V]."""
    x = rms_norm(hidden, params["norm"], cfg.arch.norm_eps)
    if "lm_head" not in params:
        return jnp.matmul(x.astype(jnp.float32), params["embed_tokens"].astype(jnp.float32).T)
    return linear(params["lm_head"], x).astype(jnp.float32)


def reference_forward(params: dict, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Full recompute with no cache machinery: tokens [B, T] -> hidden [B, T, D] (pre-norm).

    Mamba2 runs the token-by-token scan from zero states; attention is dense and causal.
    """
    arch: NemotronHArch = cfg.arch
    batch, num_tokens = tokens.shape
    num_new = jnp.full((batch,), num_tokens, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32), (batch, num_tokens))

    def mamba_fn(mixer, x):
        dims = arch.mamba
        conv0 = jnp.zeros((batch, dims.conv_dim, dims.conv_kernel - 1), jnp.float32)
        ssm0 = jnp.zeros((batch, dims.num_heads, dims.head_dim, dims.state_size), jnp.float32)
        out, _ = mamba2_mixer(mixer, dims, x, conv0, ssm0, num_new, form="reference")
        return out

    def attention_fn(mixer, x):
        return attention_reference(mixer, arch.attention, x, positions)

    return _run_blocks(params, cfg, tokens, mamba_fn, attention_fn)
