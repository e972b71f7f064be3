"""The resolver: one ``Kernels`` record of the functions the model's forward and the engine's
steps call, for a backend, a platform and a ``Tuning``.

``kernel_backend`` is "pallas" or "xla". The default is "pallas" on GPUs and "xla" on CPU
(where Pallas runs only in interpret mode, which the dispatch then uses: for tests) and on
TPU (``kernel_backend="pallas"`` opts in to the scalar-prefetch state updates of
``gdn.update_tpu`` / ``mamba2.update_tpu`` and the ragged paged attention of
``attention.ragged_tpu``; the conv update and the scatter stay on XLA there). Each op's
dispatch (``kernels/<op>/dispatch.py``) chooses between its Pallas launch and the caller's
XLA form by shape, with the tiles and limits of the ``Tuning`` bound here; nothing reads a
module global while a program is traced, and the record (tuning included) is part of every
step's static key.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax

from lazyspec.kernels.attention.dispatch import (
    pallas_attention_prologue,
    pallas_paged_attention,
    tpu_paged_attention,
)
from lazyspec.kernels.common import KernelBackend, platform_of, resolve_backend
from lazyspec.kernels.device_kinds import device_kind_key
from lazyspec.kernels.gdn.update import conv_tokens_fit, never_conv_tokens
from lazyspec.kernels.moe.dispatch import pallas_moe_experts, tpu_moe_experts
from lazyspec.kernels.norm.dispatch import (
    pallas_gated_norm,
    pallas_residual_norm,
    residual_norm_fits,
)
from lazyspec.kernels.norm.residual import ResidualNorm
from lazyspec.kernels.state.conv import ConvUpdateResult
from lazyspec.kernels.state.dispatch import (
    pallas_conv_update,
    pallas_state_copy,
    pallas_state_scatter,
    pallas_state_update,
    tpu_state_update,
)
from lazyspec.kernels.state.scatter import state_copy_xla, state_scatter_xla
from lazyspec.kernels.state.update_common import StateUpdateResult
from lazyspec.kernels.tuning import DEFAULT_TUNING, Tuning, tuning_for

# (pool, slot, tokens, *, mode, layer=None) -> StateUpdateResult, as ``state.update_common``
StateUpdateFn = Callable[..., StateUpdateResult]
# (ssm_pool, conv_pool, ssm_steps, conv_steps, dst_slot, step, *, layer=None) -> (ssm, conv)
StateScatterFn = Callable[..., tuple[jax.Array, jax.Array]]
# (ssm_pool, conv_pool, src_slot, dst_slot) -> (ssm, conv), as ``state_copy``
StateCopyFn = Callable[..., tuple[jax.Array, jax.Array]]
# (pool, slot, x, weight, bias, *, mode, num_new, layer, out_dtype) -> ConvUpdateResult
ConvUpdateFn = Callable[..., ConvUpdateResult]
# (x, weights, expert_ids, up, down, gate=None, *, xla_form) -> float32 [N, d_out], as
# ``moe_experts_pallas``; ``xla_form()`` computes the same by the XLA dispatch
MoEExpertsFn = Callable[..., jax.Array]
# (inputs: PagedInputs, scale, *, gate=None) -> out, as ``attention.paged``'s forms;
# ``kv_head=`` too, for the per-shard form over replicated pools
PagedAttentionFn = Callable[..., jax.Array]
# (x, delta, weight, router=None, *, eps, zero_centered, logits_dtype, xla_form) ->
# ResidualNorm, as ``residual_norm_pallas``; ``xla_form()`` computes the same by XLA
ResidualNormFn = Callable[..., ResidualNorm]
# (q, k, v, positions, write_idx, num_new, k_pool, v_pool, q_norm=None, k_norm=None, *,
# eps, zero_centered, rotary_dim, rope_theta, num_heads=None, k_head_at=0, v_head_at=0,
# xla_form) -> (q, k_pool, v_pool), as ``attention_prologue_pallas``
AttentionPrologueFn = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]
# (x, z_source, layout, weight, *, eps, dtype, xla_form) -> [N, H, d], as
# ``gated_norm_pallas``; ``xla_form()`` computes the same by XLA
GatedNormFn = Callable[..., jax.Array]


@dataclass(frozen=True)
class Kernels:
    """The kernels of one backend, resolved once (``kernels_for``) and handed to the model's
    forward and the engine's steps, which call what they are given.

    ``gdn_state_update`` / ``mamba2_state_update``: the contract of ``state.dispatch.
    state.update_common``; None on XLA, where the mixers run their own jnp token scans.
    ``state_scatter`` / ``state_copy``: the contracts of ``state_scatter`` and ``state_copy``.
    ``conv_update``: the conv of a decode step that writes the pools in place; None on XLA
    and TPU. ``moe_experts``: the routed experts, kernel or the caller's XLA form by token
    count; None where the MoE layers run their sort-based dispatch. ``paged_attention``:
    None on XLA, where the attention layers walk the table in jnp; on a TPU the ragged
    Mosaic kernel over pages of ``page_size`` rows (the engine's pool pages).
    ``residual_norm`` (the residual add, the norm and a router's logits in one launch),
    ``attention_prologue`` (q / k norms, rotary, K / V writes) and ``gated_norm`` (a GDN
    layer's output norm): one launch at a decode step's token counts; None on XLA, TPU and
    per shard, where the layers run the ops themselves.

    Compared and hashed by backend, platform, MoE runner, mesh, tuning and page size (the
    functions follow from them): ``mesh`` is None for whole-array calls, else the
    tensor-parallel mesh whose shards each call runs on (``engine.shard_kernels``)."""

    backend: KernelBackend
    platform: str | None  # None on XLA, which runs the same everywhere
    gdn_state_update: StateUpdateFn | None = field(compare=False)
    mamba2_state_update: StateUpdateFn | None = field(compare=False)
    state_scatter: StateScatterFn = field(compare=False)
    moe_experts: MoEExpertsFn | None = field(default=None, compare=False)
    paged_attention: PagedAttentionFn | None = field(default=None, compare=False)
    moe_runner: str = "auto"  # as asked (MOE_RUNNER_BACKENDS); with platform, names moe_experts
    mesh: Any = None  # the mesh the functions run per shard over (``engine.shard_kernels``)
    state_copy: StateCopyFn = field(default=state_copy_xla, compare=False)
    conv_update: ConvUpdateFn | None = field(default=None, compare=False)
    residual_norm: ResidualNormFn | None = field(default=None, compare=False)
    attention_prologue: AttentionPrologueFn | None = field(default=None, compare=False)
    gated_norm: GatedNormFn | None = field(default=None, compare=False)
    tuning: Tuning = DEFAULT_TUNING
    page_size: int = 1  # KV pool rows a page: the TPU attention's DMA unit

    @property
    def adds_mlp_output_in_next_norm(self) -> bool:
        """Whether a layer hands its MLP output, not yet added, to the next layer's input
        norm (the residual-norm launch adds it): there is one and the tuning says so."""
        return self.residual_norm is not None and self.tuning.norm.mlp_output_in_next_norm

    def output_parts(self, num_tokens: int, num_experts: int | None) -> int:
        """How many float32 partial sums a mixer's output projection leaves for the residual
        norm after it (the tuning's ``output_parts`` up to ``output_parts_max_tokens``
        tokens), or 0 (one product): 0 too where there is no residual-norm launch or it
        would not launch for these tokens and a router of ``num_experts`` rows."""
        norm = self.tuning.norm
        if self.residual_norm is None or num_tokens > norm.output_parts_max_tokens:
            return 0
        return norm.output_parts if residual_norm_fits(num_tokens, num_experts, self.tuning) else 0


def norms_gdn_output(update: Any, num_tokens: int) -> bool:
    """Whether a GDN layer of ``num_tokens`` tokens hands ``update`` (a ``Kernels``
    state update) its output's gated norm with its conv tokens: up to the tokens the
    resolved update declares (``output_norm_max_tokens``, from the tuning; absent: none)."""
    return num_tokens <= getattr(update, "output_norm_max_tokens", 0)


def reads_qkv_in_place(prologue: Any) -> bool:
    """Whether an attention layer hands ``prologue`` (a ``Kernels`` prologue) one product's
    output to read q, k and v out of in place, and the paged attention its gate the same
    way: the resolved prologue declares it (``reads_one_product``, from the tuning)."""
    return bool(getattr(prologue, "reads_one_product", False))


XLA_KERNELS = Kernels("xla", None, None, None, state_scatter_xla)


def _bind(fn: Callable, *args: Any, tuning: Tuning, **attributes: Any) -> Callable:
    """``functools.partial(fn, *args, tuning=tuning)`` carrying ``fn``'s and the given
    attributes."""
    bound = functools.partial(fn, *args, tuning=tuning)
    for name in ("fuses_shared", "routes_tokens", "reads_channel_groups", "takes_one_product"):
        if hasattr(fn, name):
            setattr(bound, name, getattr(fn, name))
    for name, value in attributes.items():
        setattr(bound, name, value)
    return bound


def default_tuning(platform: str | None = None) -> Tuning:
    """The table's ``Tuning`` for ``platform``'s first device (``device_kinds.device_kind_key``)."""
    platform = platform_of(platform)
    try:
        kind = jax.devices(platform)[0].device_kind
    except RuntimeError:  # no such device here (e.g. resolving a TPU record on a CPU)
        kind = ""
    return tuning_for(device_kind_key(platform, kind))


@functools.cache
def kernels_for(
    kernel_backend: str | None = None,
    platform: str | None = None,
    moe_runner: str = "auto",
    tuning: Tuning | None = None,
    page_size: int = 1,
) -> Kernels:
    """The ``Kernels`` of ``resolve_backend(kernel_backend, platform)`` (``platform`` defaults
    to JAX's default) with ``tuning`` bound (None: ``default_tuning(platform)``). Pallas on a
    TPU: the scalar-prefetch state updates of ``*.update_tpu`` and ``moe.experts_tpu``,
    the ragged paged attention over the pool's pages of ``page_size`` rows and the XLA
    scatter; elsewhere the Triton-layout kernels (in interpret
    mode on CPU). ``moe_runner`` picks the routed experts' form: "pallas" the kernel, "xla"
    none (the layers' sort-based dispatch), "auto" the kernel on GPUs and in interpret mode,
    the XLA dispatch on TPUs (whose layout has run in interpret mode only)."""
    platform = platform_of(platform)
    tuning = default_tuning(platform) if tuning is None else tuning
    if resolve_backend(kernel_backend, platform) == "xla":
        return Kernels("xla", None, None, None, state_scatter_xla, tuning=tuning)
    if page_size < 1:
        raise ValueError(f"page_size={page_size} must be >= 1")
    tpu = platform == "tpu"
    bind = functools.partial(_bind, tuning=tuning)  # every launch is handed the tuning
    update = tpu_state_update if tpu else pallas_state_update
    moe = None
    if moe_runner == "pallas" or (moe_runner == "auto" and not tpu):
        moe = bind(tpu_moe_experts if tpu else pallas_moe_experts)
    # the Triton-layout GDN update takes the conv output as it is (``GdnConvTokens``) and
    # applies the output's gated norm up to the tuned tokens; the TPU layout takes neither
    norm_tokens = 0 if tpu else tuning.gdn.norm_in_update_max_tokens
    fits = never_conv_tokens if tpu else conv_tokens_fit
    gdn_update = bind(update, "gdn", takes_conv_tokens=fits, output_norm_max_tokens=norm_tokens)
    qkv_in_place = tuning.attention.qkv_in_place
    return Kernels(
        "pallas",
        platform,
        gdn_update,
        bind(update, "mamba2"),
        state_scatter_xla if tpu else bind(pallas_state_scatter),
        moe,
        bind(functools.partial(tpu_paged_attention, page_size=page_size))
        if tpu
        else bind(pallas_paged_attention),
        moe_runner,
        state_copy=state_copy_xla if tpu else bind(pallas_state_copy),
        conv_update=None if tpu else bind(pallas_conv_update),
        residual_norm=None if tpu else bind(pallas_residual_norm),
        attention_prologue=None
        if tpu
        else bind(pallas_attention_prologue, reads_one_product=qkv_in_place),
        gated_norm=None if tpu else bind(pallas_gated_norm),
        tuning=tuning,
        page_size=page_size if tpu else 1,
    )
