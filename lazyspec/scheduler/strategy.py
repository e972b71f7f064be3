"""The checkpoint strategies as records: what each pins per running request and how it
checkpoints (DESIGN §6-§7). The config, the memory plan and the slot policy read these
fields; nothing compares strategy names.

| strategy          | checkpoint slots | transient | checkpoints while running | donates at finish |
|-------------------|------------------|-----------|---------------------------|-------------------|
| none (cache off)  | 0                | 0         | no                        | nothing           |
| no_buffer         | 0                | 0         | no                        | the working slot  |
| extra_buffer      | 2 (keep + spare) | 0         | yes, ping-pong            | the keep slot     |
| extra_buffer_lazy | 1 (keep)         | 1 (spare) | yes, spare near boundary  | the keep slot     |
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Strategy:
    name: str
    checkpoint_slots: int  # pinned per running request besides the working slot
    transient_slots: int  # borrowed near a boundary (never by eviction), given back after
    tracks: bool  # checkpoints while running (prefill grid; decode: interval multiples)
    borrows_spare: bool  # the spare is borrowed per boundary instead of pinned (lazy)
    donates_working: bool  # at finish the working slot itself goes to the tree

    @property
    def pinned_slots(self) -> int:
        """Slots a running request holds for its whole life (working + checkpoints)."""
        return 1 + self.checkpoint_slots

    @property
    def peak_slots(self) -> int:
        """Slots a running request may hold at once (pinned + transient)."""
        return self.pinned_slots + self.transient_slots


NONE = Strategy("none", 0, 0, tracks=False, borrows_spare=False, donates_working=False)
NO_BUFFER = Strategy("no_buffer", 0, 0, tracks=False, borrows_spare=False, donates_working=True)
EXTRA_BUFFER = Strategy(
    "extra_buffer", 2, 0, tracks=True, borrows_spare=False, donates_working=False
)
EXTRA_BUFFER_LAZY = Strategy(
    "extra_buffer_lazy", 1, 1, tracks=True, borrows_spare=True, donates_working=False
)
STRATEGIES = {s.name: s for s in (NONE, NO_BUFFER, EXTRA_BUFFER, EXTRA_BUFFER_LAZY)}
