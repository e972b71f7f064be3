"""The checkpoint-boundary finish test.

The benchmark lives in ``lazyspec.bench.boundary`` (tests import it); see its docstring and
``--help``.
"""

from __future__ import annotations

import sys

from lazyspec.bench.boundary import main

if __name__ == "__main__":
    sys.exit(main())
