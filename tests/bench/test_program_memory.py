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


def test_a_one_row_extend_writes_the_state_pool_in_place(load_tool):
    """A lone request's prefill chunk (the one-row extend program) writes the state pools in
    place: its optimised HLO copies nothing as large as the SSM state pool. (Read as a
    one-index gather, the row's state was fused into the commit's writes, and XLA copied the
    pool before and after them.)"""
    from lazyspec.engine.programs import EXTEND
    from lazyspec.testing.tiny_models import small_engine, tiny_model

    tool = load_tool("program_memory")
    engine = small_engine(tiny_model("qwen3_next"), "extra_buffer_lazy", spec=True)
    runner = engine.runner
    program = next(p for p in runner.program_table() if p.key.kind == EXTEND and p.key.rows == 1)
    hlo = program.compile().as_text()
    assert tool.large_copies(hlo, runner.pools.ssm.nbytes) == 0
    assert tool.large_copies(hlo, 1) > 0  # it does count the program's small copies
