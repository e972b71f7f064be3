"""The Mamba2 state update's tuning (``mamba2_state_update_pallas``), one record per device
kind. Jax-free. Measurements: ``benchmarks/log/``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mamba2Tuning:
    """Value columns a program, warps, and whether the decode load keeps the state in L2
    (``evict_last``): the fastest measured on an H200 at Nemotron-H / Granite widths."""

    block_value: int = 32
    num_warps: int = 8
    evict_last: bool = True


GPU = Mamba2Tuning()
TABLE = {"h100": GPU, "h200": GPU, "tpu_v5e": GPU, "tpu_v6e": GPU, "cpu": GPU}
