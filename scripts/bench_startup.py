"""Start-up time of the HTTP server: seconds from launching ``scripts/serve.py`` to its
first ``/health`` 200, with a cold and then a warm JAX compilation cache.

    python scripts/bench_startup.py --runs 2                      # cold, cold, warm, warm
    python scripts/bench_startup.py --cache-dir /tmp/c --warm-only --runs 2

Each run starts the server in a subprocess on a free port (the embedded default model unless
``--model-path``; extra flags after ``--`` go to serve.py), polls /health every 0.1 s, prints
the seconds, then stops it with SIGTERM. A cold run empties the cache directory first.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def time_to_healthy(serve_args: list[str], cache_dir: Path, timeout: float) -> float:
    """Seconds from launch to the first /health 200; the server is stopped afterwards."""
    port = free_port()
    command = [
        sys.executable,
        str(REPO / "scripts" / "serve.py"),
        "--port",
        str(port),
        "--compilation-cache-dir",
        str(cache_dir),
        "--log-level",
        "warning",
        *serve_args,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"serve.py exited: {process.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    return time.perf_counter() - start
            except httpx.TransportError:
                pass
            if time.perf_counter() - start > timeout:
                raise RuntimeError(f"no /health 200 after {timeout} s")
            time.sleep(0.1)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2, help="Runs per cache state.")
    parser.add_argument("--cache-dir", default=None, help="Default: a fresh temporary folder.")
    parser.add_argument("--warm-only", action="store_true", help="Skip the cold runs.")
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("serve_args", nargs="*", help="Flags passed to serve.py (after --).")
    args = parser.parse_args()
    cache_dir = Path(args.cache_dir or tempfile.mkdtemp(prefix="lazyspec-jax-cache-"))
    states = ["warm"] if args.warm_only else ["cold", "warm"]
    for state in states:
        for run in range(args.runs):
            if state == "cold":
                shutil.rmtree(cache_dir, ignore_errors=True)
            seconds = time_to_healthy(args.serve_args, cache_dir, args.timeout)
            print(f"{state} cache, run {run + 1}: {seconds:.1f} s to /health 200", flush=True)


if __name__ == "__main__":
    main()
