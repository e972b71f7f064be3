"""How a runner calls the programs of one batch step kind (``StepCalls``): each program
of the table as its compiled executable once one is bound, the decode program's copies in
turn, and the jitted function for a batch of no key of the table."""

from __future__ import annotations

from collections.abc import Callable

from lazyspec.engine.packing import PackedBatch, PackedLayout


class StepCalls:
    """The calls of one batch step kind. Each program of the table is called as its
    compiled executable once the table's compilation binds it (``bind``: from the
    executable store, ``executables``, or compiled ahead), by its batch's packed layout and
    copy; a batch of no key of the table, or one before its program is bound, calls the
    jitted function.

    The copies of a program (``decode_program_copies``) are called in turn, one per call. A
    GPU program runs as command buffers (CUDA graphs) that XLA updates whenever a buffer
    the program touches has moved since its last call, which costs more host time than the
    launch itself. A decode step's words (which its outputs overwrite) are allocated while
    the last step's are still held, so their address alternates from step to step: two
    copies of the program called in turn each see the addresses of their own last call."""

    def __init__(self, jitted: list[Callable]) -> None:
        self.jitted, self.turn = jitted, 0
        self.compiled: dict[PackedLayout, list] = {}  # each copy's executable, by layout

    def bind(self, layout: PackedLayout, copy: int, compiled: Callable) -> None:
        self.compiled.setdefault(layout, [None] * len(self.jitted))[copy] = compiled

    def program(self, layout: PackedLayout) -> Callable:
        """What the next call of a batch laid out as ``layout`` runs (it takes its turn)."""
        copy = self.turn
        self.turn = (copy + 1) % len(self.jitted)
        bound = self.compiled.get(layout)
        compiled = None if bound is None else bound[copy]
        return self.jitted[copy] if compiled is None else compiled

    def __call__(self, params, pools, packed: PackedBatch, *rest):
        return self.program(packed.layout)(params, pools, packed, *rest)
