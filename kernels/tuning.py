"""Kernel tuning as data: one frozen ``Tuning`` record of every tile size, threshold and
fusion choice the kernels' dispatch reads, built from each op's table (``kernels/<op>/
tuning.py``) for a device kind.

A ``Tuning`` is held by the ``Kernels`` record (``backend.kernels_for``) and so is part of
every program's static key: two tunings compile two programs, and nothing is read from a
module global while a program is traced. A sweep passes an override
(``with_overrides({"moe.pair_grid": False})`` or ``EngineConfig.kernel_tuning``), never
patches a module. Jax-free, so that the host config can validate overrides.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lazyspec.kernels.attention.tuning import TABLE as ATTENTION_TABLE
from lazyspec.kernels.attention.tuning import AttentionTuning
from lazyspec.kernels.device_kinds import DEVICE_KINDS
from lazyspec.kernels.gdn.tuning import TABLE as GDN_TABLE
from lazyspec.kernels.gdn.tuning import GdnTuning
from lazyspec.kernels.mamba2.tuning import TABLE as MAMBA2_TABLE
from lazyspec.kernels.mamba2.tuning import Mamba2Tuning
from lazyspec.kernels.moe.tuning import TABLE as MOE_TABLE
from lazyspec.kernels.moe.tuning import MoETuning
from lazyspec.kernels.norm.tuning import TABLE as NORM_TABLE
from lazyspec.kernels.norm.tuning import NormTuning
from lazyspec.kernels.state.tuning import TABLE as STATE_TABLE
from lazyspec.kernels.state.tuning import StateTuning


@dataclass(frozen=True)
class Tuning:
    """Every op's tuning record. ``small_step_max_tokens``: the steps that take the small-step
    tiles (``GdnTuning.small_block_value``, ``AttentionTuning.combine_block`` and
    ``prologue_q_heads``): up to this many tokens (rows x tokens a row), a batch-1 step's
    two rows, where they were timed."""

    gdn: GdnTuning = GdnTuning()
    mamba2: Mamba2Tuning = Mamba2Tuning()
    state: StateTuning = StateTuning()
    moe: MoETuning = MoETuning()
    attention: AttentionTuning = AttentionTuning()
    norm: NormTuning = NormTuning()
    small_step_max_tokens: int = 2

    def with_overrides(self, overrides: dict[str, Any]) -> Tuning:
        """A copy with ``{"op.field": value}`` (or ``"small_step_max_tokens"``) replaced;
        ValueError names an unknown field or a value of the wrong type."""
        tuning = self
        for name, value in overrides.items():
            op, _, field = name.rpartition(".")
            if not op:
                tuning = _replace(tuning, field, value, name)
                continue
            if op not in _OPS:
                raise ValueError(f"unknown kernel tuning {name!r}; ops are {sorted(_OPS)}")
            record = _replace(getattr(tuning, op), field, value, name)
            tuning = dataclasses.replace(tuning, **{op: record})
        return tuning

    def field_names(self) -> tuple[str, ...]:
        """Every name ``with_overrides`` takes."""
        names = [f"{op}.{f.name}" for op in _OPS for f in dataclasses.fields(getattr(self, op))]
        return (*names, "small_step_max_tokens")


_OPS = ("gdn", "mamba2", "state", "moe", "attention", "norm")
# the dispatch functions' default where a caller passes none (the tests, direct calls);
# ``kernels_for`` always binds the device's table
DEFAULT_TUNING = Tuning()


def _replace(record: Any, field: str, value: Any, name: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(record)}
    if field not in fields or field in _OPS:
        raise ValueError(f"unknown kernel tuning {name!r}")
    current = getattr(record, field)
    if isinstance(current, bool):
        if not isinstance(value, bool):
            raise ValueError(f"kernel tuning {name!r} takes true or false, got {value!r}")
    elif not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"kernel tuning {name!r} takes an integer >= 0, got {value!r}")
    return dataclasses.replace(record, **{field: value})


def parse_overrides(text: str) -> dict[str, Any]:
    """``"moe.pair_grid=false,attention.combine_block=0"`` -> an override dict (values: true /
    false / integers); ValueError on a malformed item. An empty text is no override."""
    overrides: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, raw = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"kernel tuning items are NAME=VALUE, got {item!r}")
        raw = raw.strip().lower()
        if raw in ("true", "false"):
            overrides[name.strip()] = raw == "true"
        else:
            try:
                overrides[name.strip()] = int(raw)
            except ValueError:
                raise ValueError(f"kernel tuning {name.strip()!r}: {raw!r} is no integer") from None
    Tuning().with_overrides(overrides)  # names and types checked here
    return overrides


def tuning_for(key: str) -> Tuning:
    """The ``Tuning`` of a device kind (``DEVICE_KINDS``)."""
    if key not in DEVICE_KINDS:
        raise ValueError(f"unknown device kind {key!r}; expected one of {DEVICE_KINDS}")
    return Tuning(
        gdn=GDN_TABLE[key],
        mamba2=MAMBA2_TABLE[key],
        state=STATE_TABLE[key],
        moe=MOE_TABLE[key],
        attention=ATTENTION_TABLE[key],
        norm=NORM_TABLE[key],
    )
