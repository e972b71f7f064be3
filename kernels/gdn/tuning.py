"""The GDN state update's tuning (``gdn_state_update_pallas`` launched by ``kernels.state``'s
dispatch), one record per device kind. Jax-free: ``EngineConfig`` names its fields.

Measured at Qwen3-Next's widths (32 value heads of 128 x 128); the measurements and the
variants tried are in ``benchmarks/log/``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lazyspec.kernels.device_kinds import device_table


@dataclass(frozen=True)
class GdnTuning:
    """``block_value``: value columns a program (the largest power of two up to it that
    divides the head); ``small_block_value``: the same up to ``Tuning.small_step_max_tokens``
    tokens (a batch-1 step: 2 rows x 32 heads x 2 tiles = 128 programs at 64 columns; 32
    columns, twice the programs, were 2.1 and 1.2 us a step shorter on an H100).
    ``norm_in_update_max_tokens``: up to this many tokens the output's gated norm runs in the
    update's launch (a whole head a program, ``norm_in_update_warps`` warps): one launch
    fewer a layer, 1.1 and 0.8 us a batch-1 step shorter on an H100 (0: never).

    ``tpu_block_heads``: the TPU layout's (``gdn.update_tpu``) head tile, chosen as
    ``common.tpu_head_tile`` does (the XLA scan where none fits); untimed: 8 heads of
    128 x 128 fp32 are 512 KiB a block."""

    block_value: int = 64
    num_warps: int = 4
    evict_last: bool = False
    small_block_value: int = 32
    norm_in_update_max_tokens: int = 2
    norm_in_update_warps: int = 8
    tpu_block_heads: int = 8


GPU = GdnTuning()
TPU = replace(GPU, tpu_block_heads=8)
# the GPU's tiles were first timed on an H200, the small-step ones on an H100; the TPU
# layout (``update_tpu``) reads only ``tpu_block_heads``
TABLE = device_table(GPU, tpu=TPU)
