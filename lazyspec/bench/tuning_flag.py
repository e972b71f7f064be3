"""``--kernel-tuning``: the benchmarks' and checks' way to run a kernel tuning other than the
device's table, as overrides of it (``kernels/tuning.py``): each setting is a different
``Tuning`` and so a different program; nothing is patched, and one process may run several."""

from __future__ import annotations

import argparse

from lazyspec.kernels.tuning import Tuning, parse_overrides

HELP = (
    "kernel tuning overrides over the device's table, NAME=VALUE comma-separated "
    "(e.g. moe.pair_grid=false,attention.combine_block=0; names: kernels/<op>/tuning.py)"
)


def add_tuning_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kernel-tuning", default="", help=HELP)


def tuning_lines(text: str) -> list[str]:
    """The header lines naming each override of ``text`` (none for the table's values);
    ValueError on a malformed or unknown name."""
    return [f"kernel tuning: {name} = {value}" for name, value in parse_overrides(text).items()]


def tuned(base: Tuning, text: str) -> Tuning:
    """``base`` with the overrides of ``text``."""
    return base.with_overrides(parse_overrides(text))
