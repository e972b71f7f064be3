"""Start-up and graceful shutdown: the 503 while starting, warm-up progress, the drain (in
process, driven without signals) and one served process stopped by signals."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import threading
import time

import httpx

from lazyspec.testing.serve_process import launch_serve
from tests.server.conftest import (
    SERVED_NAME,
    assert_all_free,
    start_http,
    wait_idle,
)

LONG = 480  # new tokens: a stream that outlives every drain timeout below


def _app_on(live) -> tuple:
    """A second app on the session's engine worker, served on its own port: draining it
    leaves the session's app admitting."""
    from lazyspec.server.app import ServerSettings, create_app

    app = create_app(live.worker, ServerSettings(SERVED_NAME))
    server, thread, url = start_http(app)
    return app, server, thread, url


def _stream_lines(url: str, body: dict, lines: list[str], first: threading.Event) -> None:
    """POST a streamed request; every ``data:`` payload goes to ``lines``."""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                lines.append(line[len("data: ") :])
                first.set()


def _open_streams(url: str, num: int, max_tokens: int) -> tuple[list, list[list[str]]]:
    """``num`` streams, each in a thread; returns once each has sent a first event."""
    threads, outputs = [], []
    for i in range(num):
        lines: list[str] = []
        first = threading.Event()
        body = {
            "model": SERVED_NAME,
            "prompt": f"the state of a recurrent layer {i}",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        thread = threading.Thread(target=_stream_lines, args=(url, body, lines, first))
        thread.start()
        assert first.wait(60), "a stream sent nothing"
        threads.append(thread)
        outputs.append(lines)
    return threads, outputs


def _assert_ended_with_error(lines: list[str]) -> None:
    """An error event, then [DONE]; every chunk's finish_reason one of OpenAI's (an
    aborted choice has none)."""
    assert lines[-1] == "[DONE]", lines[-3:]
    error = json.loads(lines[-2])["error"]
    assert error["message"] == "the server is shutting down" and error["type"], error
    chunks = [json.loads(line) for line in lines[:-2]]
    assert chunks and all("choices" in chunk for chunk in chunks), lines[:-2]
    reasons = [choice["finish_reason"] for chunk in chunks for choice in chunk["choices"]]
    assert set(reasons) <= {None, "stop", "length"}, reasons


def _assert_refused_as_shutting_down(url: str) -> None:
    body = {"model": SERVED_NAME, "prompt": "the state", "max_tokens": 4}
    for response in (
        httpx.post(f"{url}/v1/completions", json=body, timeout=30),
        httpx.get(f"{url}/health", timeout=30),
    ):
        assert response.status_code == 503, response.text
        assert int(response.headers["retry-after"]) > 0
        assert response.json()["error"]["code"] == "shutting_down"


def test_drain_aborts_what_outlives_the_timeout_and_frees_everything(server):
    app, http, http_thread, url = _app_on(server)
    front = app.state.frontend
    try:
        threads, outputs = _open_streams(url, 3, LONG)
        blocking = {}

        def unstreamed() -> None:
            body = {
                "text": "the state",
                "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True},
            }
            blocking["response"] = httpx.post(f"{url}/generate", json=body, timeout=60)

        waiter = threading.Thread(target=unstreamed)
        waiter.start()
        deadline = time.monotonic() + 30
        while front.num_live < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        timeout = 0.3
        loop = http.servers[0].get_loop()
        start = time.monotonic()
        drain = asyncio.run_coroutine_threadsafe(front.drain(timeout), loop)
        time.sleep(0.1)
        _assert_refused_as_shutting_down(url)
        assert drain.result(30) == 4  # three streams and the unstreamed request
        for thread in [*threads, waiter]:
            thread.join(30)
        assert time.monotonic() - start < timeout + 5.0
        for lines in outputs:
            _assert_ended_with_error(lines)
        response = blocking["response"]
        assert response.status_code == 500, response.text
        assert response.json()["error"]["message"] == "the server is shutting down"
    finally:
        http.should_exit = True
        http_thread.join(30)
    wait_idle(server)
    assert httpx.post(f"{server.url}/flush_cache", timeout=30).status_code == 200
    assert_all_free(server.info())


def test_drain_lets_requests_finish_within_the_timeout(server):
    app, http, http_thread, url = _app_on(server)
    try:
        threads, outputs = _open_streams(url, 2, 24)
        loop = http.servers[0].get_loop()
        drain = asyncio.run_coroutine_threadsafe(app.state.frontend.drain(60.0), loop)
        assert drain.result(60) == 0  # nothing left to abort
        for thread in threads:
            thread.join(30)
        for lines in outputs:
            assert lines[-1] == "[DONE]"
            assert json.loads(lines[-2])["choices"][0]["finish_reason"] == "length"
            assert not any('"error"' in line for line in lines)
        _assert_refused_as_shutting_down(url)
    finally:
        http.should_exit = True
        http_thread.join(30)


def test_starting_app_answers_503_until_the_app_is_installed(server):
    from lazyspec.server.app import ServerSettings, create_app
    from lazyspec.server.lifecycle import StartingApp

    holder = StartingApp()
    http, thread, url = start_http(holder)
    try:
        health = httpx.get(f"{url}/health", timeout=30)
        assert health.status_code == 503 and health.json() == {"status": "starting"}
        assert int(health.headers["retry-after"]) > 0
        models = httpx.get(f"{url}/v1/models", timeout=30)
        assert models.status_code == 503 and models.json()["error"]["code"] == "starting"
        assert holder.frontend is None
        holder.install(create_app(server.worker, ServerSettings(SERVED_NAME)))
        assert httpx.get(f"{url}/health", timeout=30).json() == {"status": "ok"}
        assert holder.frontend is not None
    finally:
        http.should_exit = True
        thread.join(30)


def test_warmup_reports_every_shape_and_compiles_nothing_new(server):
    calls: list[tuple[int, int]] = []

    def warm(engine) -> tuple[int, int]:
        before = engine.num_compiled()
        engine.warmup(lambda done, total: calls.append((done, total)))
        return before, engine.num_compiled()

    before, after = server.worker.call(warm).result(120)
    total = calls[0][1]
    assert calls == [(done, total) for done in range(total + 1)]
    assert total >= 2 and before == after  # the session's engine compiled all at start-up


def test_models_max_len_is_the_plans_longest_request(server):
    model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]
    info = server.info()
    assert model["max_model_len"] == info["max_request_len"] < info["context_length"]


def test_served_process_drains_on_sigterm_and_aborts_on_a_second_signal(model_dir):
    args = [
        "--model-path",
        str(model_dir),
        "--served-model-name",
        SERVED_NAME,
        "--skip-warmup",
        "--context-length",
        "4096",
        "--max-total-tokens",
        "16384",
        "--compilation-cache-dir",
        "none",
        "--graceful-shutdown-timeout",
        "120",
    ]
    process, url = launch_serve(
        args, {"JAX_PLATFORMS": "cpu"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.communicate()[0]
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not become healthy"
            time.sleep(0.2)
        threads, outputs = _open_streams(url, 2, 4000)  # tens of seconds each
        process.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert process.poll() is None  # draining: the streams may still finish
        _assert_refused_as_shutting_down(url)
        start = time.monotonic()
        process.send_signal(signal.SIGINT)
        log, _ = process.communicate(timeout=60)
        assert time.monotonic() - start < 30  # far below the 120 s grace period
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    for thread in threads:
        thread.join(30)
    assert process.returncode == 0, log
    assert "Traceback" not in log and "CancelledError" not in log, log
    for lines in outputs:
        _assert_ended_with_error(lines)


def test_help_shows_the_server_defaults():
    from lazyspec.server.launch import build_parser

    text = " ".join(build_parser().format_help().split())
    for flag, default in (
        ("--host", "127.0.0.1"),
        ("--port", "30000"),
        ("--max-queued-requests", "1024"),
        ("--graceful-shutdown-timeout", "30.0"),
        ("--compilation-cache-dir", "~/.cache/lazyspec/jax"),
    ):
        entry = text.split(f"{flag} ")[-1].split(" --")[0]  # the option's own help text
        assert "(default: " in entry and default in entry, (flag, entry)
