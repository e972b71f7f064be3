"""Python's cyclic garbage collector in the test suite's processes.

Tracing and lowering a jitted step allocate container objects by the million, nearly all of
them freed by reference counting alone; under the default thresholds (700, 10, 10) the
collector still walks the young objects every 700 net allocations and the whole heap every
hundred walks. A perf profile of one warm-up test put about an eighth of the process's CPU
time in the collector. ``quiet_collector`` takes what is alive now (the imports) out of its
view and makes the walks rarer: the suite's CPU time fell by about a tenth (BUILD.md).
Cycles are still collected, later; the suite also collects after every test module.
"""

from __future__ import annotations

import gc

THRESHOLDS = (20_000, 20, 20)


def quiet_collector() -> None:
    """Freeze the objects alive now and set ``THRESHOLDS``; for test processes."""
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
