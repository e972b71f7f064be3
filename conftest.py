"""Lets a source checkout import ``lazyspec.kernels`` without installing the package.

The installed package maps the top-level folder ``kernels/`` to ``lazyspec.kernels``; this
does the same mapping for an uninstalled checkout, without creating a top-level ``kernels``
module (transformers probes for a package of that name).
"""

import importlib.util
import sys
from pathlib import Path

import lazyspec

if importlib.util.find_spec("lazyspec.kernels") is None:
    _folder = Path(__file__).parent / "kernels"
    _spec = importlib.util.spec_from_file_location(
        "lazyspec.kernels", _folder / "__init__.py", submodule_search_locations=[str(_folder)]
    )
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["lazyspec.kernels"] = _module
    _spec.loader.exec_module(_module)
    lazyspec.kernels = _module
