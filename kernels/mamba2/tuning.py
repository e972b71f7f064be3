"""The Mamba2 state update's tuning (``mamba2_state_update_pallas``), one record per device
kind. Jax-free. Measurements: ``benchmarks/log/``."""

from __future__ import annotations

from dataclasses import dataclass, replace

from lazyspec.kernels.device_kinds import device_table


@dataclass(frozen=True)
class Mamba2Tuning:
    """Value columns a program, warps, and whether the decode load keeps the state in L2
    (``evict_last``): the fastest measured on an H200 at Nemotron-H / Granite widths.

    ``tpu_block_heads``: the TPU layout's (``mamba2.update_tpu``) head tile, the largest
    multiple of 8 up to it dividing the heads, else all heads up to it, else the XLA scan
    (``common.tpu_head_tile``); untimed: 8 heads of 64 x 128 fp32 are 256 KiB a block."""

    block_value: int = 32
    num_warps: int = 8
    evict_last: bool = True
    tpu_block_heads: int = 8


GPU = Mamba2Tuning()
TPU = replace(GPU, tpu_block_heads=8)
TABLE = device_table(GPU, tpu=TPU)
