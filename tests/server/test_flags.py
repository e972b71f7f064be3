"""An SGLang command line starts: its names parse, sizes take suffixes, the flags that act
here act, and the ones that do not are accepted with one log line each."""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest

from lazyspec.config import EngineConfig
from tests.server.conftest import ENGINE_SETTINGS, SERVED_NAME, start_http

SGLANG_LINE = [
    "--model-path",
    "/m",
    "--trust-remote-code",
    "--mem-fraction-static",
    "0.8",
    "--skip-server-warmup",
    "--tensor-parallel-size",
    "1",
    "--enable-metrics",
    "--kv-cache-dtype",
    "auto",
    "--grammar-backend",
    "xgrammar",
    "--log-level",
    "WARNING",
    "--disable-cuda-graph",
    "--max-prefill-tokens",
    "16k",
    "--schedule-policy",
    "lpm",
    "--watchdog-timeout",
    "300",
    "--stream-interval",
    "2",
    "--context-length",
    "32k",
    "--max-total-tokens",
    "1M",
    "--cuda-graph-max-bs",
    "64",
    "--attention-backend",
    "fa3",
]


def _parse(argv: list[str]):
    from lazyspec.server.flags import apply_sglang_flags
    from lazyspec.server.launch import build_parser, engine_kwargs

    args = build_parser().parse_args(argv)
    kwargs = engine_kwargs(args)
    kwargs["model_path"] = args.model_path
    return args, kwargs, apply_sglang_flags(args, kwargs)


def test_an_sglang_command_line_parses_and_ignored_flags_log_once(caplog):
    with caplog.at_level(logging.WARNING, logger="lazyspec.server.flags"):
        args, kwargs, sglang = _parse(SGLANG_LINE)
    config = EngineConfig(**kwargs)
    assert config.context_length == 32_000 and config.max_total_tokens == 2**20
    assert config.skip_warmup is True and config.tp_size == 1
    assert config.chunked_prefill_size == 512  # under --max-prefill-tokens: unchanged
    assert config.max_prefill_tokens == 16_000  # the prefill step's token budget
    assert args.log_level == "warning"
    assert (sglang.mem_fraction_static, sglang.stream_interval) == (0.8, 2)
    assert sglang.watchdog_timeout == 300.0 and config.grammar_backend == "xgrammar"
    assert EngineConfig(**_parse(["--model-path", "/m"])[1]).grammar_backend == "llguidance"
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        _parse(["--model-path", "/m", "--grammar-backend", "outlines"])
    lines = [r.getMessage() for r in caplog.records]
    for flag in (
        "--trust-remote-code",
        "--enable-metrics",
        "--disable-cuda-graph",
        "--cuda-graph-max-bs",
        "--attention-backend",
    ):
        assert sum(line.startswith(f"{flag} is ignored: ") for line in lines) == 1, lines
    assert config.schedule_policy == "lpm"
    assert not any("--skip-server-warmup" in line for line in lines)  # an alias, not ignored


def test_the_host_tier_flags_reach_the_config(caplog):
    line = ["--model-path", "/m", "--enable-hierarchical-cache", "--hicache-ratio", "3"]
    line += ["--hicache-size", "1.5", "--hicache-write-policy", "write_back"]
    with caplog.at_level(logging.WARNING, logger="lazyspec.server.flags"):
        _, kwargs, _ = _parse([*line, "--hicache-io-backend", "kernel"])
    config = EngineConfig(**kwargs)
    assert config.enable_hierarchical_cache and config.hicache_ratio == 3.0
    assert (config.hicache_size, config.hicache_write_policy) == (1.5, "write_back")
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "--hicache-io-backend is ignored"
    ]
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        _parse([*line[:2], "--hicache-write-policy", "write_around"])


def test_sizes_take_vllm_suffixes():
    from lazyspec.server.flags import size

    cases = {"4096": 4096, "4k": 4000, "4K": 4096, "32k": 32_000, "1M": 2**20, "1m": 10**6}
    cases.update({"25.6k": 25_600, "2G": 2 * 2**30, "-1": -1})
    assert {text: size(text) for text in cases} == cases
    for bad in ("4kb", "k", "1.5", "ten", ""):
        with pytest.raises(ValueError, match=repr(bad)):
            size(bad)


def test_acting_flags_apply_or_say_why_not(tmp_path):
    _, kwargs, _ = _parse(["--model-path", "/m", "--max-prefill-tokens", "200"])
    assert kwargs["chunked_prefill_size"] == 192  # whole 64-token chunks
    assert kwargs["max_prefill_tokens"] == 200
    _, kwargs, _ = _parse(["--model-path", "/m", "--dtype", "bfloat16", "--kv-cache-dtype", "bf16"])
    assert EngineConfig(**kwargs).dtype == "bfloat16"
    with pytest.raises(ValueError, match="--kv-cache-dtype=bfloat16 differs from --dtype=float32"):
        _parse(["--model-path", "/m", "--kv-cache-dtype", "bfloat16"])
    with pytest.raises(ValueError, match="fp8_e5m2"):
        _parse(["--model-path", "/m", "--kv-cache-dtype", "fp8_e5m2"])
    with pytest.raises(ValueError, match="--max-prefill-tokens=32"):
        _parse(["--model-path", "/m", "--max-prefill-tokens", "32"])
    with pytest.raises(ValueError, match="--stream-interval=0"):
        _parse(["--model-path", "/m", "--stream-interval", "0"])
    with pytest.raises(ValueError, match="--mem-fraction-static=1.5"):
        _parse(["--model-path", "/m", "--mem-fraction-static", "1.5"])
    _, kwargs, _ = _parse(["--model-path", "/m", "--compile-threads", "0"])
    with pytest.raises(ValueError, match="compile_threads=0 must be at least 1"):
        EngineConfig(**kwargs)
    model, other = tmp_path / "model", tmp_path / "other"
    for folder, text in ((model, "a"), (other, "b")):
        folder.mkdir()
        (folder / "tokenizer.json").write_text(text)
    _parse(["--model-path", str(model), "--tokenizer-path", str(model)])
    with pytest.raises(ValueError, match="differs from the model folder's"):
        _parse(["--model-path", str(model), "--tokenizer-path", str(other)])


def _serve(server, **fields):
    from lazyspec.server.app import ServerSettings, create_app

    settings = ServerSettings(SERVED_NAME, max_queued_requests=16, **fields)
    return start_http(create_app(server.worker, settings))


def _stream_chunks(url: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


def test_stream_interval_groups_tokens_and_keeps_the_text(server):
    body = {"prompt": "def f(x):", "max_tokens": 11, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
    http, thread, url = _serve(server, stream_interval=4)
    try:
        chunks = _stream_chunks(url, {**body, "stream": True, "logprobs": 0})
    finally:
        http.should_exit = True
        thread.join(30)
    sizes = [len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks]
    assert sum(sizes) == 11 and all(n >= 4 for n in sizes[:-1]), sizes
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]


def test_grammar_backend_none_refuses_grammars_by_field(server):
    """An engine built with grammar_backend none (no grammar programs compiled) refuses a
    grammar request with a 400 naming its field, before anything runs."""
    from lazyspec.engine.engine import Engine
    from lazyspec.server.app import ServerSettings, create_app
    from lazyspec.server.worker import EngineWorker

    engine = Engine(
        model_path=str(server.model_dir),
        **ENGINE_SETTINGS,
        skip_warmup=True,
        grammar_backend="none",
    )
    worker = EngineWorker(engine).start()
    http, thread, url = start_http(create_app(worker, ServerSettings(SERVED_NAME)))
    try:
        body = {"prompt": "x", "max_tokens": 4, "regex": "[ab]+"}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    finally:
        http.should_exit = True
        thread.join(30)
        worker.stop()
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "regex" and "--grammar-backend none" in error["message"]


def test_watchdog_makes_health_503_while_a_step_overruns(server, caplog):
    http, thread, url = _serve(server, watchdog_timeout=5.0)
    try:
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        server.worker.step_started = time.monotonic() - 60  # a step stalled for a minute
        with caplog.at_level(logging.ERROR, logger="lazyspec.server.app"):
            stalled = [httpx.get(f"{url}/health", timeout=30) for _ in range(2)]
        server.worker.step_started = None
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    finally:
        server.worker.step_started = None
        http.should_exit = True
        thread.join(30)
    assert [r.status_code for r in stalled] == [503, 503]
    assert "--watchdog-timeout=5.0" in stalled[0].json()["error"]["message"]
    assert sum("watchdog" in r.getMessage() for r in caplog.records) == 1
