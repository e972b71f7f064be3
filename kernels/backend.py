"""Chooses between the Pallas kernels and their jnp/XLA forms for the recurrent-state updates
and the routed MoE experts and the paged attention.

``kernel_backend`` is "pallas" or "xla". The default is "pallas" on GPUs and "xla" on CPU
(where Pallas runs only in interpret mode, which the dispatch then uses: for tests) and on
TPU (never run there: ``kernel_backend="pallas"`` opts in to the scalar-prefetch state
update of ``state_update_tpu``; the conv update and the scatter stay on XLA on TPU).
The dispatch functions have the contracts of the functions they call (``state_update``,
``conv_update``, ``state_scatter`` modules); tile sizes are passed through to Pallas and
ignored by XLA. ``kernels_for`` resolves a backend once into a ``Kernels`` record of the
functions the model and the engine's steps call, with the default tiles bound.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import jax
import jax.numpy as jnp

from lazyspec.kernels.attention_prologue import all_powers_of_two, attention_prologue_pallas
from lazyspec.kernels.conv_update import (
    ChannelGroups,
    ConvUpdateResult,
    conv_update_pallas,
    conv_update_xla,
)
from lazyspec.kernels.gated_norm import GateLayout, gated_norm_pallas
from lazyspec.kernels.moe_experts import SharedExpert, TokenRouting, moe_experts_pallas
from lazyspec.kernels.paged_attention import DEFAULT_ATTENTION_TILES
from lazyspec.kernels.paged_attention import paged_attention as paged_attention_pallas
from lazyspec.kernels.residual_norm import ResidualNorm, residual_norm_pallas
from lazyspec.kernels.state_scatter import (
    state_copy_pallas,
    state_copy_xla,
    state_scatter_pallas,
    state_scatter_xla,
)
from lazyspec.kernels.state_update import (
    GdnConvTokens,
    GdnTokens,
    Mamba2Tokens,
    StateUpdateResult,
    gdn_state_update_pallas,
    gdn_state_update_xla,
    mamba2_state_update_pallas,
    mamba2_state_update_xla,
    powers_of_two,
)

KernelBackend = Literal["pallas", "xla"]
KERNEL_BACKENDS: tuple[str, ...] = ("pallas", "xla")
_TRITON_PLATFORMS = ("gpu", "cuda", "rocm")


def default_backend(platform: str | None = None) -> str:
    """ "pallas" on a GPU platform, else "xla" (platform defaults to JAX's default). TPU
    defaults to "xla" too: the kernels index a whole-array pool ref, which Mosaic TPU would
    stage into VMEM, and no TPU run has been made (``kernel_backend="pallas"`` still asks
    for them)."""
    platform = jax.default_backend() if platform is None else platform
    return "pallas" if platform in _TRITON_PLATFORMS else "xla"


def resolve_backend(name: str | None, platform: str | None = None) -> str:
    """The backend to use: ``name`` if given (validated), else the platform default."""
    if name is None:
        return default_backend(platform)
    if name not in KERNEL_BACKENDS:
        raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {name!r}")
    return name


def pallas_compiler_params(
    platform: str | None = None, num_warps: int = 4, num_stages: int = 1
) -> Any:
    """Compiler params for a compiled (not interpreted) launch: Triton on GPUs, where the
    in-kernel pool indexing is measured to work; None (the default lowering) elsewhere."""
    platform = jax.default_backend() if platform is None else platform
    if platform not in _TRITON_PLATFORMS:
        return None
    from jax.experimental.pallas import triton as pallas_triton

    return pallas_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# Tiles, warps per program and the decode load's cache hint: the fastest measured on an
# H200 at the model shapes (BENCHMARKS.md, "Recurrent-state kernels"). Where a preferred
# tile does not divide a model's axis, the largest power of two below it that does is used
# (Triton needs powers of two).
DEFAULT_STATE_TILES = {
    "gdn": {"block_value": 64, "num_warps": 4, "evict_last": False},
    "mamba2": {"block_value": 32, "num_warps": 8, "evict_last": True},
}
# Tiles timed at a batch-1 step (two rows of one token) apply up to this many tokens (rows x
# tokens a row); larger steps keep the defaults they were measured with.
SMALL_STEP_MAX_TOKENS = 2
# The GDN update's value tile up to SMALL_STEP_MAX_TOKENS tokens (0: DEFAULT_STATE_TILES').
# A batch-1 step's update had 2 rows x 32 heads x 2 value tiles = 128 programs at
# Qwen3-Next's widths (5.0-5.1 us a layer for 6 MiB of state in an H100 profile); 32 columns,
# twice the programs: the step 2.1 and 1.2 us shorter in two rounds on an H100
# (BENCHMARKS.md, 2026-12-06, ninth).
GDN_UPDATE_BLOCK_VALUE = 32
# A decode step's padding rows (slot 0; a one-request step runs one beside its row,
# ``layout.MIN_DECODE_TOKENS``) read a zero state in the Pallas updates instead of slot 0's
# (``skip_padding``): at batch 1 half of a GDN layer's state reads (2 MiB at Qwen3-Next's
# widths). The padding rows' outputs are discarded either way; slot 0 is never written.
# On: a batch-1 step 4.3 and 7.3 us shorter in two rounds on an H100 (BENCHMARKS.md,
# 2026-12-06, ninth); at any batch it only drops padding rows' loads.
UPDATE_SKIPS_PADDING_STATE = True
DEFAULT_SCATTER_TILES = {"block_rows": 8, "block_channels": 2048}
# Tiles a program of the pool-to-pool copy takes (``state_copy_pallas``). The copy runs in
# every in-place decode step and copies rows only at a boundary crossing; with one tile a
# program it launched layers x rows x 516 programs at Qwen3-Next's widths, nearly all
# returning at once: under 1 ns each on an H200 in the command-buffers-off profiles of
# BENCHMARKS.md (the state_commit scope: 4.9 us a step at batch 1, 31 and 120 us at 16 and
# 64). 16 tiles (64 KiB of state) a program launch a sixteenth as many; not yet measured.
COPY_TILES_PER_PROGRAM = 16
# the conv update's channel tile (``bench_kernels``' conv case runs it)
DEFAULT_CONV_TILES = {"block_channels": 256}
# Routed-expert tiles (``moe_experts``), measured on an H200 by the profiler's kernel times
# at Qwen3-Next widths (hidden 2048, expert intermediate 512; 64 experts top-10 and 256
# top-8), 1 to 2048 tokens (BENCHMARKS, "The routed-expert tiles by kernel time"): 64-column
# intermediate tiles are the fastest up launch at every count from 2 tokens (2 tokens of
# 64 experts: 22.5 against 29.4 us for 32 columns; at one token within 0.6 us either way).
DEFAULT_MOE_TILES = {
    "block_rows": 16,  # the smallest row tile Triton's dots take
    "block_inner": 64,
    "block_out": 128,  # 64 below MOE_WIDE_OUT_TOKENS tokens
    "block_k": 128,
    "num_warps": 4,
    "num_stages": 3,
}
# Token counts up to this run the routed experts in the Pallas kernel on a GPU, larger ones
# in the sort-based XLA dispatch (``layers.moe.grouped_experts``). Measured on an H200
# (``bench_moe.py``; BENCHMARKS, "Speculation by batch size and the routed experts at
# verify sizes"): at 256 / 1024 / 2048 tokens the kernel takes 0.66 / 0.85 / 1.1 ms at
# Qwen3-Next's 512 experts, where the XLA dispatch takes 8.6 ms at 256 and runs out of
# memory from 1024 (its ragged_dot staging); at 64 experts 0.16 / 0.36 ms against 1.05 /
# 4.3 ms at 256 / 1024. 2048 is the largest count measured and the most one extend step of
# the default settings holds (4 rows of 512).
MOE_KERNEL_MAX_TOKENS = 2048
# The TPU layout (``moe_experts_tpu``) has never run on a TPU: it keeps the decode-size
# limit it was written for.
MOE_TPU_KERNEL_MAX_TOKENS = 64
TRITON_MIN_DOT = 16  # Triton's dots need every dim >= 16
# From this many tokens the down launch takes output tiles of 128 columns, below it 64: at
# 1-4 tokens 64 columns are 0.5-1.2 us faster a launch, at 8-32 tokens the two are within
# 0.3 us, from 256 tokens 128 columns are faster (1024 tokens of 64 experts: 171 against
# 191 us).
MOE_WIDE_OUT_TOKENS = 16
# The routed experts' launches folded for a few tokens (``moe_experts_pallas``); they run
# in interpret mode and lower to Triton, and ``scripts/check_kernels.py`` checks each form
# compiled whatever these say. Timed in the engine on an H100 (BENCHMARKS, "folded MoE
# launches"): at batch 1 the three below shorten the step's device span by 1.5 % in three
# rounds; routing in up at 8 tokens lengthens it by 2 %, so each stops at the tokens timed.
# Re-read on an H100 with the later defaults (BENCHMARKS.md, 2026-12-05, sixth): both folds
# off, 19-20 us longer in two rounds; the routing alone apart, 1-2 us longer.
# MOE_ROUTE_IN_UP_MAX_TOKENS: up to this many tokens, where the kernel picks the tokens'
# experts from the router's logits, it does so inside the up launch (every program routing
# the tokens itself) rather than in a launch of its own before it, one launch fewer a MoE
# layer.
# MOE_DOWN_IN_UP_MAX_TOKENS: up to this many tokens the up launch's programs apply their
# rows of the down projection too (``down_in_up``: partial sums a program, no down launch),
# the down product taken MOE_DOWN_IN_UP_BLOCK_OUT output columns at a time; the partials
# grow with tokens x tiles (a batch-1 decode step, two rows: 11 used tiles x 8 inner tiles
# of two rows). 2 covers that step.
MOE_ROUTE_IN_UP_MAX_TOKENS = 2
MOE_DOWN_IN_UP_MAX_TOKENS = 2
MOE_DOWN_IN_UP_BLOCK_OUT = 256
# The up launch's intermediate tile when it applies the down product: each program writes a
# partial sum of the tokens' whole output rows, so wider tiles mean fewer partials to write
# and add (128 columns halve them) and fewer programs; 64, the separate launches' tile:
# on an H100, 128 (with 128 output columns) made a one-token launch 3.2 us slower and the
# batch-1 step 8 us slower (BENCHMARKS.md, 2026-12-05, fourth).
MOE_DOWN_IN_UP_BLOCK_INNER = 64
# The folded launch's contraction chunk, warps and pipeline stages (the separate launches
# take DEFAULT_MOE_TILES'); their own constants so that a benchmark can set them
# (``--kernel-switch``) and ``bench_moe.py --tiles fold:...`` sweeps them.
MOE_DOWN_IN_UP_BLOCK_K = 128
MOE_DOWN_IN_UP_NUM_WARPS = 4
MOE_DOWN_IN_UP_NUM_STAGES = 3
# The folded launch's unused tiles write zero partials and the partials are summed unmasked
# (``moe_experts_pallas(zero_unused=True)``): in an H200 profile of a batch-1 step the mask
# ran as a launch of its own before the sum, 2.7-3.1 us a MoE layer (BENCHMARKS.md,
# 2026-12-05, fifth). Off: on an H100 the step ran the same kernels (the mask there is part
# of the sum's fusion) and 10 us longer in two rounds (BENCHMARKS.md, 2026-12-05, sixth).
MOE_DOWN_IN_UP_ZERO_UNUSED = False
# Where the folded launch also routes (``route_in_up``), its grid is (inner tile, pair): a
# program per token's pair (top-k and the shared expert: 11 for Qwen3-Next) rather than per
# slot (pairs rounded up to a power of two, 16), a pair's programs at adjacent block ids,
# and 11/16 as many partials summed after it (``moe_experts_pallas(pair_grid=True)``). In
# an H100 profile of a batch-1 step (Nsight Compute, BENCHMARKS.md, 2026-12-05, seventh)
# the launch's 256 programs kept the SMs active 43 % of its cycles, 88 of them with an
# expert's work, spread in runs of 11 over the block ids. On: the batch-1 step 23.5 and
# 21.1 us shorter on an H100 in two calls (BENCHMARKS.md, 2026-12-06); with a 32-column
# intermediate tile (twice the programs and partials) 13 us longer than the defaults.
MOE_DOWN_IN_UP_PAIR_GRID = True
# The folded launch's programs add their partial sums into the tokens' output rows with
# float32 atomic adds (``moe_experts_pallas(atomic_sum=True)``): no launch after it sums
# the partials (in an H200 profile of a batch-1 step, a mask and a sum: 4.7-5.2 us a MoE
# layer, BENCHMARKS.md, 2026-12-05, fifth), for a zero fill before it. The additions' order
# then varies between runs. Off: on an H100 the batch-1 step ran 8 kernels fewer and 67 us
# longer (on the slot grid) and 55 us longer than the pair grid without it (BENCHMARKS.md,
# 2026-12-06): 88 programs adding whole rows into the same 2 x 2048 words cost more than
# the sum's launch.
MOE_DOWN_IN_UP_ATOMIC_SUM = False
# The residual add, the norm after it and the router's logits in one launch
# (``residual_norm``) up to this many tokens, and with a router up to this many tokens times
# experts; more run XLA's fusions. Every program holds a whole row and every token's
# programs read the whole router (from L2 after the first): a decode step's sizes. The
# largest measured (an H200, BENCHMARKS) is 64 tokens of 64 experts.
RESIDUAL_NORM_MAX_TOKENS = 64
RESIDUAL_NORM_MAX_TOKEN_EXPERTS = 64 * 64
# The attention prologue's launch up to a decode or verify step's token count (a program
# a token and kv head); a prefill chunk's norms and scatters stay XLA's fusions.
ATTENTION_PROLOGUE_MAX_TOKENS = 64
# Up to SMALL_STEP_MAX_TOKENS tokens, the prologue's query heads a program where set
# (``attention_prologue_pallas(block_q_heads=)``; 0: all of a kv head's). A batch-1 step's
# prologue had four programs (two tokens, two kv heads), each norming and rotating 8 query
# heads of 256 and its k: 5.4-5.6 us a layer in an H100 profile (BENCHMARKS.md, 2026-12-06,
# ninth). One query head a program (32 programs) was 5.2, 2.9, 3.7 and 3.2 us shorter a
# batch-1 step on an H100 in four rounds; two a program -0.9 and +0.9 (BENCHMARKS.md,
# 2026-12-06, tenth).
ATTENTION_PROLOGUE_Q_HEADS = 1
# The GDN output's gated norm in one launch (a program a token and head) up to this many
# tokens; a prefill chunk's stays XLA's fusions.
GATED_NORM_MAX_TOKENS = 64
# The paged attention's combine launch merges only the splits that read a block of each
# token's context (``paged_attention(active_splits=True)``): the split count follows the
# table's width (the configured context; a batch-1 step's two rows take 16 splits at 1024
# positions, 64 from 4096), the blocks read follow the lengths, and a split that read none
# weighs exactly 0. On: a batch-1 step 4-5 us shorter on an H100 in two rounds of
# ``bench_engine.py`` (BENCHMARKS.md, 2026-12-05, fourth); False merges every split.
ATTENTION_ACTIVE_SPLITS = True
# The combine launch's output columns a program (``paged_attention(combine_block=)``) up to
# SMALL_STEP_MAX_TOKENS tokens (0: a head's whole D). A batch-1 step's combine had four
# programs (two rows, two kv heads), each merging its 8 query heads' 256 columns over every
# active split: 5.0-5.2 us a layer in an H100 profile, where the attention launch before it
# took 5.1-5.4. 32 columns: the step 1.9 and 1.7 us shorter in two rounds on an H100
# (BENCHMARKS.md, 2026-12-06, ninth).
ATTENTION_COMBINE_BLOCK = 32
# Qwen3-Next's layers leave their MLP output for the next layer's input norm to add (its
# residual-norm launch takes it as the delta; ``adds_mlp_output_in_next_norm``): at a
# batch-1 step the add is a launch of its own after the routed experts' partial sums (7 a
# step on an H100's profile), and an attention layer's input norm becomes the launch's.
# On: a batch-1 step 8-10 us shorter on an H200 in two rounds of ``bench_engine.py``
# (0.806 / 0.807 ms against 0.816 / 0.815; 110 kernels against 118) and with the switch
# below 0.794 ms in three runs (BENCHMARKS.md, 2026-12-05, fifth).
MLP_OUTPUT_IN_NEXT_NORM = True
# An attention layer with the prologue launch computes q, k and v in one product (the
# three weights side by side, a concatenation XLA can read inside its product) and the
# prologue reads k and v, and the paged attention's combine each head's gate, out of that
# output in place (``reads_qkv_in_place``). Without it XLA merges the three products itself
# and copies each output out of the merged one, and the gate is sliced out of q's: four
# small launches a layer. On: a batch-1 step 10-11 us shorter on an H200 in two rounds of
# ``bench_engine.py`` (0.805 / 0.805 ms against 0.816 / 0.815; XLA reads the concatenated
# weights in its product, no copy); with the switch above, a batch-16 step 1.699 against
# 1.793 ms and batch 64 2.385 against 2.391 (BENCHMARKS.md, 2026-12-05, fifth).
ATTENTION_QKV_IN_PLACE = True
# Up to this many tokens (rows x tokens a row) the GDN output's gated norm runs in the
# state update's launch (``OutputNorm``: the layer hands it with the conv tokens where
# ``norms_gdn_output``), one launch fewer a GDN layer; a program then holds a whole head
# (value tile 128 at Qwen3-Next's widths, where the update alone takes 32 up to
# SMALL_STEP_MAX_TOKENS tokens), with GDN_NORM_IN_UPDATE_WARPS warps. At batch 1 on an H100
# the step first ran 6 kernels fewer and no shorter (0.919 / 0.916 ms against 0.916 /
# 0.915; BENCHMARKS.md, 2026-12-05, fourth); with the later kernels 1.1 and 0.8 us shorter
# in two rounds, 78 kernels a token step against 84 (BENCHMARKS.md, 2026-12-06, eleventh):
# on at a batch-1 step's 2 tokens.
GDN_NORM_IN_UPDATE_MAX_TOKENS = 2
GDN_NORM_IN_UPDATE_WARPS = 8
# The residual-norm launch's router rows a program and its warps (``residual_norm_pallas``:
# a program per token and router tile, each normalising its token's whole row).
RESIDUAL_NORM_BLOCK_EXPERTS = 4
RESIDUAL_NORM_NUM_WARPS = 4
# Up to RESIDUAL_NORM_FEW_TOKENS tokens the launch takes RESIDUAL_NORM_FEW_BLOCK_EXPERTS
# router rows a program and RESIDUAL_NORM_FEW_NUM_WARPS warps instead: a router row a
# program, so a few tokens' logits are spread over as many programs as the router has rows.
# On an H100 (BENCHMARKS.md, 2026-12-05, sixth), one row and 8 warps for every launch
# shortened the step by 13-15 us at batch 1 (launches of 2 rows) and 8-11 us at batch 16
# (16 rows) and lengthened it by 63 us at batch 64 (64 rows); with the tile by token count,
# 19 us shorter at batch 1 (one round) and 4-6 us at batch 16 (two of three rounds).
RESIDUAL_NORM_FEW_TOKENS = 16
RESIDUAL_NORM_FEW_BLOCK_EXPERTS = 1
RESIDUAL_NORM_FEW_NUM_WARPS = 8
# Qwen3-Next's mixers leave their output projection (the GDN layer's ``out_proj``, the
# attention's ``o_proj``) as float32 partial sums over OUTPUT_PARTS_IN_NORM parts of its
# contraction, one batched product (``linear.linear_parts``), and the residual-norm launch
# after it sums them (``residual_norm_pallas``' partials), up to OUTPUT_PARTS_MAX_TOKENS
# tokens: at a decode step XLA runs each such product as a split-K GEMM and a reduction
# launch of its own (1.05 us, 8 a batch-1 step in an H200 profile, BENCHMARKS.md,
# 2026-12-05, fifth). Only where that launch runs (``output_parts``). On an H100
# (BENCHMARKS.md, 2026-12-05, seventh) four parts shortened the batch-1 step (a launch of 2 tokens)
# by 3.0-3.3 us and lengthened batch 16 by 22-27 us and batch 64 by 45 us, hence the
# token bound. 0 parts: off.
OUTPUT_PARTS_IN_NORM = 4
OUTPUT_PARTS_MAX_TOKENS = 2


def norms_gdn_output(update: Any, num_tokens: int) -> bool:
    """Whether a GDN layer of ``num_tokens`` tokens hands ``update`` (a
    ``gdn_state_update``) its output's gated norm with its conv tokens: the kernel takes
    one and they are at most ``GDN_NORM_IN_UPDATE_MAX_TOKENS``, read when the layer is
    traced, as the other dispatch constants are."""
    takes = bool(getattr(update, "takes_output_norm", False))
    return takes and num_tokens <= GDN_NORM_IN_UPDATE_MAX_TOKENS


def output_parts(kernels: Any, num_tokens: int, num_experts: int | None) -> int:
    """How many float32 partial sums a mixer's output projection leaves for the residual
    norm after it (``OUTPUT_PARTS_IN_NORM`` up to ``OUTPUT_PARTS_MAX_TOKENS`` tokens, read
    when the forward is traced), or 0 (one product): 0 too where ``kernels`` has no
    residual-norm launch or it would not launch for ``num_tokens`` tokens and a router of
    ``num_experts`` rows (``residual_norm_fits``), where the partials would only add XLA's
    sum."""
    if getattr(kernels, "residual_norm", None) is None or num_tokens > OUTPUT_PARTS_MAX_TOKENS:
        return 0
    return OUTPUT_PARTS_IN_NORM if residual_norm_fits(num_tokens, num_experts) else 0


def adds_mlp_output_in_next_norm(kernels: Any) -> bool:
    """Whether a layer hands its MLP output, not yet added, to the next layer's input norm
    (the residual-norm launch adds it): ``kernels`` has the launch and
    ``MLP_OUTPUT_IN_NEXT_NORM`` is on, read when the forward is traced."""
    return getattr(kernels, "residual_norm", None) is not None and MLP_OUTPUT_IN_NEXT_NORM


def moe_output_as_part(kernels: Any, num_tokens: int) -> bool:
    """Whether a MoE layer of ``num_tokens`` tokens hands its output, not yet added, to the
    next layer's input norm in float32 as one partial sum (``sparse_moe(as_part=True)``;
    the residual-norm launch rounds it): where that norm adds it
    (``adds_mlp_output_in_next_norm``) and the folded launch leaves its sums itself
    (``MOE_DOWN_IN_UP_ATOMIC_SUM``, up to ``MOE_DOWN_IN_UP_MAX_TOKENS`` tokens), so that
    no launch rounds them in between."""
    folded = MOE_DOWN_IN_UP_ATOMIC_SUM and num_tokens <= MOE_DOWN_IN_UP_MAX_TOKENS
    return folded and adds_mlp_output_in_next_norm(kernels)


def reads_qkv_in_place(prologue: Any) -> bool:
    """Whether an attention layer hands ``prologue`` (an ``attention_prologue`` entry) one
    product's output to read q, k and v out of in place, and the paged attention its gate
    the same way: the launch takes one (``takes_one_product``) and
    ``ATTENTION_QKV_IN_PLACE`` is on, read when the layer is traced."""
    return bool(getattr(prologue, "takes_one_product", False)) and ATTENTION_QKV_IN_PLACE


def fitted_tile(size: int, preferred: int) -> int:
    """The largest power of two <= ``preferred`` that divides ``size`` (at least 1)."""
    tile = 1
    while tile * 2 <= preferred and size % (tile * 2) == 0:
        tile *= 2
    return tile


def small_step_tile(num_tokens: int, size: int, preferred: int) -> int | None:
    """``fitted_tile(size, preferred)`` at a step of up to ``SMALL_STEP_MAX_TOKENS`` tokens
    where the switch ``preferred`` is set (> 0); else None: the launch keeps its own tile."""
    if preferred > 0 and num_tokens <= SMALL_STEP_MAX_TOKENS:
        return fitted_tile(size, preferred)
    return None


def _on(platform: str | None, name: str) -> bool:
    """Whether ``platform`` (default: JAX's default backend) is ``name``."""
    return (jax.default_backend() if platform is None else platform) == name


def _pallas_options(interpret: bool, compiler_params: Any, num_warps: int = 4) -> dict[str, Any]:
    """Interpret mode when asked or on CPU (where Pallas has no compiled lowering), else
    Triton compiler params."""
    if interpret or _on(None, "cpu"):
        return {"interpret": True, "compiler_params": None}
    if compiler_params is None:
        compiler_params = pallas_compiler_params(num_warps=num_warps)
    return {"interpret": False, "compiler_params": compiler_params}


_XLA_UPDATES = {"gdn": gdn_state_update_xla, "mamba2": mamba2_state_update_xla}
_PALLAS_UPDATES = {"gdn": gdn_state_update_pallas, "mamba2": mamba2_state_update_pallas}


def _mixer(tokens: GdnTokens | GdnConvTokens | Mamba2Tokens) -> str:
    if isinstance(tokens, (GdnTokens, GdnConvTokens)):
        return "gdn"
    if isinstance(tokens, Mamba2Tokens):
        return "mamba2"
    raise ValueError(f"tokens must be GdnTokens or Mamba2Tokens, got {type(tokens).__name__}")


def _values(tokens: GdnTokens | Mamba2Tokens) -> jax.Array:
    """The tokens' values ``[B, T, H, d]`` (GDN's v, Mamba2's x)."""
    return tokens.v if isinstance(tokens, GdnTokens) else tokens.x


def _tpu_state_update(
    mixer: str,
    pool: jax.Array,
    slot: jax.Array,
    tokens: GdnTokens | Mamba2Tokens,
    *,
    mode: str,
    layer: int | None = None,
    interpret: bool = False,
) -> StateUpdateResult:
    """The scalar-prefetch kernels of ``state_update_tpu``, with their own default tiles."""
    from lazyspec.kernels import state_update_tpu  # Mosaic imports only where used

    tpu_fn = getattr(state_update_tpu, f"{mixer}_state_update_tpu")
    return tpu_fn(pool, slot, tokens, mode=mode, layer=layer, interpret=interpret)


def _pallas_state_update(
    mixer: str,
    pool: jax.Array,
    slot: jax.Array,
    tokens: GdnTokens | Mamba2Tokens,
    *,
    mode: str,
    block_heads: int = 1,
    block_value: int | None = None,
    evict_last: bool | None = None,
    layer: int | None = None,
    interpret: bool = False,
    compiler_params: Any = None,
) -> StateUpdateResult:
    """The Triton-layout kernel of ``mixer``; tiles left as None take ``DEFAULT_STATE_TILES``
    (GDN: ``GDN_UPDATE_BLOCK_VALUE`` up to ``SMALL_STEP_MAX_TOKENS`` tokens where set; GDN
    conv tokens with an ``OutputNorm``: a whole head a program, with
    ``GDN_NORM_IN_UPDATE_WARPS`` warps)."""
    tiles = DEFAULT_STATE_TILES[mixer]
    conv = isinstance(tokens, GdnConvTokens)
    value_dim = tokens.head_dim if conv else _values(tokens).shape[-1]
    if mixer == "gdn":
        lead = (tokens.conv_out if conv else _values(tokens)).shape[:2]
        small = small_step_tile(lead[0] * lead[1], value_dim, GDN_UPDATE_BLOCK_VALUE)
        if small is not None:
            tiles = {**tiles, "block_value": small}
    if conv and tokens.norm is not None:
        tiles = {**tiles, "block_value": tokens.head_dim, "num_warps": GDN_NORM_IN_UPDATE_WARPS}
    if block_value is None:
        block_value = fitted_tile(value_dim, tiles["block_value"])
    if evict_last is None:
        evict_last = tiles["evict_last"]
    return _PALLAS_UPDATES[mixer](
        pool,
        slot,
        tokens,
        mode=mode,
        block_heads=block_heads,
        block_value=block_value,
        evict_last=evict_last,
        layer=layer,
        skip_padding=UPDATE_SKIPS_PADDING_STATE,
        **_pallas_options(interpret, compiler_params, tiles["num_warps"]),
    )


def state_update(
    pool: jax.Array,
    slot: jax.Array,
    tokens: GdnTokens | Mamba2Tokens,
    *,
    mode: str,
    kernel_backend: str | None = None,
    block_heads: int = 1,
    block_value: int | None = None,
    evict_last: bool | None = None,
    layer: int | None = None,
    interpret: bool = False,
    compiler_params: Any = None,
    platform: str | None = None,
) -> StateUpdateResult:
    """GDN or Mamba2 T-step update (chosen by the type of ``tokens``) on the chosen backend;
    ``layer=l``: ``pool`` is the stacked pool of all layers and layer l's rows are used.
    ``block_value``, ``evict_last`` and ``compiler_params`` left as None take
    ``DEFAULT_STATE_TILES``. On a TPU
    platform (``platform`` defaults to JAX's default) Pallas means the scalar-prefetch
    kernels of ``state_update_tpu`` with their own default tiles (the tile arguments, meant
    for the Triton layout, are ignored there)."""
    mixer = _mixer(tokens)
    xla, tpu = resolve_backend(kernel_backend, platform) == "xla", _on(platform, "tpu")
    if isinstance(tokens, GdnConvTokens) and (xla or tpu):
        raise ValueError("GdnConvTokens run only in the Triton-layout Pallas kernel")
    if xla:
        return _XLA_UPDATES[mixer](pool, slot, tokens, mode=mode, layer=layer)
    if tpu:
        return _tpu_state_update(
            mixer, pool, slot, tokens, mode=mode, layer=layer, interpret=interpret
        )
    return _pallas_state_update(
        mixer,
        pool,
        slot,
        tokens,
        mode=mode,
        block_heads=block_heads,
        block_value=block_value,
        evict_last=evict_last,
        layer=layer,
        interpret=interpret,
        compiler_params=compiler_params,
    )


def _pallas_conv_update(
    pool: jax.Array,
    slot: jax.Array,
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None = None,
    *,
    mode: str,
    silu: bool = True,
    num_new: jax.Array | None = None,
    layer: int | None = None,
    out_dtype: Any = None,
    channel_groups: ChannelGroups | None = None,
    block_channels: int | None = None,
    interpret: bool = False,
    compiler_params: Any = None,
) -> ConvUpdateResult:
    """The Triton-layout conv update; ``block_channels`` left as None takes
    ``DEFAULT_CONV_TILES`` fitted to the channels (with ``channel_groups``, to its parts and
    group stride)."""
    if block_channels is None:
        fit = x.shape[2]
        if channel_groups is not None:
            fit = math.gcd(*channel_groups.parts, channel_groups.check(x.shape[2]))
        block_channels = fitted_tile(fit, DEFAULT_CONV_TILES["block_channels"])
    return conv_update_pallas(
        pool,
        slot,
        x,
        weight,
        bias,
        mode=mode,
        silu=silu,
        num_new=num_new,
        layer=layer,
        out_dtype=out_dtype,
        channel_groups=channel_groups,
        block_channels=block_channels,
        **_pallas_options(interpret, compiler_params),
    )


# the GDN layers hand this kernel Qwen3-Next's fused projection as it is (``ChannelGroups``);
# the per-shard form takes the conv channels in order
_pallas_conv_update.reads_channel_groups = True


def conv_update(
    pool: jax.Array,
    slot: jax.Array,
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None = None,
    *,
    mode: str,
    silu: bool = True,
    num_new: jax.Array | None = None,
    layer: int | None = None,
    out_dtype: Any = None,
    channel_groups: ChannelGroups | None = None,
    kernel_backend: str | None = None,
    block_channels: int | None = None,
    interpret: bool = False,
    compiler_params: Any = None,
) -> ConvUpdateResult:
    """Causal conv update for T tokens per row on the chosen backend (XLA on TPU);
    ``layer=l``: ``pool`` is the stacked pool of all layers; ``channel_groups``: x holds the
    channels grouped so (``conv_update.ChannelGroups``)."""
    if resolve_backend(kernel_backend) == "xla" or _on(None, "tpu"):
        return conv_update_xla(
            pool, slot, x, weight, bias, mode=mode, silu=silu, num_new=num_new, layer=layer,
            out_dtype=out_dtype, channel_groups=channel_groups,
        )  # fmt: skip
    return _pallas_conv_update(
        pool,
        slot,
        x,
        weight,
        bias,
        mode=mode,
        silu=silu,
        num_new=num_new,
        layer=layer,
        out_dtype=out_dtype,
        channel_groups=channel_groups,
        block_channels=block_channels,
        interpret=interpret,
        compiler_params=compiler_params,
    )


def _scatter_tiles(
    ssm_pool: jax.Array, conv_pool: jax.Array, block_rows: int | None, block_channels: int | None
) -> tuple[int, int]:
    """The scatter's and the copy's row and channel tiles: those given, else
    ``DEFAULT_SCATTER_TILES`` fitted to the pools."""
    if block_rows is None:
        block_rows = fitted_tile(ssm_pool.shape[3], DEFAULT_SCATTER_TILES["block_rows"])
    if block_channels is None:
        block_channels = fitted_tile(conv_pool.shape[2], DEFAULT_SCATTER_TILES["block_channels"])
    return block_rows, block_channels


def _pallas_state_scatter(
    ssm_pool: jax.Array,
    conv_pool: jax.Array,
    ssm_steps: jax.Array,
    conv_steps: jax.Array,
    dst_slot: jax.Array,
    step: jax.Array,
    *,
    block_heads: int = 1,
    block_rows: int | None = None,
    block_channels: int | None = None,
    layer: int | None = None,
    interpret: bool = False,
    compiler_params: Any = None,
) -> tuple[jax.Array, jax.Array]:
    """The Pallas scatter; tiles left as None take ``DEFAULT_SCATTER_TILES``."""
    block_rows, block_channels = _scatter_tiles(ssm_pool, conv_pool, block_rows, block_channels)
    return state_scatter_pallas(
        ssm_pool,
        conv_pool,
        ssm_steps,
        conv_steps,
        dst_slot,
        step,
        block_heads=block_heads,
        block_rows=block_rows,
        block_channels=block_channels,
        layer=layer,
        **_pallas_options(interpret, compiler_params),
    )


def state_scatter(
    ssm_pool: jax.Array,
    conv_pool: jax.Array,
    ssm_steps: jax.Array,
    conv_steps: jax.Array,
    dst_slot: jax.Array,
    step: jax.Array,
    *,
    kernel_backend: str | None = None,
    block_heads: int = 1,
    block_rows: int | None = None,
    block_channels: int | None = None,
    layer: int | None = None,
    interpret: bool = False,
    compiler_params: Any = None,
) -> tuple[jax.Array, jax.Array]:
    """Masked copy ``pool[l, dst_slot[b]] = steps[l, b, step[b]]`` on the chosen backend (XLA
    on TPU); with ``layer=l`` the scratch is that one layer's. Tiles left as None take
    ``DEFAULT_SCATTER_TILES``."""
    args = (ssm_pool, conv_pool, ssm_steps, conv_steps, dst_slot, step)
    if resolve_backend(kernel_backend) == "xla" or _on(None, "tpu"):
        return state_scatter_xla(*args, layer=layer)
    return _pallas_state_scatter(
        *args,
        block_heads=block_heads,
        block_rows=block_rows,
        block_channels=block_channels,
        layer=layer,
        interpret=interpret,
        compiler_params=compiler_params,
    )


def _pallas_state_copy(
    ssm_pool: jax.Array,
    conv_pool: jax.Array,
    src_slot: jax.Array,
    dst_slot: jax.Array,
    *,
    block_heads: int = 1,
    block_rows: int | None = None,
    block_channels: int | None = None,
    interpret: bool = False,
    compiler_params: Any = None,
) -> tuple[jax.Array, jax.Array]:
    """The Pallas pool-to-pool copy; tiles left as None take ``DEFAULT_SCATTER_TILES``."""
    block_rows, block_channels = _scatter_tiles(ssm_pool, conv_pool, block_rows, block_channels)
    return state_copy_pallas(
        ssm_pool,
        conv_pool,
        src_slot,
        dst_slot,
        block_heads=block_heads,
        block_rows=block_rows,
        block_channels=block_channels,
        tiles_per_program=COPY_TILES_PER_PROGRAM,
        **_pallas_options(interpret, compiler_params),
    )


def state_copy(
    ssm_pool: jax.Array,
    conv_pool: jax.Array,
    src_slot: jax.Array,
    dst_slot: jax.Array,
    *,
    kernel_backend: str | None = None,
    interpret: bool = False,
    **tiles: Any,
) -> tuple[jax.Array, jax.Array]:
    """Masked pool-to-pool copy ``pool[l, dst_slot[b]] = pool[l, src_slot[b]]`` (rows with
    ``dst_slot[b] == 0`` write nothing) on the chosen backend (XLA on TPU); tiles as
    ``state_scatter``'s."""
    args = (ssm_pool, conv_pool, src_slot, dst_slot)
    if resolve_backend(kernel_backend) == "xla" or _on(None, "tpu"):
        return state_copy_xla(*args)
    return _pallas_state_copy(*args, interpret=interpret, **tiles)


def moe_launch_params(down_in_up: bool) -> dict[str, int]:
    """The warps and pipeline stages ``moe_launch`` compiles its form with: the folded
    launch's own (``MOE_DOWN_IN_UP_NUM_WARPS``, ``_NUM_STAGES``), else
    ``DEFAULT_MOE_TILES``'."""
    if down_in_up:
        return {"num_warps": MOE_DOWN_IN_UP_NUM_WARPS, "num_stages": MOE_DOWN_IN_UP_NUM_STAGES}
    return {key: DEFAULT_MOE_TILES[key] for key in ("num_warps", "num_stages")}


def moe_launch(
    num_tokens: int, up: jax.Array, down: jax.Array, interpret: bool = False, **tiles: Any
) -> dict[str, Any] | None:
    """The keyword arguments ``moe_experts_pallas`` runs ``num_tokens`` tokens with (tiles
    not given take ``DEFAULT_MOE_TILES``, fitted to the widths), or None where the caller's
    XLA form runs instead: more than ``MOE_KERNEL_MAX_TOKENS`` tokens or, compiled for
    Triton, widths whose fitted tiles fall below ``TRITON_MIN_DOT`` (interpret mode runs any
    tile, so the tiny test models still exercise the kernel). Depends on the widths only,
    not on the number of experts."""
    if num_tokens > MOE_KERNEL_MAX_TOKENS:
        return None
    route_in_up = tiles.pop("route_in_up", num_tokens <= MOE_ROUTE_IN_UP_MAX_TOKENS)
    inner, out_width = up.shape[2], down.shape[2]
    defaults = DEFAULT_MOE_TILES
    tiles.setdefault("block_rows", defaults["block_rows"])
    block_inner = defaults["block_inner"]
    block_out = defaults["block_out"] // (1 if num_tokens >= MOE_WIDE_OUT_TOKENS else 2)
    down_in_up = tiles.pop("down_in_up", num_tokens <= MOE_DOWN_IN_UP_MAX_TOKENS)
    block_k = defaults["block_k"]
    if down_in_up:
        block_inner, block_out = MOE_DOWN_IN_UP_BLOCK_INNER, MOE_DOWN_IN_UP_BLOCK_OUT
        block_k = MOE_DOWN_IN_UP_BLOCK_K
    tiles.setdefault("block_inner", fitted_tile(inner, block_inner))
    tiles.setdefault("block_out", fitted_tile(out_width, block_out))
    tiles.setdefault("block_k", fitted_tile(math.gcd(up.shape[1], inner), block_k))
    params = pallas_compiler_params(**moe_launch_params(down_in_up))
    options = _pallas_options(interpret, params)
    if not options["interpret"] and min(tiles.values()) < TRITON_MIN_DOT:
        return None  # widths with no power-of-two tile Triton's dots take
    zero_unused = down_in_up and MOE_DOWN_IN_UP_ZERO_UNUSED
    return {
        **tiles,
        **options,
        "route_in_up": route_in_up,
        "down_in_up": down_in_up,
        "zero_unused": zero_unused,
        "pair_grid": down_in_up and route_in_up and MOE_DOWN_IN_UP_PAIR_GRID,
        "atomic_sum": down_in_up and MOE_DOWN_IN_UP_ATOMIC_SUM,
    }


def _pallas_moe_experts(
    x: jax.Array,
    weights: jax.Array,
    expert_ids: jax.Array,
    up: jax.Array,
    down: jax.Array,
    gate: jax.Array | None = None,
    *,
    xla_form: Callable[[], jax.Array],
    shared: SharedExpert | None = None,
    routing: TokenRouting | None = None,
    interpret: bool = False,
    **tiles: Any,
) -> jax.Array:
    """The routed experts by shape: ``moe_experts_pallas`` where ``moe_launch`` gives its
    arguments, else ``xla_form()``, the caller's sort-based dispatch with the same
    contract. ``shared``: a shared expert run in the same launches (``moe_experts_pallas``);
    ``xla_form`` then adds it too. ``routing``: the router's logits, from which the kernel
    picks the experts of a few tokens itself (``moe_experts_pallas``)."""
    launch = moe_launch(x.shape[0], up, down, interpret, **tiles)
    if launch is None:
        return xla_form()
    return moe_experts_pallas(
        x, weights, expert_ids, up, down, gate, shared=shared, routing=routing, **launch
    )


# the MoE layers hand this function their shared expert and router logits
# (``layers.moe.sparse_moe``, ``routed_experts``); its per-shard form and the TPU layout
# take neither
_pallas_moe_experts.fuses_shared = True
_pallas_moe_experts.routes_tokens = True


def _tpu_moe_experts(
    x: jax.Array,
    weights: jax.Array,
    expert_ids: jax.Array,
    up: jax.Array,
    down: jax.Array,
    gate: jax.Array | None = None,
    *,
    xla_form: Callable[[], jax.Array],
    interpret: bool = False,
    **tiles: Any,
) -> jax.Array:
    """``_pallas_moe_experts`` with the scalar-prefetch kernel of ``moe_experts_tpu``; tiles
    not given are 128 inner and 512 output columns where those divide (else the whole
    axis), which keeps the double-buffered weight blocks near 2 MiB at Qwen3-Next widths."""
    if x.shape[0] > MOE_TPU_KERNEL_MAX_TOKENS:
        return xla_form()
    from lazyspec.kernels import moe_experts_tpu  # Mosaic imports only where used

    inner, out_width = up.shape[2], down.shape[2]
    tiles.setdefault("block_inner", 128 if inner % 128 == 0 else inner)
    tiles.setdefault("block_out", 512 if out_width % 512 == 0 else out_width)
    return moe_experts_tpu.moe_experts_tpu(
        x, weights, expert_ids, up, down, gate, interpret=interpret, **tiles
    )


def residual_norm_fits(num_tokens: int, num_experts: int | None) -> bool:
    """Whether ``Kernels.residual_norm`` launches for this many tokens (and router
    experts, None without a router): up to ``RESIDUAL_NORM_MAX_TOKENS`` tokens and tokens
    times experts up to ``RESIDUAL_NORM_MAX_TOKEN_EXPERTS``; else XLA's fusions run."""
    return (
        num_tokens <= RESIDUAL_NORM_MAX_TOKENS
        and num_tokens * (num_experts or 1) <= RESIDUAL_NORM_MAX_TOKEN_EXPERTS
    )


def residual_norm_tiles(num_tokens: int) -> dict[str, int]:
    """The residual-norm launch's router rows a program and warps at ``num_tokens``
    tokens: ``RESIDUAL_NORM_FEW_*`` up to ``RESIDUAL_NORM_FEW_TOKENS`` tokens, else
    ``RESIDUAL_NORM_BLOCK_EXPERTS`` and ``RESIDUAL_NORM_NUM_WARPS`` (read when called, so
    that a benchmark's ``--kernel-switch`` sets them)."""
    if num_tokens <= RESIDUAL_NORM_FEW_TOKENS:
        return {
            "block_experts": RESIDUAL_NORM_FEW_BLOCK_EXPERTS,
            "num_warps": RESIDUAL_NORM_FEW_NUM_WARPS,
        }
    return {"block_experts": RESIDUAL_NORM_BLOCK_EXPERTS, "num_warps": RESIDUAL_NORM_NUM_WARPS}


def _pallas_residual_norm(
    x: jax.Array,
    delta: jax.Array | None,
    weight: jax.Array,
    router: jax.Array | None = None,
    *,
    eps: float,
    zero_centered: bool = False,
    logits_dtype: Any = jnp.float32,
    xla_form: Callable[[], ResidualNorm],
    interpret: bool = False,
    **tiles: Any,
) -> ResidualNorm:
    """``residual_norm_pallas`` with ``residual_norm_tiles``' router rows a program and
    warps (``tiles`` overrides them) up to ``RESIDUAL_NORM_MAX_TOKENS`` tokens (and, with a
    router, tokens times experts up to ``RESIDUAL_NORM_MAX_TOKEN_EXPERTS``); else, or where
    a compiled launch would need a row that is not a power of two wide (Triton),
    ``xla_form()``, the caller's ops with the same contract."""
    (num_tokens, width), experts = x.shape, None if router is None else router.shape[0]
    tiles = {**residual_norm_tiles(num_tokens), **tiles}
    options = _pallas_options(interpret, None, tiles.pop("num_warps"))
    fits = residual_norm_fits(num_tokens, experts)
    if not fits or not (options["interpret"] or powers_of_two(width)):
        return xla_form()
    if router is not None:
        tiles["block_experts"] = fitted_tile(experts, tiles["block_experts"])
    options.update(eps=eps, zero_centered=zero_centered, logits_dtype=logits_dtype)
    return residual_norm_pallas(x, delta, weight, router, **tiles, **options)


def _pallas_attention_prologue(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    write_idx: jax.Array,
    num_new: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    q_norm: jax.Array | None = None,
    k_norm: jax.Array | None = None,
    *,
    eps: float,
    zero_centered: bool = False,
    rotary_dim: int = 0,
    rope_theta: float = 10000.0,
    num_heads: int | None = None,
    k_head_at: int = 0,
    v_head_at: int = 0,
    xla_form: Callable[[], tuple[jax.Array, jax.Array, jax.Array]],
    interpret: bool = False,
    num_warps: int = 4,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``attention_prologue_pallas`` up to ``ATTENTION_PROLOGUE_MAX_TOKENS`` tokens; else,
    or where a compiled launch would move a block that is not a power of two (Triton: the
    query heads of a kv head, a head's width with its gate, a piece of a head), ``xla_form()``,
    the caller's ops with the same contract."""
    options = _pallas_options(interpret, None, num_warps)
    num_heads = q.shape[1] if num_heads is None else num_heads
    head_dim, groups = k_pool.shape[2], num_heads // k_pool.shape[1]
    fits = powers_of_two(groups, q.shape[2], head_dim) and all_powers_of_two(head_dim, rotary_dim)
    if q.shape[0] > ATTENTION_PROLOGUE_MAX_TOKENS or not (options["interpret"] or fits):
        return xla_form()
    # a kv head's query heads over several programs, at a few tokens
    block_q_heads = small_step_tile(q.shape[0], groups, ATTENTION_PROLOGUE_Q_HEADS)
    return attention_prologue_pallas(
        q,
        k,
        v,
        positions,
        write_idx,
        num_new,
        k_pool,
        v_pool,
        q_norm,
        k_norm,
        eps=eps,
        zero_centered=zero_centered,
        rotary_dim=rotary_dim,
        rope_theta=rope_theta,
        num_heads=num_heads,
        k_head_at=k_head_at,
        v_head_at=v_head_at,
        block_q_heads=block_q_heads,
        **options,
    )


# reads q, k and v out of one product's output (``num_heads``, ``k_head_at``, ``v_head_at``)
_pallas_attention_prologue.takes_one_product = True


def _pallas_gated_norm(
    x: jax.Array,
    z_source: jax.Array,
    layout: GateLayout,
    weight: jax.Array,
    *,
    eps: float,
    dtype: Any,
    xla_form: Callable[[], jax.Array],
    interpret: bool = False,
    num_warps: int = 1,
) -> jax.Array:
    """``gated_norm_pallas`` up to ``GATED_NORM_MAX_TOKENS`` tokens where the gates' columns
    are whole blocks of d (and, compiled, d a power of two); else ``xla_form()``, the
    caller's ops with the same contract."""
    options = _pallas_options(interpret, None, num_warps)
    head_dim = x.shape[-1]
    fits = layout.in_whole_blocks(head_dim) and (options["interpret"] or powers_of_two(head_dim))
    if x.shape[0] > GATED_NORM_MAX_TOKENS or not fits:
        return xla_form()
    return gated_norm_pallas(x, z_source, layout, weight, eps=eps, dtype=dtype, **options)


def _pallas_paged_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    token_table: jax.Array,
    ctx_len: jax.Array,
    positions: jax.Array,
    scale: float,
    *,
    gate: jax.Array | None = None,
    interpret: bool = False,
    compiler_params: Any = None,
    **tiles: Any,
) -> jax.Array:
    """``paged_attention.paged_attention`` with its default tiles (``tiles`` overrides them),
    ``ATTENTION_ACTIVE_SPLITS`` and ``ATTENTION_COMBINE_BLOCK`` (up to
    ``SMALL_STEP_MAX_TOKENS`` tokens; 0: none), in interpret mode on CPU;
    compiler params left as None take the warps and stages of ``DEFAULT_ATTENTION_TILES``."""
    tiles.setdefault("active_splits", ATTENTION_ACTIVE_SPLITS)
    num_tokens = q.shape[0] * q.shape[1]
    tiles.setdefault(
        "combine_block", small_step_tile(num_tokens, q.shape[-1], ATTENTION_COMBINE_BLOCK)
    )
    if compiler_params is None:
        launch = DEFAULT_ATTENTION_TILES
        compiler_params = pallas_compiler_params(
            num_warps=launch["num_warps"], num_stages=launch["num_stages"]
        )
    return paged_attention_pallas(
        q,
        k_pool,
        v_pool,
        token_table,
        ctx_len,
        positions,
        scale,
        gate=gate,
        **tiles,
        **_pallas_options(interpret, compiler_params),
    )


# (pool, slot, tokens, *, mode, layer=None) -> StateUpdateResult, as ``state_update``
StateUpdateFn = Callable[..., StateUpdateResult]
# (ssm_pool, conv_pool, ssm_steps, conv_steps, dst_slot, step, *, layer=None) -> (ssm, conv)
StateScatterFn = Callable[..., tuple[jax.Array, jax.Array]]
# (ssm_pool, conv_pool, src_slot, dst_slot) -> (ssm, conv), as ``state_copy``
StateCopyFn = Callable[..., tuple[jax.Array, jax.Array]]
# (pool, slot, x, weight, bias, *, mode, num_new, layer, out_dtype) -> ConvUpdateResult, as
# ``conv_update.conv_update_pallas``
ConvUpdateFn = Callable[..., ConvUpdateResult]
# (x, weights, expert_ids, up, down, gate=None, *, xla_form) -> float32 [N, d_out], as
# ``moe_experts_pallas``; ``xla_form()`` computes the same by the XLA dispatch
MoEExpertsFn = Callable[..., jax.Array]
# (q, k_pool, v_pool, token_table, ctx_len, positions, scale) -> out, as ``paged_attention``
PagedAttentionFn = Callable[..., jax.Array]
# (x, delta, weight, router=None, *, eps, zero_centered, logits_dtype, xla_form) ->
# ResidualNorm (delta may be None), as
# ``residual_norm.residual_norm_pallas``; ``xla_form()`` computes the same by XLA
ResidualNormFn = Callable[..., ResidualNorm]
# (q, k, v, positions, write_idx, num_new, k_pool, v_pool, q_norm=None, k_norm=None, *,
# eps, zero_centered, rotary_dim, rope_theta, num_heads=None, k_head_at=0, v_head_at=0,
# xla_form) -> (q, k_pool, v_pool), as
# ``attention_prologue.attention_prologue_pallas``; ``xla_form()`` computes the same by XLA
AttentionPrologueFn = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]
# (x, z_source, layout, weight, *, eps, dtype, xla_form) -> [N, H, d], as
# ``gated_norm.gated_norm_pallas``; ``xla_form()`` computes the same by XLA
GatedNormFn = Callable[..., jax.Array]


@dataclass(frozen=True)
class Kernels:
    """The recurrent-state kernels of one backend, resolved once (``kernels_for``) and handed
    to the model's forward and the engine's steps, which call what they are given.

    ``gdn_state_update`` / ``mamba2_state_update`` have the contract of ``state_update``
    (default tiles bound); None on XLA, where the mixers run their own jnp token scans.
    ``state_scatter`` and ``state_copy`` have the contracts of ``state_scatter`` and
    ``state_copy``. ``conv_update`` (``ConvUpdateFn``) runs the conv of a decode step that
    writes the pools in place (the stacked conv pool read and written by the kernel); None
    on XLA and on TPU, where the mixers run their jnp conv scan. ``moe_experts`` runs the
    routed experts (``MoEExpertsFn``), choosing the kernel or the caller's XLA form by
    token count (``MOE_KERNEL_MAX_TOKENS``, on a TPU ``MOE_TPU_KERNEL_MAX_TOKENS``); None
    on XLA, where the MoE layers run their sort-based dispatch. ``paged_attention`` has the
    contract of ``paged_attention.paged_attention``; None on XLA and on TPU, where the
    attention layers run their masked jnp form. ``residual_norm`` (``ResidualNormFn``) adds
    a sublayer's output to the residual stream and norms it, with a MoE router's logits
    (or norms a GDN layer's input with its gate projection's products), in one launch for
    a decode step's token counts (XLA's fusions beyond); None on XLA, on TPU and per shard,
    where the layers run the ops themselves. ``attention_prologue``
    (``AttentionPrologueFn``) norms and rotates an attention layer's q and k and writes its
    new K / V rows into the pools, in one launch for a decode or verify step's token counts
    (the layers use it beside ``paged_attention``); None where ``residual_norm`` is.
    ``gated_norm`` (``GatedNormFn``) runs a GDN layer's gated output norm in one launch,
    reading the gates out of the fused projection; None where ``residual_norm`` is.
    Compared and hashed by backend, platform, MoE runner and mesh (the functions follow
    from them): ``mesh`` is None for whole-array calls, else the tensor-parallel mesh whose
    shards each call runs on (``engine.shard_kernels``)."""

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


XLA_KERNELS = Kernels("xla", None, None, None, state_scatter_xla)


@functools.cache
def kernels_for(
    kernel_backend: str | None = None, platform: str | None = None, moe_runner: str = "auto"
) -> Kernels:
    """The ``Kernels`` of ``resolve_backend(kernel_backend, platform)`` (``platform`` defaults
    to JAX's default). Pallas on a TPU: the scalar-prefetch state updates of
    ``state_update_tpu`` and ``moe_experts_tpu``, the XLA scatter and the jnp attention;
    elsewhere the Triton-layout kernels (in interpret mode on CPU). ``moe_runner`` picks the
    routed experts' form: "pallas" the kernel, "xla" none (the layers' sort-based
    dispatch), "auto" the kernel on GPUs (Triton) and in interpret mode (CPU), the XLA
    dispatch on TPUs (whose layout, ``moe_experts_tpu``, has not run on a TPU)."""
    platform = jax.default_backend() if platform is None else platform
    if resolve_backend(kernel_backend, platform) == "xla":
        return XLA_KERNELS
    if platform == "tpu":
        update, scatter, moe = _tpu_state_update, state_scatter_xla, _tpu_moe_experts
        attention, copy, conv, norm = None, state_copy_xla, None, None
        prologue = gated = None
    else:
        update, scatter, moe = _pallas_state_update, _pallas_state_scatter, _pallas_moe_experts
        attention, copy, conv = _pallas_paged_attention, _pallas_state_copy, _pallas_conv_update
        norm, prologue = _pallas_residual_norm, _pallas_attention_prologue
        gated = _pallas_gated_norm
    if moe_runner == "xla" or (moe_runner == "auto" and platform == "tpu"):
        moe = None  # auto: the kernel runs by default where it was checked (GPU, interpret)
    gdn_update = functools.partial(update, "gdn")
    # the GDN layers hand this kernel their conv output as it is (``GdnConvTokens``); the
    # TPU layout and the per-shard form take ``GdnTokens``
    gdn_update.takes_conv_tokens = platform != "tpu"
    # and can apply their output's gated norm (``OutputNorm``; ``norms_gdn_output``)
    gdn_update.takes_output_norm = platform != "tpu"
    return Kernels(
        "pallas",
        platform,
        gdn_update,
        functools.partial(update, "mamba2"),
        scatter,
        moe,
        attention,
        moe_runner,
        state_copy=copy,
        conv_update=conv,
        residual_norm=norm,
        attention_prologue=prologue,
        gated_norm=gated,
    )
