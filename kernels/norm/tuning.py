"""The norm kernels' tuning: the residual add + norm (+ router logits) launch
(``residual_norm_pallas``), the GDN output's gated norm (``gated_norm_pallas``), and the
residual-stream fusions they carry, one record per device kind. Jax-free. Measurements:
``benchmarks/log/``."""

from __future__ import annotations

from dataclasses import dataclass

from lazyspec.kernels.device_kinds import device_table


@dataclass(frozen=True)
class NormTuning:
    """``residual_max_tokens`` / ``residual_max_token_experts``: the residual-norm launch runs
    up to these many tokens (and tokens x router experts; every program holds a whole row
    and reads the whole router: a decode step's sizes), XLA's fusions beyond. Router rows a
    program and warps: ``few_*`` up to ``few_tokens`` tokens (a router row a program: 13-19
    us a batch-1 step shorter on an H100), else ``block_experts`` / ``num_warps``.
    ``gated_max_tokens``: the GDN output's gated norm in one launch up to this many tokens.

    ``mlp_output_in_next_norm``: a layer leaves its MLP output for the next layer's input
    norm to add (8-10 us a batch-1 step shorter on an H200). ``output_parts``: a mixer's
    output projection as that many float32 partial sums that the norm after it adds, up to
    ``output_parts_max_tokens`` tokens (no split-K reduction launch; 3 us a batch-1 step
    shorter on an H100, longer from batch 16: hence the bound)."""

    residual_max_tokens: int = 64
    residual_max_token_experts: int = 64 * 64
    block_experts: int = 4
    num_warps: int = 4
    few_tokens: int = 16
    few_block_experts: int = 1
    few_num_warps: int = 8
    gated_max_tokens: int = 64
    mlp_output_in_next_norm: bool = True
    output_parts: int = 4
    output_parts_max_tokens: int = 2


GPU = NormTuning()
TABLE = device_table(GPU)
