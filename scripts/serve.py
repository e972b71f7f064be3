"""Launch the lazyspec HTTP server; same flags as ``python -m lazyspec.serve`` (see --help).

    python scripts/serve.py --model-path /path/to/hf-folder --port 30000
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lazyspec.serve import main  # noqa: E402

if __name__ == "__main__":
    main()
