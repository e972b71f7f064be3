"""Hostile input is refused cheaply (body size, JSON depth, prompt length, off-loop
tokenization) and the server is safe on a desktop (API key, JSON content type, Host
allow-list, CORS only on request, POST-only state changes)."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time

import httpx
import pytest

from tests.server.conftest import SERVED_NAME, start_http

SMALL = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
JSON = {"Content-Type": "application/json"}


def _check_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@contextlib.contextmanager
def _serve(server, **fields):
    """A second front end on the session's engine with ``fields`` set in its settings."""
    from lazyspec.server.app import ServerSettings, create_app

    settings = ServerSettings(SERVED_NAME, max_queued_requests=16, **fields)
    http, thread, url = start_http(create_app(server.worker, settings))
    try:
        yield url
    finally:
        http.should_exit = True
        thread.join(30)


class _Records(logging.Handler):
    """Every record at WARNING or above, from any thread."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _logged():
    handler = _Records()
    loggers = [logging.getLogger(n) for n in ("", "uvicorn", "uvicorn.error", "lazyspec")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


# ---------------------------------------------------------------- body size and JSON depth


def test_body_over_the_limit_is_413_by_content_length_and_while_streaming(server):
    with _serve(server, max_request_bytes=4096) as url:
        ok = httpx.post(f"{url}/generate", json=SMALL, timeout=60)
        assert ok.status_code == 200, ok.text
        big = b'{"text": "' + b"a" * 8000 + b'"}'
        error = _check_error(httpx.post(f"{url}/generate", content=big, headers=JSON), 413)
        assert "max_request_bytes=4096" in error["message"]

        def chunks():  # no Content-Length: the server counts as it reads
            yield b'{"text": "'
            for _ in range(64):
                yield b"a" * 1024
            yield b'"}'

        response = httpx.post(f"{url}/generate", content=chunks(), headers=JSON, timeout=30)
        assert "content-length" not in response.request.headers
        _check_error(response, 413)
        assert httpx.post(f"{url}/generate", json=SMALL, timeout=60).status_code == 200


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"prompt": "hi", "junk": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"prompt": "hi", "junk": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_001,
    ],
)
def test_deep_json_is_400_without_traceback_and_keeps_the_connection(server, raw):
    with _logged() as records, httpx.Client(base_url=server.url, timeout=60) as client:
        error = _check_error(client.post("/v1/completions", content=raw, headers=JSON), 400)
        assert "nested deeper than 64" in error["message"]
        after = client.post("/generate", json=SMALL)
        assert after.status_code == 200, after.text
    assert not [r for r in records if r.exc_info or r.levelno >= logging.ERROR], records


def test_json_depth_counts_only_structure():
    from lazyspec.server.limits import MAX_JSON_DEPTH, ApiError
    from lazyspec.server.readers import json_depth, parse_json_body

    assert json_depth(b'{"a": [[1, {"b": []}]], "s": "[[[[\\"]]"}') == 5
    assert json_depth(b'["\\\\", ["\\\\\\"[["]]') == 2  # escaped backslashes, then a quote
    assert json_depth(b"") == 0 and json_depth(b'"[[["') == 0
    inner = b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1)
    assert parse_json_body(b'{"a": ' + inner + b"}") == {"a": json.loads(inner)}
    with pytest.raises(ApiError, match="nested deeper"):
        parse_json_body(b'{"a": [' + inner + b"]}")


# ---------------------------------------------------------------- tokenization off the loop


def test_huge_prompt_is_refused_untokenized_and_health_stays_fast(server):
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            while not done.is_set():
                start = time.perf_counter()
                assert client.get("/health").status_code == 200
                latencies.append(time.perf_counter() - start)
                time.sleep(0.01)

    words = "the state of a recurrent layer is copied into a slot when the prefix cache "
    prompt = (words * (4_000_000 // len(words)))[:4_000_000]
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        time.sleep(0.1)
        responses = [
            httpx.post(f"{server.url}{path}", json=body, timeout=120)
            for path, body in (
                ("/v1/completions", {"prompt": prompt}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}),
            )
        ]
        time.sleep(0.1)
    finally:
        done.set()
        poller.join(30)
    assert len(latencies) >= 5 and max(latencies) < 0.5, max(latencies)
    for response in responses:
        assert "max_prompt_chars" in _check_error(response, 400)["message"]


def test_long_outputs_detokenize_off_the_loop_with_the_same_text(server, monkeypatch):
    from lazyspec.server import app as app_module
    from lazyspec.server.render import Choice

    threads: list[str] = []
    apply = Choice.apply

    def recording_apply(self, event):
        threads.append(threading.current_thread().name)
        return apply(self, event)

    monkeypatch.setattr(Choice, "apply", recording_apply)
    body = {
        "prompt": "the state of a recurrent layer",
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
        "stop": ["slot when"],
    }
    texts = []
    for inline_tokens in (app_module.INLINE_DETOKENIZE_TOKENS, 0):
        monkeypatch.setattr(app_module, "INLINE_DETOKENIZE_TOKENS", inline_tokens)
        threads.clear()
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["text"])
        pooled = [name.startswith("lazyspec-detokenize") for name in threads]
        assert threads and all(pooled) == (inline_tokens == 0) and any(pooled) == all(pooled)
    assert texts[0] == texts[1] and texts[0]


# ---------------------------------------------------------------- local security


def test_api_key_guards_every_endpoint_but_health(server):
    with _serve(server, api_key="s3cret") as url:
        good = {"Authorization": "Bearer s3cret"}
        for bad in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "s3cret"}):
            for method, path in (
                ("POST", "/generate"),
                ("GET", "/v1/models"),
                ("GET", "/metrics"),
                ("GET", "/server_info"),
                ("POST", "/flush_cache"),
            ):
                response = httpx.request(method, f"{url}{path}", json=SMALL, headers=bad)
                assert _check_error(response, 401)["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.head(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/v1/models", headers=good).status_code == 200
        generated = httpx.post(f"{url}/generate", json=SMALL, headers=good, timeout=60)
        assert generated.status_code == 200, generated.text


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_json_endpoints_need_a_json_content_type(server, path):
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {} if content_type is None else {"Content-Type": content_type}
        response = httpx.post(f"{server.url}{path}", content=b"{}", headers=headers)
        _check_error(response, 415)
    charset = {"Content-Type": "application/json; charset=utf-8"}
    body = b'{"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}}'
    assert httpx.post(f"{server.url}/generate", content=body, headers=charset).status_code == 200


def test_flush_cache_is_post_only_and_health_answers_head(server):
    _check_error(httpx.get(f"{server.url}/flush_cache"), 405)
    head = httpx.head(f"{server.url}/health")
    assert head.status_code == 200 and head.content == b""


def test_host_allow_list(server):
    def status(url: str, host: str) -> int:
        return httpx.get(f"{url}/v1/models", headers={"Host": host}).status_code

    for host in ("localhost", "localhost:30000", "127.0.0.1:9", "[::1]:8080", "LOCALHOST"):
        assert status(server.url, host) == 200, host
    for host in ("evil.example", "evil.example:30000", "127.0.0.2", "localhost.evil.example"):
        assert status(server.url, host) == 400, host
    with _serve(server, allowed_hosts=("localhost", "model.lan")) as url:
        assert status(url, "model.lan:30000") == 200 and status(url, "evil.example") == 400
    with _serve(server, allowed_hosts=None) as url:
        assert status(url, "evil.example") == 200


def test_allowed_hosts_flag():
    from lazyspec.server.launch import allowed_hosts

    assert allowed_hosts("127.0.0.1", None) == ("localhost", "127.0.0.1", "[::1]")
    assert allowed_hosts("::1", None) == ("localhost", "127.0.0.1", "[::1]")
    assert allowed_hosts("0.0.0.0", None) is None
    assert allowed_hosts("0.0.0.0", "a.lan, b.lan")[-2:] == ("a.lan", "b.lan")
    assert allowed_hosts("127.0.0.1", "*") is None


def test_cors_headers_only_with_allowed_origins(server):
    origin = {"Origin": "http://page.example"}
    plain = httpx.get(f"{server.url}/v1/models", headers=origin)
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers
    with _serve(server, allowed_origins=("http://page.example",), api_key="k") as url:
        preflight = httpx.options(
            f"{url}/v1/completions",
            headers={
                **origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://page.example"
        denied = httpx.get(f"{url}/v1/models", headers=origin)
        assert denied.status_code == 401
        assert denied.headers["access-control-allow-origin"] == "http://page.example"
        other = httpx.get(
            f"{url}/v1/models",
            headers={"Origin": "http://evil.example", "Authorization": "Bearer k"},
        )
        assert "access-control-allow-origin" not in other.headers


# ---------------------------------------------------------------- OpenAPI


def test_openapi_is_not_served_but_describes_every_json_body(server):
    from lazyspec.server.app import ServerSettings, create_app

    _check_error(httpx.get(f"{server.url}/openapi.json"), 404)
    app = create_app(server.worker, ServerSettings(SERVED_NAME))
    paths = app.openapi()["paths"]
    vocab = server.worker.vocab_size
    for path, required in (
        ("/v1/completions", [["prompt"]]),
        ("/v1/chat/completions", [["messages"]]),
        ("/generate", [["text"], ["input_ids"]]),  # exactly one of them
    ):
        schema = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        objects = schema.get("anyOf", [schema])
        assert [s["required"] for s in objects] == required
        for s in objects:
            top_k = s["properties"].get("top_k") or s["properties"]["sampling_params"]
            assert f"'maximum': {vocab}" in str(top_k)
    assert "/flush_cache" in paths and "get" not in paths["/flush_cache"]


# ---------------------------------------------------------------- amplification


def _amplifying_bodies(server) -> list[tuple[str, dict]]:
    """The shapes that made one small body cost seconds: many one-character prompts times
    n (each copy a request), and a batch of long texts under the per-prompt limit."""
    from lazyspec.server.limits import max_body_prompt_chars, max_prompt_chars

    worker = server.worker
    per_prompt = max_prompt_chars(server.tokenizer, worker.max_context) // 2
    budget = max_body_prompt_chars(server.tokenizer, worker.max_context, worker.kv_tokens)
    words = "the state of a recurrent layer is copied into a slot when the prefix cache "
    long_text = (words * (per_prompt // len(words) + 1))[:per_prompt]
    texts = [long_text] * (budget // per_prompt + 2)  # fewer than the server's places
    return [
        ("/v1/completions", {"prompt": ["x"] * 10_000, "n": 128, "max_tokens": 1}),
        ("/generate", {"text": ["x"] * 10_000, "sampling_params": {"n": 128}}),
        ("/v1/completions", {"prompt": texts, "max_tokens": 1}),
        ("/generate", {"text": texts, "sampling_params": {"max_new_tokens": 1}}),
    ]


def test_amplifying_bodies_are_refused_before_tokenizing(server):
    """prompts x n and the prompts' total text are checked on the raw JSON, so a refusal
    costs no tokenizing and no copies, and parsing one takes milliseconds."""
    from lazyspec.server.app import ServerSettings, _Frontend
    from lazyspec.server.limits import ApiError
    from lazyspec.server.protocol import parse_completion, parse_generate

    codes = []
    for path, body in _amplifying_bodies(server):
        response = httpx.post(f"{server.url}{path}", json=body, timeout=120)
        codes.append(_check_error(response, 400)["code"])
    assert codes == ["too_many_prompts"] * 2 + ["prompt_too_long"] * 2, codes
    limits = _Frontend(server.worker, ServerSettings(SERVED_NAME, max_queued_requests=256)).limits
    for path, body in _amplifying_bodies(server):
        parser = parse_completion if path == "/v1/completions" else parse_generate
        start = time.perf_counter()
        with pytest.raises(ApiError) as refused:
            parser(body, server.tokenizer, limits)
        elapsed = time.perf_counter() - start
        assert refused.value.code in ("too_many_prompts", "prompt_too_long")
        assert elapsed < 0.01, (path, elapsed)  # no tokenizing, no copies


def test_normal_latency_holds_while_amplifying_bodies_arrive(server):
    """Four amplifying bodies at once leave an ordinary completion's latency as it was."""
    normal = {"model": SERVED_NAME, "prompt": "def f(x):", "max_tokens": 4, "temperature": 0}

    def timed(client: httpx.Client) -> float:
        start = time.perf_counter()
        response = client.post("/v1/completions", json=normal)
        assert response.status_code == 200, response.text
        return time.perf_counter() - start

    bodies = _amplifying_bodies(server)
    raw = [(path, json.dumps(body).encode()) for path, body in bodies]
    with httpx.Client(base_url=server.url, timeout=120) as client:
        timed(client)
        baseline = sorted(timed(client) for _ in range(5))[2]
        answers: list[tuple[int, float]] = []

        def send(path: str, content: bytes) -> None:
            with httpx.Client(base_url=server.url, timeout=120) as own:
                start = time.perf_counter()
                response = own.post(path, content=content, headers=JSON)
                answers.append((response.status_code, time.perf_counter() - start))

        senders = [threading.Thread(target=send, args=item) for item in raw]
        for sender in senders:
            sender.start()
        during = [timed(client) for _ in range(3)]
        for sender in senders:
            sender.join(120)
    assert max(during) < 3 * baseline + 0.5, (baseline, during)
    assert sorted(status for status, _ in answers) == [400] * len(raw), answers
    assert max(elapsed for _, elapsed in answers) < 2.0, answers


POST_PATHS = ("/flush_cache", "/generate", "/v1/completions", "/v1/chat/completions")


@pytest.mark.parametrize("path", POST_PATHS)
def test_cross_origin_posts_are_refused_on_every_endpoint(server, path):
    """What a page on another origin can send without a preflight (a form, text/plain or
    an empty POST, with its Origin) changes nothing; the server's own origin and listed
    origins pass."""
    evil = {"Origin": "http://evil.example"}
    simple = [
        (b"", {}),
        (b"a=1", {"Content-Type": "application/x-www-form-urlencoded"}),
        (b"{}", {"Content-Type": "text/plain"}),
        (b"{}", {"Content-Type": "multipart/form-data; boundary=x"}),
    ]
    for content, headers in simple:
        response = httpx.post(f"{server.url}{path}", content=content, headers={**evil, **headers})
        assert _check_error(response, 403)["code"] == "origin_not_allowed", response.text
    if path == "/flush_cache":  # without an Origin a form is still no JSON
        response = httpx.post(
            f"{server.url}{path}",
            content=b"a=1",
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        _check_error(response, 415)
    own = {"Origin": server.url, **JSON}
    body = json.dumps(SMALL if path == "/generate" else {}).encode()
    if path in ("/flush_cache", "/generate"):
        assert httpx.post(f"{server.url}{path}", content=body, headers=own).status_code == 200
    with _serve(server, allowed_origins=("http://evil.example",)) as url:
        if path in ("/flush_cache", "/generate"):
            listed = httpx.post(f"{url}{path}", content=body, headers={**evil, **JSON}, timeout=60)
            assert listed.status_code == 200, listed.text


def test_a_request_without_host_is_told_so(server):
    import socket

    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.0\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert b"no Host header" in answer and b"None" not in answer, answer
