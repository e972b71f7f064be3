"""SGLang-native endpoints (/generate, /flush_cache, /server_info, /metrics) with plain httpx,
and the launch flags of ``python -m lazyspec.server.launch``."""

from __future__ import annotations

import dataclasses
import json

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lazyspec.config import EngineConfig
from tests.server.conftest import SERVED_NAME, assert_all_free, random_ids, wait_idle


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/generate", json=body, timeout=120)


def _params(max_new: int) -> dict:
    return {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}


def scrape(server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_generate_text_and_ids_agree_with_full_meta_info(server):
    text = "the state of a recurrent layer is copied"
    ids = server.tokenizer.encode(text).ids
    by_text = _post(server, {"text": text, "sampling_params": _params(9), "return_logprob": True})
    by_ids = _post(server, {"input_ids": ids, "sampling_params": _params(9)})
    assert by_text.status_code == by_ids.status_code == 200
    a, b = by_text.json(), by_ids.json()
    assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == 9
    assert a["text"] == server.tokenizer.decode(a["output_ids"])
    meta = a["meta_info"]
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 9
    assert meta["finish_reason"] == {"type": "length", "length": 9}
    assert meta["cached_tokens"] == 0
    assert meta["spec_verify_ct"] == 8  # first token from the prefill, then one per decode step
    assert [t for _, t, _ in meta["output_token_logprobs"]] == a["output_ids"]
    assert all(lp <= 0 for lp, _, _ in meta["output_token_logprobs"])
    assert "output_token_logprobs" not in b["meta_info"]


def test_the_engine_computes_logprobs_only_where_the_client_asks(server, monkeypatch):
    """A request reaches the engine with ``return_logprob`` as its client asked (SGLang's
    ``return_logprob``; OpenAI's ``logprobs``): without, a greedy request's decode steps may
    take the argmax alone (``greedy_decodable``) rather than computing logprobs nobody
    reads; with, the logprobs come back."""
    from lazyspec.scheduler.batch import greedy_decodable

    seen = []
    add = server.worker.engine.add_request

    def recording(*args, **kwargs):
        req = add(*args, **kwargs)
        seen.append(req)
        return req

    monkeypatch.setattr(server.worker.engine, "add_request", recording)
    ids = random_ids(np.random.default_rng(21), 17, server.tokenizer.get_vocab_size())
    plain = _post(server, {"input_ids": ids, "sampling_params": _params(5)}).json()
    asked = _post(server, {"input_ids": ids, "sampling_params": _params(5), "return_logprob": True})
    body = {"model": SERVED_NAME, "prompt": ids, "max_tokens": 5, "temperature": 0}
    completion = httpx.post(
        f"{server.url}/v1/completions", json={**body, "logprobs": 2}, timeout=120
    )
    got = [(req.return_logprob, greedy_decodable(req)) for req in seen]
    assert got == [(False, True), (True, False), (True, False)]
    assert "output_token_logprobs" not in plain["meta_info"]
    meta = asked.json()["meta_info"]
    assert plain["output_ids"] == asked.json()["output_ids"]
    assert all(lp <= 0 for lp, _, _ in meta["output_token_logprobs"])
    assert len(completion.json()["choices"][0]["logprobs"]["token_logprobs"]) == 5


def test_generate_stream_is_cumulative_and_ends_with_done(server):
    ids = random_ids(np.random.default_rng(20), 33, server.tokenizer.get_vocab_size())
    whole = _post(server, {"input_ids": ids, "sampling_params": _params(12)}).json()
    chunks, lines = [], []
    with httpx.stream(
        "POST",
        f"{server.url}/generate",
        timeout=120,
        json={"input_ids": ids, "sampling_params": _params(12), "stream": True},
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    for before, after in zip(chunks, chunks[1:]):
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
        assert len(after["output_ids"]) > len(before["output_ids"])
    assert [c["meta_info"]["finish_reason"] is not None for c in chunks].count(True) == 1
    assert chunks[-1]["output_ids"] == whole["output_ids"]
    assert chunks[-1]["text"] == whole["text"]


def test_generate_batch_returns_one_result_per_prompt(server):
    texts = ["def return if else", "checkpoint every interval tokens while"]
    batch = _post(server, {"text": texts, "sampling_params": _params(5)}).json()
    assert isinstance(batch, list) and len(batch) == 2
    for result, text in zip(batch, texts):
        alone = _post(server, {"text": text, "sampling_params": _params(5)}).json()
        assert result["output_ids"] == alone["output_ids"]


def test_flush_cache_frees_every_checkpoint(server):
    ids = random_ids(np.random.default_rng(21), 150, server.tokenizer.get_vocab_size())
    _post(server, {"input_ids": ids, "sampling_params": _params(4)})
    info = wait_idle(server)
    assert info["cached_state_slots"] >= 1 and info["cached_kv_tokens"] >= 128
    assert info["free_state_slots"] + info["cached_state_slots"] == info["state_slots"]
    response = httpx.post(f"{server.url}/flush_cache", timeout=30)
    assert response.status_code == 200 and response.json()["success"] is True
    assert_all_free(server.info())


def test_server_info_reports_plan_and_hit_rate(server):
    ids = random_ids(np.random.default_rng(22), 140, server.tokenizer.get_vocab_size())
    before = server.info()
    for _ in range(2):
        _post(server, {"input_ids": ids, "sampling_params": _params(3)})
    info = wait_idle(server)
    for key in (
        "bytes_per_state_slot",
        "slots_per_running_request",
        "max_running_requests",
        "slots_left_for_cached_checkpoints",
        "kv_tokens",
        "context_length",
    ):
        assert key in info
    assert info["num_prompt_tokens"] - before["num_prompt_tokens"] == 280
    assert info["num_cached_tokens"] - before["num_cached_tokens"] == 128
    assert info["cache_hit_rate"] == pytest.approx(
        info["num_cached_tokens"] / info["num_prompt_tokens"]
    )
    assert info["served_model_name"] and info["max_running_requests"] == 8


def test_metrics_count_tokens_requests_and_latencies(server):
    ids = random_ids(np.random.default_rng(23), 70, server.tokenizer.get_vocab_size())
    _post(server, {"input_ids": ids, "sampling_params": _params(4)})
    wait_idle(server)
    before = scrape(server)
    result = _post(server, {"input_ids": ids, "sampling_params": _params(7)}).json()
    wait_idle(server)
    after = scrape(server)

    def delta(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert result["meta_info"]["cached_tokens"] == 64
    assert delta("lazyspec_requests_total", endpoint="generate", finish_reason="length") == 1
    assert delta("lazyspec_prompt_tokens_total") == 70
    assert delta("lazyspec_generation_tokens_total") == 7
    assert delta("lazyspec_cached_tokens_total") == 64
    assert delta("lazyspec_time_to_first_token_seconds_count") == 1
    assert delta("lazyspec_inter_token_latency_seconds_count") == 6
    assert delta("lazyspec_e2e_request_latency_seconds_count") == 1
    info = server.info()
    assert after[("lazyspec_state_slots", (("use", "free"),))] == info["free_state_slots"]
    assert after[("lazyspec_kv_tokens", (("use", "cached"),))] == info["cached_kv_tokens"]
    assert after[("lazyspec_num_running_requests", ())] == 0
    assert after[("lazyspec_spec_accept_length", ())] == 1.0  # no speculation: one per step


def test_health(server):
    response = httpx.get(f"{server.url}/health", timeout=10)
    assert response.status_code == 200 and response.json() == {"status": "ok"}


# ---------------------------------------------------------------- launch flags


def test_every_engine_field_has_a_flag_with_help():
    from lazyspec.server.launch import HELP, SKIPPED_FIELDS, build_parser

    parser = build_parser()
    by_dest = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(EngineConfig):
        if f.name in SKIPPED_FIELDS:
            continue
        assert f.name in by_dest, f.name
        assert f.name in HELP and by_dest[f.name].help, f.name
    for flag in ("--host", "--port", "--max-queued-requests", "--served-model-name"):
        assert parser._option_string_actions[flag].help


def test_flags_parse_to_engine_config():
    from lazyspec.server.launch import build_parser, engine_kwargs

    args = build_parser().parse_args(
        [
            "--model-path",
            "/m",
            "--page-size",
            "2",
            "--mamba-radix-cache-strategy",
            "extra_buffer_lazy",
            "--mamba-track-interval",
            "128",
            "--disable-overlap-schedule",
            "--speculative-algorithm",
            "NEXTN",
            "--speculative-num-steps",
            "2",
            "--max-queued-requests",
            "7",
            "--port",
            "31234",
        ]
    )
    kwargs = engine_kwargs(args)
    config = EngineConfig(**kwargs)
    assert (config.page_size, config.mamba_track_interval) == (2, 128)
    assert config.mamba_scheduler_strategy == "extra_buffer_lazy"
    assert config.disable_overlap_schedule is True and config.num_verify_tokens == 3
    assert "dtype" not in kwargs  # unset flags keep EngineConfig's defaults
    assert (args.max_queued_requests, args.port) == (7, 31234)


def test_bad_flags_and_missing_default_model_are_clear(tmp_path, capsys):
    from lazyspec.server.launch import build_parser, main, resolve_model_path

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--mamba-scheduler-strategy", "eager"])
    with pytest.raises(ValueError, match="--model-path"):
        resolve_model_path(None, default=tmp_path / "absent")
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(None, default=tmp_path) == str(tmp_path)
    with pytest.raises(SystemExit):
        main(["--model-path", str(tmp_path), "--page-size", "0"])
    assert "page_size=0" in capsys.readouterr().err
