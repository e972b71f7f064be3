"""The source document's checkpoint-boundary finish grid at full size, cell by cell.

Prompt 500, mamba_track_interval 64, forced finish at 832 + offset, NEXTN with 3 steps
(D = 4) and the scripted draft head; BENCHMARKS.md "Checkpoint-boundary finish grid" records
the checkpoint each cell serves. 448 is the in-prompt checkpoint, 768 / 832 are decode-time
checkpoints settled before the finish. Everything else is the bench's default except a
shorter continuation (the served checkpoint does not depend on it) and the context that
continuation needs."""

from __future__ import annotations

import pytest

from lazyspec.bench import boundary

OFFSETS = (-2, -1, 0, 1, 2, 16, 32)
# (spec, exhausted) -> checkpoint served per offset, as recorded in BENCHMARKS.md
SERVED = {
    (True, False): [768, 768, 768, 768, 832, 832, 832],
    (True, True): [448, 448, 448, 448, 832, 832, 832],
    (False, False): [768, 768, 768, 768, 832, 832, 832],
    (False, True): [768, 768, 448, 448, 832, 832, 832],
}


def test_defaults_are_the_documented_grid():
    args = boundary.parse_args([])
    assert (args.prompt_len, args.interval, args.boundary, args.steps) == (500, 64, 832, 3)
    assert args.offsets == OFFSETS and args.drafter == "scripted" and args.model_path is None
    assert args.mamba_cache_policy == "sglang"  # the parity grid runs under SGLang's rules


@pytest.mark.slow
def test_boundary_finish_grid_full_size():
    args = boundary.parse_args(["--cont", "8", "--context", "896"])
    assert (args.prompt_len, args.interval, args.boundary, args.steps) == (500, 64, 832, 3)
    cells = boundary.run_grid(args)
    assert [c.offset for c in cells] == list(OFFSETS) * 4
    served = {key: [] for key in SERVED}
    for c in cells:
        assert c.identical == c.total == 8, c
        assert c.max_dlogprob <= 1e-3, c
        served[(c.spec, c.exhausted)].append(c.served)
    assert served == SERVED
    assert all(2.0 < c.accept_len < 3.0 for c in cells if c.spec)
