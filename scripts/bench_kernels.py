"""Benchmark the recurrent-state kernels (Pallas vs XLA vs peers) and write a markdown table.

The benchmark lives in ``lazyspec.bench.kernels`` (tests import it); see its docstring and
``--help``.
"""

from __future__ import annotations

import sys

from lazyspec.bench.kernels import main

if __name__ == "__main__":
    sys.exit(main())
