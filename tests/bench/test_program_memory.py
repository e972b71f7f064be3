"""``benchmarks/tools/program_memory.py``: the large copies it counts in a program's HLO."""

from __future__ import annotations

# two lines of the one-row 64-token extend program's optimised HLO on the CPU (the state
# pool copied before and after its scatters), and a small copy
HLO = """
  %copy.564 = f32[6,2001,8,64,64]{4,3,2,1,0} copy(%pools_ssm.1)
  %wrapped_scatter.10 = f32[6,2001,8,64,64]{4,3,2,1,0} fusion(%copy.564, %x, %y), kind=kLoop
  %copy.592 = f32[6,2001,8,64,64]{4,3,2,1,0} copy(%select_dynamic-update-slice_fusion.10)
  %copy.7 = bf16[16,128]{1,0} copy(%param.3)
"""
POOL_BYTES = 6 * 2001 * 8 * 64 * 64 * 4


def test_large_copies_counts_copies_of_at_least_the_size(load_tool):
    tool = load_tool("program_memory")
    assert tool.large_copies(HLO, POOL_BYTES) == 2  # the pool's two copies, not the fusion
    assert tool.large_copies(HLO, POOL_BYTES + 1) == 0
    assert tool.large_copies(HLO, 16 * 128 * 2) == 3  # the bf16 copy at its own size
