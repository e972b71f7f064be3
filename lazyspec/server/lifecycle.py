"""Start-up and shutdown of the served process: what ``launch.main`` wires together.

* ``StartingApp`` answers every path with 503 (``/health``: ``{"status": "starting"}``) until
  the real app is installed, so uvicorn can listen while the engine loads and compiles.
* ``EngineStartup`` builds the engine in a thread once uvicorn listens, then installs the app
  as soon as the programs a first request needs are compiled; the rest of the program table
  compiles on in the background (``Engine.warmup``), and ``/server_info``'s ``warmup``
  reports it with the persistent compilation cache's hits and misses and the programs
  loaded as stored (``engine/executables.py``).
* ``WarmupBar`` shows warm-up compilation as a tqdm bar and stops it when asked.
* ``enable_compilation_cache`` turns on JAX's persistent compilation cache, and with it the
  store of compiled programs beside it, so a restart loads the programs from disk instead
  of compiling them again.
* ``GracefulServer`` is uvicorn's server with lazyspec's signal handling: the first SIGTERM /
  SIGINT drains the app (``_Frontend.drain``: stop admitting, let live requests finish for up
  to the grace period, abort the rest with an error event), a second one aborts at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn
from tqdm import tqdm

from lazyspec.server.app import RETRY_AFTER_S

logger = logging.getLogger(__name__)

STARTING_MESSAGE = "the server is starting (loading the model and compiling); retry later"


class StartingApp:
    """An ASGI app that answers 503 with Retry-After until ``install(app)``, then is ``app``."""

    def __init__(self) -> None:
        self.app: Any = None

    def install(self, app: Any) -> None:
        """Route every later request to ``app`` (a FastAPI app from ``create_app``)."""
        self.app = app

    @property
    def frontend(self) -> Any:
        """The installed app's frontend (None while starting)."""
        return None if self.app is None else self.app.state.frontend

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if self.app is not None:
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # lifespan is off; websockets are not served
            return
        if scope["path"] == "/health":
            body: dict = {"status": "starting"}
        else:
            body = {
                "error": {
                    "message": STARTING_MESSAGE,
                    "type": "server_unavailable",
                    "param": None,
                    "code": "starting",
                }
            }
        headers = [
            (b"content-type", b"application/json"),
            (b"retry-after", str(RETRY_AFTER_S).encode()),
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})


class StartupCancelled(Exception):
    """A signal arrived while the engine was being built."""


class WarmupBar:
    """``Engine(warmup_progress=...)`` callback: a tqdm bar on stderr; raises
    StartupCancelled at the next shape once ``cancel()`` was called."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self._bar: tqdm | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    def __call__(self, done: int, total: int) -> None:
        if self.cancelled.is_set():
            self.close()
            raise StartupCancelled()
        if self._bar is None:
            self._bar = tqdm(total=total, desc="compiling the first programs", unit="program")
        self._bar.update(done - self._bar.n)
        if done == total:
            self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/lazyspec/jax``, else ``~/.cache/lazyspec/jax``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lazyspec" / "jax"


def enable_compilation_cache(cache_dir: str | None) -> Path | None:
    """Turn on JAX's persistent compilation cache in ``cache_dir`` (default:
    ``default_cache_dir()``; ``"none"``: off). Every program is cached, however fast it
    compiled and however small (a minimum entry size of 0 would let JAX pick its own), so the
    CPU bucket programs are too. Call before the engine compiles."""
    if cache_dir is not None and cache_dir.lower() == "none":
        return None
    import jax

    path = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path


class GracefulServer(uvicorn.Server):
    """uvicorn's server serving a ``StartingApp``, with lazyspec's signal handling.

    First SIGTERM / SIGINT: while starting, stop the start-up and exit; once serving, drain
    the app for up to ``grace_s`` seconds, then exit. A second signal aborts the live requests
    now (they still end with an error event). Exits without re-raising the signal, so the
    process ends with status 0.
    """

    def __init__(self, config: uvicorn.Config, holder: StartingApp, grace_s: float) -> None:
        super().__init__(config)
        self.holder = holder
        self.grace_s = grace_s
        self.on_started: Any = None  # called once uvicorn listens
        self.on_cancel: Any = None  # called when a signal arrives during start-up
        self._loop: asyncio.AbstractEventLoop | None = None
        self._num_signals = 0
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if not self.should_exit and self.on_started is not None:
            self.on_started()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        """(Main thread, signal handler) Start the drain, or cut it short on a repeat."""
        self._num_signals += 1
        front = self.holder.frontend
        if front is None or self._loop is None:
            logger.info("signal %d during start-up: exiting", sig)
            if self.on_cancel is not None:
                self.on_cancel()
            self.should_exit = True
        elif self._num_signals == 1:
            self._loop.call_soon_threadsafe(self._start_drain, front)
        else:
            logger.info("signal %d again: aborting the live requests now", sig)
            front.abort_now()

    def _start_drain(self, front: Any) -> None:
        logger.info(
            "shutting down: %d requests live, waiting up to %gs for them "
            "(signal again to abort them now)",
            front.num_live,
            self.grace_s,
        )
        self._drain_task = asyncio.ensure_future(self._drain(front))

    async def _drain(self, front: Any) -> None:
        try:
            await front.drain(self.grace_s)
        except Exception:
            logger.exception("draining at shutdown failed")
        self.should_exit = True


class EngineStartup:
    """Builds the engine in a background thread (``start``, once uvicorn listens), then
    installs the app in ``holder``; ``finish`` (after uvicorn returns) stops the engine
    thread. A build error is kept in ``error`` and ends the server."""

    def __init__(
        self,
        kwargs: dict,
        settings: Any,
        holder: StartingApp,
        server: Any,
        url: str,
        size_pools: Any = None,
    ) -> None:
        """``size_pools(kwargs)`` (optional) fills in the pool sizes first, in the build
        thread (it reads the device's memory); its ValueError ends the server."""
        self.kwargs, self.settings, self.holder, self.server = kwargs, settings, holder, server
        self.url = url
        self.size_pools = size_pools
        self.bar = WarmupBar()
        self.worker: Any = None
        self.error: str | None = None
        self.thread = threading.Thread(target=self._build, name="lazyspec-startup", daemon=True)

    def start(self) -> None:
        print(f"listening on {self.url} (/health answers 503 until the model is ready)", flush=True)
        self.thread.start()

    def _build(self) -> None:
        from lazyspec.engine.engine import Engine
        from lazyspec.server.app import create_app
        from lazyspec.server.worker import EngineWorker

        print(f"loading weights from {self.kwargs['model_path']} ...", flush=True)
        try:
            if self.size_pools is not None:
                self.size_pools(self.kwargs)
            engine = Engine(warmup_progress=self.bar, background_warmup=True, **self.kwargs)
            if self.bar.cancelled.is_set():
                return
        except StartupCancelled:
            return
        except (ValueError, FileNotFoundError) as exc:
            self.error = str(exc)
            self.server.should_exit = True
            return
        except Exception as exc:
            logger.exception("building the engine failed")
            self.error = repr(exc)
            self.server.should_exit = True
            return
        self.worker = EngineWorker(engine).start()
        self.holder.install(create_app(self.worker, self.settings))
        print(f"ready: {self.url} (OpenAI API under /v1, SGLang API at /generate)", flush=True)
        status = engine.warmup_status()
        if status is not None:
            logger.info(
                "ready with %d of %d programs compiled (%d XLA compilations, %.1f s of "
                "compiling; persistent cache: %d hits, %d misses; %d loaded as stored); the "
                "rest compile on",
                status["num_programs_compiled"],
                status["num_programs"],
                status["num_xla_compiles"],
                status["compile_seconds"],
                status["persistent_cache_hits"],
                status["persistent_cache_misses"],
                status["num_programs_loaded"],
            )

    def finish(self) -> None:
        """Wait for a build in progress (it stops at the next shape once cancelled), then
        stop the engine thread."""
        self.bar.cancel()
        if self.thread.is_alive():
            self.thread.join()
        if self.worker is not None:
            self.worker.stop()
