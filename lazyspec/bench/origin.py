"""Which tree a benchmark's code comes from.

The editable install maps the package ``lazyspec.kernels`` to the checkout's top-level
``kernels/`` folder. An older tree run from a copy of its files (``PYTHONPATH=copy``) has no
``lazyspec/kernels`` of its own, so its ``import lazyspec.kernels`` finds the installed
checkout's: the run would time the older tree's model code over the newer tree's kernels
and dispatch rules. The benchmarks that compare trees say where both packages came from and
refuse a mix.
"""

from __future__ import annotations

from pathlib import Path


def code_folders() -> tuple[Path, Path]:
    """The folders ``lazyspec`` and ``lazyspec.kernels`` were imported from (not resolved:
    a link stays as the path it was found by)."""
    import lazyspec
    import lazyspec.kernels

    return Path(lazyspec.__file__).parent, Path(lazyspec.kernels.__file__).parent


def same_tree(package: Path, kernels: Path) -> bool:
    """Whether ``kernels`` is the package's own: ``<package>/kernels`` (an installed copy,
    or a link in a tree's copy) or the ``kernels/`` beside the package (a source tree, as
    the editable install maps it)."""
    return kernels.parent in (package, package.parent)


def code_line() -> str:
    """``code: lazyspec <folder>, lazyspec.kernels <folder>``; RuntimeError where the two
    are not one tree's."""
    package, kernels = code_folders()
    if not same_tree(package, kernels):
        raise RuntimeError(
            f"lazyspec comes from {package} but lazyspec.kernels from {kernels}: another "
            f"tree's kernels. Link {package / 'kernels'} to this tree's kernels/ folder, or "
            "install this tree (pip install -e), before timing it"
        )
    return f"code: lazyspec {package}, lazyspec.kernels {kernels}"


DEVICE_PREFIX = "device: "  # ``device_line``'s start, by which the scripts find it


def device_line() -> str:
    """``device: <kind> (<platform>), jax <version>``: the card a benchmark's figures are
    of (a device call may be lent another card than the one asked for)."""
    import jax

    device = jax.devices()[0]
    kind = f"{device.device_kind} ({jax.default_backend()})"
    return f"{DEVICE_PREFIX}{kind}, jax {jax.__version__}"
