"""``scripts/serve.py`` in a process of its own, for the tests and benchmarks that run the
server as a user does."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A loopback port no one listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_serve(
    args: list[str], env: dict[str, str] | None = None, **popen: Any
) -> tuple[subprocess.Popen, str]:
    """Start ``scripts/serve.py args`` on a free loopback port, the repository on its
    ``PYTHONPATH`` and ``env`` added to this process's environment (``popen``: the
    ``subprocess.Popen`` arguments); (the process, the server's base URL). The caller
    stops it."""
    port = free_port()
    command = [sys.executable, str(REPO / "scripts" / "serve.py"), "--port", str(port), *args]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.Popen(command, env=full_env, **popen), f"http://127.0.0.1:{port}"
