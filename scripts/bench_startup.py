"""Start-up time of the HTTP server: seconds from launching ``scripts/serve.py`` to its
first ``/health`` 200 (the programs a first request needs compiled) and to its whole program
table compiled, with a cold and then a warm JAX compilation cache; with each run, what
``/server_info``'s ``warmup`` reports: programs, XLA compilations, compile seconds (summed
over the compile threads), the persistent cache's hits and misses and the programs loaded
as stored (``lazyspec/engine/executables.py``).

    python scripts/bench_startup.py --runs 2                      # cold, cold, warm, warm
    python scripts/bench_startup.py --cache-dir /tmp/c --warm-only --runs 2
    python scripts/bench_startup.py --runs 1 --ready-only         # stop at /health 200

Each run starts the server in a subprocess on a free port (the embedded default model unless
``--model-path``; extra flags after ``--`` go to serve.py), polls /health every 0.1 s, then
/server_info until the table is compiled, prints one line, then stops it with SIGTERM. A cold
run empties the cache directory first.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from lazyspec.testing.serve_process import launch_serve


def poll(process: subprocess.Popen, start: float, timeout: float, ask, errors) -> object:
    """``ask()``'s first answer that is not None, polled every 0.1 s while the server runs
    (``errors``: the file of its stderr)."""
    while True:
        if process.poll() is not None:
            errors.seek(0)
            raise RuntimeError(f"serve.py exited: {errors.read().decode()[-2000:]}")
        try:
            answer = ask()
            if answer is not None:
                return answer
        except httpx.TransportError:
            pass
        if time.perf_counter() - start > timeout:
            raise RuntimeError(f"the server was not ready after {timeout} s")
        time.sleep(0.1)


def measure_startup(
    serve_args: list[str], cache_dir: Path, timeout: float, ready_only: bool = False
) -> dict:
    """Seconds from launch to the first /health 200 (``ready_s``) and to the whole table
    compiled (``all_s``), with ``/server_info``'s ``warmup``; the server is stopped after.
    With ``ready_only`` it is stopped at /health 200 (the warm-up report as it stands then):
    a warm restart is ready once the programs a first request needs are in the cache."""
    start = time.perf_counter()
    # stderr to a file, not a pipe: a pipe nobody reads stops the server once it is full
    errors = tempfile.TemporaryFile()
    process, url = launch_serve(
        ["--compilation-cache-dir", str(cache_dir), "--log-level", "warning", *serve_args],
        stdout=subprocess.DEVNULL,
        stderr=errors,
    )

    # one client for every poll: a new one each 0.1 s builds an SSL context each time, CPU
    # the server's start-up competes with on a small machine
    client = httpx.Client(timeout=30)

    def healthy() -> bool | None:
        return client.get(f"{url}/health", timeout=5).status_code == 200 or None

    def compiled() -> dict | None:
        warmup = client.get(f"{url}/server_info").json().get("warmup")
        if warmup is None:
            return {}  # no warm-up (--skip-warmup)
        return warmup if warmup["done"] else None

    try:
        poll(process, start, timeout, healthy, errors)
        ready_s = time.perf_counter() - start
        if ready_only:
            warmup = client.get(f"{url}/server_info").json().get("warmup") or {}
            return {"ready_s": ready_s, **warmup}
        warmup = poll(process, start, timeout, compiled, errors)
        return {"ready_s": ready_s, "all_s": time.perf_counter() - start, **warmup}
    finally:
        client.close()
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        errors.close()


def describe(state: str, run: int, got: dict) -> str:
    line = f"{state} cache, run {run}: {got['ready_s']:.1f} s to /health 200"
    if "all_s" in got:
        line += f", {got['all_s']:.1f} s to the whole table compiled"
    if "num_programs" not in got:
        return line + " (no warm-up report: --skip-warmup?)"
    return line + (
        f"; {got['num_programs']} programs ({got['num_programs_first']} before ready), "
        f"{got['num_xla_compiles']} XLA compilations, {got['compile_seconds']:.1f} s of "
        f"compiling on {got['compile_threads']} threads, persistent cache "
        f"{got['persistent_cache_hits']} hits / {got['persistent_cache_misses']} misses, "
        f"{got['num_programs_loaded']} loaded as stored"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2, help="Runs per cache state.")
    parser.add_argument("--cache-dir", default=None, help="Default: a fresh temporary folder.")
    parser.add_argument("--warm-only", action="store_true", help="Skip the cold runs.")
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--ready-only", action="store_true", help="Stop each run at /health 200.")
    parser.add_argument("serve_args", nargs="*", help="Flags passed to serve.py (after --).")
    args = parser.parse_args()
    cache_dir = Path(args.cache_dir or tempfile.mkdtemp(prefix="lazyspec-jax-cache-"))
    states = ["warm"] if args.warm_only else ["cold", "warm"]
    for state in states:
        for run in range(args.runs):
            if state == "cold":
                shutil.rmtree(cache_dir, ignore_errors=True)
            got = measure_startup(args.serve_args, cache_dir, args.timeout, args.ready_only)
            print(describe(state, run + 1, got), flush=True)


if __name__ == "__main__":
    main()
