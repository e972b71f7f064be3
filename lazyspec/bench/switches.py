"""Kernel dispatch switches set for one benchmark process (``--kernel-switch``).

The kernels' dispatch reads some module constants when a step is traced (``backend``'s
``MOE_ROUTE_IN_UP_MAX_TOKENS``, ``moe_experts``' ``RANK_MAX_ELEMENTS``, ...). A benchmark compares
two settings by running one process per setting with the constants set before anything is
traced: a jitted function traced once keeps the setting it was traced under.
"""

from __future__ import annotations

import argparse
from types import ModuleType


def _modules() -> dict[str, ModuleType]:
    from lazyspec.kernels import backend, moe_experts

    return {"backend": backend, "moe_experts": moe_experts}


def check_switches(items: list[str]) -> list[tuple[ModuleType, str, int | bool]]:
    """(module, NAME, value) of each ``module.NAME=INT`` (module: backend or moe_experts;
    NAME an existing int or bool constant; the value an int, or a bool for a bool
    constant), setting nothing; ValueError names what is wrong."""
    modules, found = _modules(), []
    for item in items:
        key, sep, text = item.partition("=")
        module_name, _, name = key.partition(".")
        module = modules.get(module_name)
        if not sep or module is None or not name:
            raise ValueError(
                f"kernel switch {item!r}: expected module.NAME=INT, module one of {sorted(modules)}"
            )
        current = getattr(module, name, None)
        if not isinstance(current, int) or not name.isupper():
            raise ValueError(f"kernel switch {item!r}: {key} is not an int or bool constant")
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"kernel switch {item!r}: {text!r} is not an integer") from None
        found.append((module, name, bool(value) if isinstance(current, bool) else value))
    return found


def apply_switches(items: list[str]) -> list[str]:
    """Set each ``module.NAME=INT`` (``check_switches``); returns ``module.NAME = value``
    for each. ValueError names what is wrong before anything is set."""
    found = check_switches(items)
    for module, name, value in found:
        setattr(module, name, value)
    return [
        f"{module.__name__.rsplit('.', 1)[-1]}.{name} = {value}" for module, name, value in found
    ]


def add_switch_argument(parser: argparse.ArgumentParser) -> None:
    """``--kernel-switch MODULE.NAME=INT`` (repeatable) on a benchmark's parser; the script
    passes ``args.kernel_switch`` to ``apply_switches`` before anything is traced."""
    parser.add_argument(
        "--kernel-switch",
        action="append",
        default=[],
        metavar="MODULE.NAME=INT",
        help="set a dispatch constant of lazyspec.kernels.backend or .moe_experts before "
        "anything is traced (repeatable), e.g. backend.MOE_ROUTE_IN_UP_MAX_TOKENS=0",
    )
