"""Launch the lazyspec HTTP server (OpenAI and SGLang APIs); ``--help`` lists every flag.

python scripts/serve.py --model-path /path/to/hf-folder --port 30000
"""

from __future__ import annotations

from lazyspec.server.launch import main

if __name__ == "__main__":
    main()
