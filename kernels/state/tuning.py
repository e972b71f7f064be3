"""Tuning of the state pools' kernels shared by both mixers: the conv update, the scatter of
verify steps' states, the pool-to-pool copy, and the updates' padding rows. Jax-free.
Measurements: ``benchmarks/log/``."""

from __future__ import annotations

from dataclasses import dataclass

from lazyspec.kernels.device_kinds import device_table


@dataclass(frozen=True)
class StateTuning:
    """``skip_padding_state``: a decode step's padding rows (slot 0) read a zero state in the
    Pallas updates instead of slot 0's: at batch 1 half of a GDN layer's state reads; a
    batch-1 step 4.3 and 7.3 us shorter on an H100. ``copy_tiles_per_program``: state tiles
    a program of the pool-to-pool copy takes (one a program launched layers x rows x 516
    programs at Qwen3-Next's widths, nearly all returning at once)."""

    skip_padding_state: bool = True
    scatter_block_rows: int = 8
    scatter_block_channels: int = 2048
    copy_tiles_per_program: int = 16
    conv_block_channels: int = 256


GPU = StateTuning()
TABLE = device_table(GPU)
