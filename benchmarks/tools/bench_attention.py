"""Benchmark decode attention (the paged Pallas kernel vs the jnp form, cuDNN and torch SDPA)
and write a markdown table.

The benchmark lives in ``lazyspec.bench.attention`` (tests import it); see its docstring and
``--help``.
"""

from __future__ import annotations

import sys

from lazyspec.bench.attention import main

if __name__ == "__main__":
    sys.exit(main())
