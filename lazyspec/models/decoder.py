"""One decoder loop for every family, over the layers the family declares.

A family declares a ``Decoder``: its layers (a mixer kind and an MLP kind each, "none" for a
missing half: Nemotron-H's blocks have one or the other), its residual stream (norm style,
multipliers, ``layers/residual.py``), the norm weights of a layer's two halves, and the
functions of its mixer and MLP kinds. ``run_layers`` is the loop; each layer is
``decoder_layer`` over the residual-stream contract ``(x, residual) -> (x, residual)``: the
add-and-norm entry (``residual.add_norm``) adds the pending output, norms and decides the
fusions, the mixer or MLP leaves its output pending for the next norm.

``Step`` carries what the layers of one forward share and keeps the books of the state
they leave: the recurrent rows (``rec.layer``, ``after_layer``, ``keep_chunk_states``,
``LayerStates``) and the KV pools, by the layer's position among its kind. The mixer
functions are handed their state and return it; they never index the pools themselves.
Mode ``"reference"`` is the cache-free oracle: recurrent mixers run their token scans from
zero states, attention is dense and causal (``reference_forward``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from lazyspec.kernels.backend import XLA_KERNELS, Kernels
from lazyspec.models.config import ATTENTION, RECURRENT, ModelConfig
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
from lazyspec.models.layers.attention import AttentionSpec, attention_forward, attention_reference
from lazyspec.models.layers.mamba2 import Mamba2Dims, mamba2_mixer
from lazyspec.models.layers.residual import ResidualStream, add, add_norm, output_parts
from lazyspec.models.plan import Params

MODES = ("extend", "decode", "verify")
NONE = "none"  # the kind of a layer's missing half
_FORMS = {"extend": "chunked", "reference": "reference"}  # the recurrent form; else "steps"


class Mixer(NamedTuple):
    """A mixer kind. ``run``: for a ``RECURRENT`` role ``(lp, h, conv0, ssm0, step, parts,
    gates) -> (out, LayerStates)``, for ``ATTENTION`` ``(lp, h, k_pool, v_pool, step, parts)
    -> (out, k_pool, v_pool)``; ``parts``: the output projection's float32 partial sums
    (``residual.output_parts``), ``gates``: the router product of its input norm or None.
    ``router``: the product its input norm's launch computes, where it has one (a GDN
    layer's gate projection, rounded to the weight's dtype); the norm then launches only
    for it (``add_norm``'s ``only_for_router``)."""

    run: Callable[..., Any]
    role: str
    router: Callable[[Params], jax.Array | None] | None = None


class Mlp(NamedTuple):
    """An MLP kind: ``run(lp, h, step, logits) -> out``; ``router``: the router whose float32
    logits ``[..., E]`` the norm before it computes where it launches (else ``logits`` is
    None and the MLP routes itself)."""

    run: Callable[..., jax.Array]
    router: Callable[[Params], jax.Array] | None = None


@dataclass(frozen=True, eq=False)
class Decoder:
    """A family's declaration: the (mixer kind, MLP kind) of every layer, its residual stream,
    the param names of a layer's two norms, its kinds' functions and the embedding's scale."""

    layers: tuple[tuple[str, str], ...]
    stream: ResidualStream
    mixers: Mapping[str, Mixer]
    mlps: Mapping[str, Mlp]
    norms: tuple[str, str] = ("input_layernorm", "post_attention_layernorm")
    embedding_multiplier: float = 1.0

    def embed(self, params: Params, tokens: jax.Array) -> jax.Array:
        x = params["embed_tokens"][tokens]
        return x if self.embedding_multiplier == 1.0 else x * self.embedding_multiplier


class Step:
    """What the layers of one forward share (mode, inputs, kernels; ``real`` as in
    ``interface.real_tokens``) and the books of the states they leave: ``rec`` as the
    layers so far left it (a writing ``PoolView`` takes each layer's state), the states of
    every recurrent layer, and the KV pools."""

    def __init__(
        self,
        mode: str,
        inputs: ForwardInputs,
        kv: KVPools,
        rec: StateRows | PoolView | None,
        *,
        kernels: Kernels = XLA_KERNELS,
        chunk_size: int = 64,
        keep_chunk: jax.Array | None = None,
        real: jax.Array | None = None,
    ):
        self.mode, self.inputs, self.kernels, self.chunk_size = mode, inputs, kernels, chunk_size
        self.keep_chunk, self.real = keep_chunk, real
        self.form = _FORMS.get(mode, "steps")
        self.rec = for_mode(rec, mode)
        self.k, self.v = list(kv.k), list(kv.v)
        self.states: list[LayerStates] = []
        self._attention = 0

    def recurrent_options(self, state_update) -> dict[str, Any]:
        """A recurrent mixer's form, chunk and kernels (``state_update``, its kind's)."""
        return {
            "form": self.form,
            "chunk_size": self.chunk_size,
            "state_update": state_update,
            "conv_update": self.kernels.conv_update,
        }

    def mix(self, mixer: Mixer, lp: Params, h: jax.Array, parts: int, gates) -> jax.Array:
        """The mixer's output; its state taken into the books."""
        if mixer.role == RECURRENT:
            return self._recurrent(mixer, lp, h, parts, gates)
        a, self._attention = self._attention, self._attention + 1
        out, self.k[a], self.v[a] = mixer.run(lp, h, self.k[a], self.v[a], self, parts)
        return out

    def _recurrent(self, mixer: Mixer, lp: Params, h: jax.Array, parts: int, gates) -> jax.Array:
        r = len(self.states)
        out, st = mixer.run(lp, h, *self.rec.layer(r), self, parts, gates)
        if self.mode == "extend":
            st = st._replace(
                conv_trace=keep_chunk_states(st.conv_trace, self.keep_chunk),
                ssm_trace=keep_chunk_states(st.ssm_trace, self.keep_chunk),
            )
        self.states.append(st)
        self.rec = after_layer(self.rec, r, st.conv, st.ssm, st.ssm_pool, st.conv_pool)
        return out

    def result(self, x: jax.Array) -> tuple[jax.Array, KVPools, RecurrentOut]:
        return x, KVPools(self.k, self.v), recurrent_out(self.states, self.rec, self.mode)


def decoder_layer(
    decoder: Decoder,
    lp: Params,
    kinds: tuple[str, str],
    x: jax.Array,
    residual: jax.Array | None,
    step: Step,
    split_output: bool = True,
) -> tuple[jax.Array, jax.Array | None]:
    """One layer: ``(x, residual) -> (x, residual)``, the mixer half then the MLP half, each
    after the add-and-norm of what is pending. ``split_output``: the mixer's output
    projection may leave partial sums for the norm after it (``residual.output_parts``)."""
    mixer_kind, mlp_kind = kinds
    stream, kernels = decoder.stream, step.kernels
    mlp = decoder.mlps.get(mlp_kind)
    router = None if mlp is None or mlp.router is None else mlp.router(lp)
    if mixer_kind != NONE:
        mixer = decoder.mixers[mixer_kind]
        gates = None if mixer.router is None else mixer.router(lp)
        x, h, gates = add_norm(
            stream,
            kernels,
            x,
            residual,
            lp[decoder.norms[0]],
            gates,
            after_mlp=True,
            only_for_router=mixer.router is not None,
            logits_dtype=jnp.float32 if gates is None else gates.dtype,
        )
        parts = output_parts(stream, kernels, x, router) if split_output else 0
        residual = step.mix(mixer, lp, h, parts, gates)
    if mlp is not None:
        # the engine's norm after a mixer runs the launch's contract, in XLA without it
        engine = step.mode != "reference"
        weight = lp[decoder.norms[1]]
        x, h, logits = add_norm(stream, kernels, x, residual, weight, router, xla_form=engine)
        residual = mlp.run(lp, h, step, logits)
    return x, residual


def run_layers(decoder: Decoder, params: Params, x: jax.Array, step: Step) -> jax.Array:
    """The layer loop: every declared layer over the stream x, then the last pending
    output added (the hidden stream before the final norm)."""
    residual = None
    for i, kinds in enumerate(decoder.layers):
        with jax.named_scope(f"layer_{i}"):
            x, residual = decoder_layer(decoder, params["layers"][i], kinds, x, residual, step)
    return add(decoder.stream, x, residual)


def family_forwards(declare: Callable[[ModelConfig], Decoder]) -> tuple[Callable, Callable]:
    """A family's ``forward`` and ``reference_forward`` (``interface.ModelFamily``) over the
    decoder ``declare(cfg)`` declares.

    ``forward(params, cfg, inputs, kv, rec, *, mode, chunk_size=64, kernels=XLA_KERNELS,
    keep_chunk=None)`` -> (hidden before the final norm, kv, ``RecurrentOut``): ``extend``
    runs the recurrent mixers' chunked form, ``decode`` / ``verify`` their T-step form (in
    ``kernels``' state updates where it has them), as ``interface.py`` describes; pure.
    ``reference_forward(params, cfg, tokens)``: whole sequences with no cache machinery
    (``reference_step``)."""

    def forward(params, cfg, inputs, kv, rec, *, mode, **options):
        if mode not in MODES:
            raise ValueError(f"unknown forward mode {mode!r}; expected one of {MODES}")
        step = Step(mode, inputs, kv, rec, real=real_tokens(inputs), **options)
        x = run_layers(declare(cfg), params, declare(cfg).embed(params, inputs.tokens), step)
        return step.result(x)

    def reference_forward(params, cfg, tokens):
        return run_reference(declare(cfg), cfg, params, tokens)

    return forward, reference_forward


def reference_step(
    cfg: ModelConfig, tokens: jax.Array, form: str = "reference", chunk_size: int = 64
) -> Step:
    """The ``Step`` of whole sequences ``[B, T]`` with no cache machinery: zero recurrent
    states, no pools (attention dense and causal), the XLA forms; the recurrent mixers in
    ``form`` ("reference", the token scans; "chunked" for training)."""
    batch, num_tokens = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32), (batch, num_tokens))
    num_new = jnp.full((batch,), num_tokens, jnp.int32)
    inputs = ForwardInputs(tokens, positions, num_new, None, None, None)  # no cache
    num_rec, num_attention = len(cfg.recurrent_layer_ids), len(cfg.attention_layer_ids)
    rec = StateRows(
        jnp.zeros((num_rec, batch, *cfg.conv_state_shape), jnp.float32),
        jnp.zeros((num_rec, batch, *cfg.ssm_state_shape), jnp.float32),
    )
    kv = KVPools([None] * num_attention, [None] * num_attention)
    step = Step("reference", inputs, kv, rec, chunk_size=chunk_size)
    step.form = form
    return step


def run_reference(
    decoder: Decoder, cfg: ModelConfig, params: Params, tokens: jax.Array, **form: Any
) -> jax.Array:
    """Whole sequences ``[B, T]`` through ``reference_step(cfg, tokens, **form)``: the hidden
    stream before the final norm ``[B, T, hidden]``."""
    step = reference_step(cfg, tokens, **form)
    return run_layers(decoder, params, decoder.embed(params, tokens), step)


# ---------------------------------------------------------------- shared mixer kinds


def attention_mixer(spec: AttentionSpec, key: str = "self_attn") -> Mixer:
    """Attention over the pools (``attention_forward``, in the step's kernels), or dense
    and causal in the reference; its params at ``lp[key]``."""

    def run(lp, h, k_pool, v_pool, step: Step, parts: int):
        if step.mode == "reference":
            return attention_reference(lp[key], spec, h, step.inputs.positions), k_pool, v_pool
        return attention_forward(lp[key], spec, h, step.inputs, k_pool, v_pool, step.kernels, parts)

    return Mixer(run, ATTENTION)


def mamba2_mixer_kind(dims: Mamba2Dims, key: str) -> Mixer:
    """The Mamba2 mixer (``layers/mamba2.py``) in the step's form and kernels; its params at
    ``lp[key]``. Its output is one product (``parts`` is 0 for the streams that use it)."""

    def run(lp, h, conv0, ssm0, step: Step, parts: int, gates) -> tuple[jax.Array, LayerStates]:
        options = step.recurrent_options(step.kernels.mamba2_state_update)
        out, st = mamba2_mixer(lp[key], dims, h, conv0, ssm0, step.inputs.num_new, **options)
        traces = (st.trace_conv, st.trace_ssm)
        return out, LayerStates(st.conv, st.ssm, *traces, st.ssm_pool, st.conv_pool)

    return Mixer(run, RECURRENT)
