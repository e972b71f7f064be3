"""The routed experts' tuning (``moe_experts_pallas`` on GPUs, ``moe.experts_tpu`` on TPUs),
one record per device kind. Jax-free. Measured by the profiler's kernel times at Qwen3-Next
widths (hidden 2048, expert intermediate 512; 64 experts top-10 and 512 top-10), 1 to 2048
tokens; the measurements and the variants retired are in ``benchmarks/log/``.
"""

from __future__ import annotations

from dataclasses import dataclass

from lazyspec.kernels.device_kinds import device_table


@dataclass(frozen=True)
class MoETuning:
    """``kernel_max_tokens``: the most tokens one launch of the kernel takes; a call of more
    runs in pieces of at most that many (``dispatch.experts_in_pieces``; on a TPU the XLA
    dispatch runs instead). At 256 / 1024 / 2048 tokens of 512 experts the kernel took
    0.66 / 0.85 / 1.1 ms on an H200, the sort-based XLA dispatch 8.6 ms at 256 and out of
    memory from 1024. Tiles of the separate up and down launches: ``block_rows`` (the
    smallest row tile Triton's dots take), ``block_inner`` (64 columns the fastest from 2
    tokens), ``block_out`` (halved below ``wide_out_tokens`` tokens: 0.5-1.2 us faster a
    launch at 1-4 tokens), ``block_k``, warps and stages.

    The folded forms, up to a few tokens (a batch-1 step's two rows): routing inside the up
    launch (``route_in_up_max_tokens``: one launch fewer a layer) and the down product
    inside it too (``down_in_up_max_tokens``: partial sums a program, no down launch) with
    the ``fold_*`` tiles, and ``pair_grid``: the folded launch's grid a program per token's
    pair rather than per slot (the batch-1 step 23.5 and 21.1 us shorter on an H100).
    ``tpu_block_inner`` / ``tpu_block_out``: the TPU layout's tiles (weight blocks near
    2 MiB double-buffered at Qwen3-Next widths)."""

    kernel_max_tokens: int = 2048
    block_rows: int = 16
    block_inner: int = 64
    block_out: int = 128
    wide_out_tokens: int = 16
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    route_in_up_max_tokens: int = 2
    down_in_up_max_tokens: int = 2
    fold_block_inner: int = 64
    fold_block_out: int = 256
    fold_block_k: int = 128
    fold_num_warps: int = 4
    fold_num_stages: int = 3
    pair_grid: bool = True
    tpu_block_inner: int = 128
    tpu_block_out: int = 512


GPU = MoETuning()
# The TPU layout has been run in interpret mode only: it keeps the decode-size limit it was
# written for, beyond which the XLA dispatch runs.
TPU = MoETuning(kernel_max_tokens=64)
TABLE = device_table(GPU, tpu=TPU)
