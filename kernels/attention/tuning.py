"""The attention kernels' tuning: the paged attention (``paged_attention``) and the
prologue that norms, rotates and writes q / k / v (``attention_prologue_pallas``), one
record per device kind. Jax-free. Measurements: ``benchmarks/log/``."""

from __future__ import annotations

from dataclasses import dataclass, replace

from lazyspec.kernels.device_kinds import device_table


@dataclass(frozen=True)
class AttentionTuning:
    """Paged attention: query rows a tile at most (``block_rows``; every tile re-reads its
    context, so a prefill chunk wants tall tiles, within ``query_tile_bytes`` of q: 64 fp32
    rows of head dim 256 with 2 stages ask an H200 for more shared memory than it has),
    context positions a loop step (``block_kv``), programs aimed for when the splits are
    chosen (``target_programs``), warps and stages: the fastest measured for Qwen3-Next's
    decode (16 q / 2 kv heads, head dim 256, bf16) on an H200 at 4k-128k context.
    ``active_splits``: the combine merges only the splits that read a block of each token's
    context (a batch-1 step 4-5 us shorter on an H100). ``combine_block``: the combine's
    columns a program up to ``Tuning.small_step_max_tokens`` tokens (0: a head's whole D;
    32: 1.9 and 1.7 us a batch-1 step shorter on an H100).

    Prologue: up to ``prologue_max_tokens`` tokens (a decode or verify step) in one launch;
    ``prologue_q_heads``: query heads a program at a small step (0: all of a kv head's; 1:
    3-5 us a batch-1 step shorter on an H100). ``qkv_in_place``: q, k and v come from one
    product, read in place by the prologue and the combine (10-11 us a batch-1 step shorter
    on an H200).

    ``xla_block_kv``: context positions a loop step of the jnp attention
    (``attention.walk.paged_attend``), where no paged-attention kernel runs (CPU, the xla
    backend, a TPU table past ``tpu_table_max_bytes``): its loop runs to the batch's longest
    context, so a step's cost follows the lengths; 0 takes the whole table in one block (the
    cost of the configured context).

    TPU (``attention.ragged_tpu``, the Pallas backend on a TPU): ``tpu_block_kv`` context
    positions a block of its softmax loop (whole pages, at least one), ``tpu_block_rows``
    query rows a tile (a multiple of 8), and ``tpu_table_max_bytes``: the largest page table
    (4 bytes a page a row) scalar-prefetched into SMEM (1 MiB a core on v5e and v6e), past
    which the jnp walk runs instead. Untimed: no TPU run has been made."""

    block_rows: int = 64
    block_kv: int = 64
    target_programs: int = 256
    num_warps: int = 8
    num_stages: int = 2
    query_tile_bytes: int = 32 * 1024
    active_splits: bool = True
    combine_block: int = 32
    prologue_max_tokens: int = 64
    prologue_q_heads: int = 1
    qkv_in_place: bool = True
    xla_block_kv: int = 256
    tpu_block_kv: int = 512
    tpu_block_rows: int = 128
    tpu_table_max_bytes: int = 512 * 1024


GPU = AttentionTuning()
# the jnp attention's blocks: CPU's measured (benchmarks/log/2026-12-06-xla-attention-
# lengths.md: 256 and 512 alike, 128 slower); TPU's untimed, wider for the MXU
CPU = replace(GPU, xla_block_kv=256)
# the TPU kernel's tiles, untimed: query tiles as tall as the MXU (128 rows on v5e, 256 on
# v6e), 512 positions a block (K and V of Qwen3-Next's 2 kv heads of 256 in bf16,
# double-buffered: 2 MiB of VMEM)
TPU_V5E = replace(GPU, xla_block_kv=512, tpu_block_kv=512, tpu_block_rows=128)
TPU_V6E = replace(TPU_V5E, tpu_block_rows=256)
TABLE = device_table(GPU, tpu=TPU_V5E, tpu_v6e=TPU_V6E, cpu=CPU)
