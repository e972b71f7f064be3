"""Shared-prefix serving benchmark against a running lazyspec (or SGLang) server.

The benchmark lives in ``lazyspec.bench.serving`` (tests import it); see its docstring and
``--help``.
"""

from __future__ import annotations

from lazyspec.bench.serving import main

if __name__ == "__main__":
    main()
