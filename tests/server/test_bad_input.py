"""Bad input gets a 4xx with an OpenAI-style error body and leaves the server healthy; a
client leaving mid-stream frees its request's slots and pages; a full queue answers 503."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import SERVED_NAME, assert_all_free, random_ids, start_http, wait_idle

VOCAB_PROBE = 10**6  # far outside any vocabulary
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
JSON = {"Content-Type": "application/json"}  # raw bodies below are sent as JSON, whatever they hold
USER = [{"role": "user", "content": "hello"}]

BAD_BODIES = [
    (COMPLETIONS, {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "temperature": -0.5}, "temperature"),
    (COMPLETIONS, {"prompt": "hi", "temperature": "hot"}, "temperature"),
    (COMPLETIONS, {"prompt": "hi", "top_p": 0}, "top_p"),
    (COMPLETIONS, {"prompt": "hi", "top_p": 1.5}, "top_p"),
    (COMPLETIONS, {"prompt": "hi", "top_k": 0}, "top_k"),
    (COMPLETIONS, {"prompt": ""}, "prompt"),
    (COMPLETIONS, {"prompt": []}, "prompt"),
    (COMPLETIONS, {"prompt": [[]]}, "prompt"),
    (COMPLETIONS, {"prompt": ["a", ""]}, "prompt"),
    (COMPLETIONS, {}, "prompt"),
    (COMPLETIONS, {"prompt": [5, VOCAB_PROBE]}, "prompt"),
    (COMPLETIONS, {"prompt": [5, -3]}, "prompt"),
    (COMPLETIONS, {"prompt": [5, 1.5]}, "prompt"),
    (COMPLETIONS, {"prompt": [7] * 400, "max_tokens": 200}, "max_tokens"),
    (COMPLETIONS, {"prompt": [7] * 600}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "stop": 5}, "stop"),
    (COMPLETIONS, {"prompt": "hi", "stop": [""]}, "stop"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 99}, "logprobs"),
    (COMPLETIONS, {"prompt": "hi", "n": 0}, "n"),
    (COMPLETIONS, {"prompt": "hi", "n": 2, "best_of": 3}, "best_of"),
    (CHAT, {"messages": USER, "n": 500}, "n"),
    (COMPLETIONS, {"prompt": "hi", "stream": "yes"}, "stream"),
    (COMPLETIONS, {"prompt": "hi", "stream_options": 3}, "stream_options"),
    (COMPLETIONS, {"prompt": "hi", "seed": "x"}, "seed"),
    (COMPLETIONS, {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    (CHAT, {"messages": USER, "frequency_penalty": -3}, "frequency_penalty"),
    (
        "/generate",
        {"text": "a", "sampling_params": {"repetition_penalty": 0}},
        "repetition_penalty",
    ),  # noqa: E501
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": "hello"}, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    (CHAT, {"messages": [{"content": "x"}]}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"messages": USER, "max_tokens": 0}, "max_tokens"),
    (CHAT, {"messages": USER, "temperature": -1}, "temperature"),
    ("/generate", {}, "text"),
    ("/generate", {"text": "a", "input_ids": [5]}, "text"),
    ("/generate", {"text": 5}, "text"),
    ("/generate", {"input_ids": [VOCAB_PROBE]}, "input_ids"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": -2}}, "max_new_tokens"),
    ("/generate", {"text": "a", "sampling_params": {"warp": 9}}, "sampling_params"),
    ("/generate", {"text": "a", "sampling_params": [1]}, "sampling_params"),
    ("/generate", {"text": "a", "return_logprob": "yes"}, "return_logprob"),
    ("/generate", {"text": "a", "return_logprob": True, "top_logprobs_num": 6}, "top_logprobs_num"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 6}, "top_logprobs"),
    # values past what the engine's int32 / float32 batch arrays hold
    (COMPLETIONS, {"prompt": "x", "top_k": 2**40, "temperature": 1.0}, "top_k"),
    (COMPLETIONS, {"prompt": "x", "top_k": 2**31}, "top_k"),
    (COMPLETIONS, {"prompt": "x", "top_k": VOCAB_PROBE}, "top_k"),
    (COMPLETIONS, {"prompt": "x", "temperature": 1e39}, "temperature"),
    (COMPLETIONS, {"prompt": "x", "seed": 2**70}, "seed"),
    (CHAT, {"messages": USER, "top_k": 2**40}, "top_k"),
    ("/generate", {"text": "a", "sampling_params": {"top_k": 2**40}}, "top_k"),
    ("/generate", {"text": "a", "sampling_params": {"temperature": 1e39}}, "temperature"),
    # token ids must be integers: strings are not text prompts here
    ("/generate", {"input_ids": ["a"]}, "input_ids"),
    ("/generate", {"input_ids": "hello"}, "input_ids"),
    ("/generate", {"input_ids": [[5, 6], "a"]}, "input_ids"),
]


def test_range_errors_name_the_allowed_range(server):
    vocab = server.tokenizer.get_vocab_size()
    body = {"prompt": "x", "top_k": 2**40}
    message = httpx.post(f"{server.url}{COMPLETIONS}", json=body, timeout=30).json()["error"]
    assert f"[1, {vocab}]" in message["message"], message
    body = {"prompt": "x", "temperature": 1e39}
    message = httpx.post(f"{server.url}{COMPLETIONS}", json=body, timeout=30).json()["error"]
    assert "[0, 100.0]" in message["message"], message
    response = httpx.post(
        f"{server.url}{COMPLETIONS}", json={"prompt": "x", "frequency_penalty": 3}, timeout=30
    )
    assert response.status_code == 400 and "[-2.0, 2.0]" in response.json()["error"]["message"]
    body = {"text": "x", "sampling_params": {"repetition_penalty": -1}}
    message = httpx.post(f"{server.url}/generate", json=body, timeout=30).json()["error"]
    assert "[0.01, 2.0]" in message["message"], message


@pytest.mark.parametrize("path", [COMPLETIONS, "/generate"])
def test_repetition_penalty_range_keeps_output(server, path):
    """A penalty float32 cannot apply (1e-300 rounds to 0) is refused; the smallest one
    taken still gives max_tokens tokens of text."""

    def post(penalty: float) -> httpx.Response:
        fields = {"temperature": 0, "repetition_penalty": penalty}
        if path == COMPLETIONS:
            body = {"prompt": "the state of a recurrent layer", "max_tokens": 8, **fields}
        else:
            body = {"text": "the state of a recurrent layer"}
            body["sampling_params"] = {"max_new_tokens": 8, **fields}
        return httpx.post(f"{server.url}{path}", json=body, timeout=60)

    response = post(1e-300)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "repetition_penalty"
    response = post(0.01)
    assert response.status_code == 200, response.text
    out = response.json()
    if path == COMPLETIONS:
        text, num_tokens = out["choices"][0]["text"], out["usage"]["completion_tokens"]
    else:
        text, num_tokens = out["text"], out["meta_info"]["completion_tokens"]
    assert num_tokens == 8 and text.strip(), out


def _check_error(response: httpx.Response, status: int | None = None, param: str | None = None):
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    if status is not None:
        assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error


def _still_healthy(server) -> None:
    body = {
        "input_ids": [5, 6, 7, 8],
        "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
    }
    response = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert response.status_code == 200 and len(response.json()["output_ids"]) == 3


@pytest.mark.parametrize("path,body,param", BAD_BODIES)
def test_bad_fields_are_400_with_the_field_named(server, path, body, param):
    _check_error(httpx.post(f"{server.url}{path}", json=body, timeout=30), 400, param)


def test_malformed_json_wrong_model_and_unknown_route(server):
    for raw in (b"{not json", b"", b"[1, 2]", b"\xff\xfe", b'"text"'):
        response = httpx.post(f"{server.url}{COMPLETIONS}", content=raw, headers=JSON, timeout=30)
        _check_error(response, 400)
    wrong = httpx.post(f"{server.url}{CHAT}", json={"model": "gpt-9", "messages": USER}, timeout=30)
    _check_error(wrong, 404, "model")
    assert wrong.json()["error"]["code"] == "model_not_found"
    _check_error(httpx.get(f"{server.url}/v1/nothing", timeout=30), 404)
    _check_error(httpx.get(f"{server.url}{COMPLETIONS}", timeout=30), 405)
    _still_healthy(server)


def _invalid(valid_values: st.SearchStrategy | None = None) -> st.SearchStrategy:
    junk = st.one_of(
        st.text(max_size=5),
        st.lists(st.integers(), max_size=3),
        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    )
    return junk if valid_values is None else st.one_of(junk, valid_values)


BAD_FIELDS = {
    "max_tokens": _invalid(
        st.one_of(
            st.integers(max_value=0),
            st.integers(min_value=10**4),
            st.floats(allow_nan=True),
            st.booleans(),
        )
    ),
    "temperature": _invalid(st.floats(max_value=-1e-6) | st.just(float("nan"))),
    "top_p": _invalid(st.floats(min_value=1.0001) | st.floats(max_value=0.0)),
    "prompt": st.one_of(
        st.just(""),
        st.just([]),
        st.lists(st.integers(min_value=VOCAB_PROBE), min_size=1, max_size=3),
        st.lists(st.floats(), min_size=1, max_size=3),
        st.dictionaries(st.text(max_size=3), st.text(max_size=3)),
        st.booleans(),
    ),
    "stop": st.one_of(st.integers(), st.lists(st.integers(), min_size=1), st.just([""])),
    "model": st.text(min_size=1, max_size=8).filter(lambda s: s != SERVED_NAME),
    "logprobs": st.one_of(st.integers(min_value=6), st.integers(max_value=-1), st.text()),
}


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    fields=st.fixed_dictionaries({}, optional=BAD_FIELDS).filter(bool),
    extra=st.dictionaries(
        st.sampled_from(["echo", "stream", "n", "seed"]),
        st.one_of(st.text(max_size=3), st.lists(st.none(), max_size=2)),
        max_size=2,
    ),
)
def test_randomised_malformed_bodies_are_always_4xx(live_server, fields, extra):
    body = {"prompt": "hello", "max_tokens": 2, **extra, **fields}
    raw = json.dumps(body, allow_nan=True)
    response = httpx.post(f"{live_server.url}{COMPLETIONS}", content=raw, headers=JSON, timeout=30)
    _check_error(response)


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=st.binary(max_size=40) | st.text(max_size=40).map(str.encode))
def test_randomised_non_json_bodies_are_always_4xx(live_server, raw):
    for path in ("/generate", CHAT):
        try:
            body = json.loads(raw)
            if isinstance(body, dict):
                continue  # a real JSON object is the other test's business
        except ValueError:
            pass
        response = httpx.post(f"{live_server.url}{path}", content=raw, headers=JSON, timeout=30)
        _check_error(response, 400)


def test_server_answers_after_the_battery(server):
    _still_healthy(server)


def test_disconnect_mid_stream_aborts_and_frees(server):
    ids = random_ids(np.random.default_rng(30), 90, server.tokenizer.get_vocab_size())
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True},
    }
    aborts_before = server.info()["finished_requests"].get("abort", 0)
    received = []
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60) as response:
        for line in response.iter_lines():
            received += [line] if line else []
            if len(received) == 3:
                break  # three chunks arrived: hang up
    assert all(len(json.loads(r[6:])["output_ids"]) < 400 for r in received)
    info = wait_idle(server, timeout=30)
    assert info["finished_requests"].get("abort", 0) == aborts_before + 1
    assert info["free_state_slots"] + info["cached_state_slots"] == info["state_slots"]
    assert info["free_kv_tokens"] + info["cached_kv_tokens"] == info["kv_tokens"]
    assert httpx.post(f"{server.url}/flush_cache", timeout=30).status_code == 200
    assert_all_free(server.info())


def test_disconnect_while_waiting_for_a_whole_response_aborts(server):
    ids = random_ids(np.random.default_rng(32), 10, server.tokenizer.get_vocab_size())
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 495, "ignore_eos": True}}
    aborts_before = server.info()["finished_requests"].get("abort", 0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/generate", json=body, timeout=httpx.Timeout(30, read=0.15))
    info = wait_idle(server, timeout=30)
    assert info["finished_requests"].get("abort", 0) == aborts_before + 1
    assert info["free_state_slots"] + info["cached_state_slots"] == info["state_slots"]


def test_engine_failure_answers_500_and_serving_goes_on(server):
    def arm(engine) -> None:  # runs in the engine thread: the next step raises once
        def failing() -> None:
            del engine.step
            raise RuntimeError("injected device failure")

        engine.step = failing

    server.worker.call(arm).result(30)
    body = {"input_ids": [9, 10, 11], "sampling_params": {"max_new_tokens": 4}}
    response = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert response.status_code == 500
    assert "injected device failure" in response.json()["error"]["message"]
    _still_healthy(server)
    info = wait_idle(server)
    assert info["free_state_slots"] + info["cached_state_slots"] == info["state_slots"]


def test_full_queue_answers_503_then_recovers(server):
    """A second front end on the same engine with max_queued_requests=0: once the running
    batch is full, the next request is refused with 503."""
    from lazyspec.server.app import ServerSettings, create_app

    app = create_app(server.worker, ServerSettings(SERVED_NAME, max_queued_requests=0))
    http, thread, url = start_http(app)
    try:
        asyncio.run(
            _fill_then_overflow(url, server.worker.max_running, server.tokenizer.get_vocab_size())
        )
    finally:
        http.should_exit = True
        thread.join(30)
    wait_idle(server)
    _still_healthy(server)


def test_a_request_larger_than_the_whole_queue_is_400_not_503(server):
    """Retrying can never help a request whose prompts alone exceed running + queued."""
    from lazyspec.server.app import ServerSettings, create_app

    app = create_app(server.worker, ServerSettings(SERVED_NAME, max_queued_requests=0))
    http, thread, url = start_http(app)
    try:
        prompts = [[5, 6, 7]] * (server.worker.max_running + 1)
        body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 2}}
        response = httpx.post(f"{url}/generate", json=body, timeout=30)
        _check_error(response, 400)
        assert response.json()["error"]["code"] == "too_many_prompts"
        fits = {"input_ids": prompts[1:], "sampling_params": {"max_new_tokens": 2}}
        assert httpx.post(f"{url}/generate", json=fits, timeout=60).status_code == 200
    finally:
        http.should_exit = True
        thread.join(30)
    wait_idle(server)


async def _fill_then_overflow(url: str, max_running: int, vocab: int) -> None:
    rng = np.random.default_rng(31)

    def body(stream: bool) -> dict:
        return {
            "input_ids": random_ids(rng, 10, vocab),
            "stream": stream,
            "sampling_params": {"max_new_tokens": 480, "ignore_eos": True},
        }

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        streams = [client.stream("POST", "/generate", json=body(True)) for _ in range(max_running)]
        opened = [await s.__aenter__() for s in streams]
        lines = [response.aiter_lines() for response in opened]  # keep them referenced
        for response, line_iter in zip(opened, lines):  # every one is live: a chunk arrived
            assert response.status_code == 200
            assert (await line_iter.__anext__()).startswith("data: ")
        refused = await client.post("/generate", json=body(False))
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "queue_full"
        for s in streams:
            await s.__aexit__(None, None, None)
