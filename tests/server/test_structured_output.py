"""Structured output over HTTP: response_format on /v1, json_schema / regex / ebnf on /generate.

The served model has random weights: only the grammar makes its output parse. The grammar
tests run on both backends: the session's server (llguidance, the default) and one served
with --grammar-backend xgrammar for this module.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from tests.server.conftest import (
    SERVED_NAME,
    post,
    serve_folder,
    stop_server,
    v1_body,
    wait_idle,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "n"],
    "additionalProperties": False,
}
REGEX = r"(café|naïve) [0-9]{2}"


@pytest.fixture(scope="module", params=("llguidance", "xgrammar"))
def backend_server(request, live_server):
    """The server of one grammar backend: the session's for its own, else one for here."""
    if request.param == live_server.worker.engine.config.grammar_backend:
        yield live_server
        return
    live = serve_folder(live_server.model_dir, grammar_backend=request.param)
    yield live
    stop_server(live)


@pytest.fixture()
def grammar_server(backend_server):
    """``backend_server`` with an empty prefix cache and no request left running."""
    wait_idle(backend_server)
    response = httpx.post(f"{backend_server.url}/flush_cache", timeout=30)
    assert response.status_code == 200, response.text
    return backend_server


def test_generate_json_schema_and_regex_outputs_parse(grammar_server):
    for text in (["the state of", "draft tokens are"], "a slot"):  # the same batch shapes
        plain = {"text": text, "sampling_params": {"max_new_tokens": 8}}
        assert post(grammar_server, "/generate", plain).status_code == 200
    compiled = grammar_server.info()["num_compiled_programs"]
    body = {
        "text": ["the state of", "draft tokens are"],
        "sampling_params": {"max_new_tokens": 40, "json_schema": json.dumps(SCHEMA)},
    }
    response = post(grammar_server, "/generate", body)
    assert response.status_code == 200, response.text
    for out in response.json():
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), SCHEMA)
    body = {"text": "a slot", "sampling_params": {"max_new_tokens": 24, "regex": REGEX}}
    response = post(grammar_server, "/generate", body)
    assert response.status_code == 200, response.text
    assert re.fullmatch(REGEX, response.json()["text"]), response.json()
    assert grammar_server.info()["num_compiled_programs"] == compiled  # the mask update is warm


def test_chat_response_format_json_schema(grammar_server):
    path = "/v1/chat/completions"
    body = v1_body(path, "give me a checkpoint", max_tokens=40, temperature=0.8, seed=7)
    schema_format = {"name": "c", "schema": SCHEMA}
    body["response_format"] = {"type": "json_schema", "json_schema": schema_format}
    response = post(grammar_server, path, body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_completion_response_format_json_object(grammar_server):
    body = {
        "model": SERVED_NAME,
        "prompt": "while attention keeps pages",
        "max_tokens": 64,
        "temperature": 0,
        "response_format": {"type": "json_object"},
    }
    response = post(grammar_server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert isinstance(json.loads(choice["text"]), dict)
    # cut by max_tokens: "length", and the text is only the start of an object
    response = post(grammar_server, "/v1/completions", {**body, "max_tokens": 1})
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"] == "{", choice
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice["text"])


@pytest.mark.parametrize(
    "path,body,words",
    [
        ("/generate", {"sampling_params": {"json_schema": '{"type": "objekt"}'}}, "objekt"),
        ("/generate", {"sampling_params": {"json_schema": '{"type": '}}, "invalid json_schema"),
        ("/generate", {"sampling_params": {"regex": "a(b"}}, "invalid regex"),
        ("/generate", {"sampling_params": {"ebnf": 'root ::= "a" b'}}, "invalid ebnf"),
        ("/generate", {"sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "at most one"),
        (
            "/v1/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "schema",
        ),
        ("/v1/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ],
)
def test_malformed_grammars_are_400(grammar_server, path, body, words):
    if path == "/generate":
        body = {"text": "the state", **body}
    else:
        body = {"model": SERVED_NAME, "prompt": "the state", "max_tokens": 4, **body}
    response = post(grammar_server, path, body)
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"], response.json()
    # the engine thread is alive: a plain request still runs
    ok = post(
        grammar_server, "/generate", {"text": "the", "sampling_params": {"max_new_tokens": 2}}
    )
    assert ok.status_code == 200, ok.text


def _stream_text(server, path: str, body: dict) -> tuple[str, str | None]:
    """The streamed text and last finish_reason of a /v1 stream."""
    text, finish = [], None
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[len("data: ") :])["choices"][0]
            text.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
            finish = choice["finish_reason"] or finish
    return "".join(text), finish


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_sglang_grammar_fields_constrain_v1_outputs(grammar_server, path, stream):
    """SGLang's extra_body regex, ebnf and json_schema (a string) on both /v1 endpoints."""
    head = v1_body(path, "a slot", max_tokens=40, temperature=0.9, seed=3)
    cases = [
        ({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
        ({"ebnf": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
        ({"json_schema": json.dumps(SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    ]
    for fields, check in cases:
        body = {**head, **fields, "stream": stream}
        if stream:
            text, finish = _stream_text(grammar_server, path, body)
        else:
            response = post(grammar_server, path, body)
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            text = choice.get("text", choice.get("message", {}).get("content"))
            finish = choice["finish_reason"]
        assert finish == "stop", (fields, text)
        assert check(text) is not False, (fields, text)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_unknown_and_unsupported_fields_are_400_by_name(server, path):
    if path == "/generate":
        base = {"text": "the state", "sampling_params": {"max_new_tokens": 2}}
    else:
        base = v1_body(path, "the state" if path == "/v1/completions" else "hi", max_tokens=2)
    response = post(server, path, {**base, "regexp": "a+"})  # a typo of SGLang's regex
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("regexp", "unknown_field"), error
    assert "'regexp'" in error["message"]
    response = post(server, path, {**base, "lora_path": "adapter"})
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("lora_path", "unsupported_field"), error
    # metadata and defaults of what is not supported pass
    ok = post(server, path, {**base, "user": "u1", "lora_path": None, "session_id": None})
    assert ok.status_code == 200, ok.text
    both = {**base, "regex": "a+", "response_format": {"type": "json_object"}}
    if path != "/generate":
        assert post(server, path, both).json()["error"]["param"] == "regex"


def test_no_stop_trim_and_skip_special_tokens(server):
    """SGLang's text options: the matched stop string kept; special tokens shown."""
    body = {"model": SERVED_NAME, "prompt": "the state of", "max_tokens": 24, "temperature": 0}
    body["ignore_eos"] = True
    whole = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    assert len(whole) > 6, whole
    stop = whole[3:6]
    trimmed = post(server, "/v1/completions", {**body, "stop": stop}).json()["choices"][0]
    kept = post(server, "/v1/completions", {**body, "stop": stop, "no_stop_trim": True})
    kept = kept.json()["choices"][0]
    cut = whole.index(stop)
    assert trimmed["text"] == whole[:cut] and kept["text"] == whole[: cut + len(stop)], kept
    eos = "<|endoftext|>"
    forced = {**body, "logit_bias": {"2": 100}, "max_tokens": 2}  # id 2 is <|endoftext|>
    hidden = post(server, "/v1/completions", forced).json()["choices"][0]["text"]
    shown = post(server, "/v1/completions", {**forced, "skip_special_tokens": False}).json()
    assert eos not in hidden and shown["choices"][0]["text"] == eos * 2, (hidden, shown)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_min_p_and_stop_regex_on_v1_and_in_streams(server, path):
    """SGLang's min_p and stop_regex through extra_body: min_p = 1 keeps only the most
    likely token, so a hot seeded sample is the greedy text; a stop_regex cuts the text
    where its first match starts (streamed or not), or keeps the match with no_stop_trim."""
    head = v1_body(path, "the state of", max_tokens=24, ignore_eos=True)

    def text_of(body: dict) -> tuple[str, str | None]:
        if body.get("stream"):
            return _stream_text(server, path, body)
        response = post(server, path, body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice.get("text", choice.get("message", {}).get("content")), choice["finish_reason"]

    greedy, _ = text_of({**head, "temperature": 0})
    hot = {**head, "temperature": 1.5, "seed": 11}
    for stream in (False, True):
        assert text_of({**hot, "min_p": 1.0, "stream": stream})[0] == greedy, stream
    assert text_of(hot)[0] != greedy  # without min_p the hot sample is not greedy
    assert len(greedy) > 8, greedy
    pattern = re.escape(greedy[4]) + r"[\s\S]" + re.escape(greedy[6])  # a match at 4 or before
    found = re.search(pattern, greedy)
    for stream in (False, True):
        body = {**head, "temperature": 0, "stop_regex": [pattern], "stream": stream}
        assert text_of(body) == (greedy[: found.start()], "stop"), stream
        kept = text_of({**body, "no_stop_trim": True})
        assert kept == (greedy[: found.end()], "stop"), stream


def test_min_p_and_stop_regex_on_generate(server):
    params = {"max_new_tokens": 24, "ignore_eos": True, "temperature": 0}
    body = {"text": "draft tokens are", "sampling_params": params}
    greedy = post(server, "/generate", body).json()["text"]
    hot = {**params, "temperature": 1.5, "seed": 5, "min_p": 1}
    assert post(server, "/generate", {**body, "sampling_params": hot}).json()["text"] == greedy
    pattern = re.escape(greedy[3:5]) + "+"
    found = re.search(pattern, greedy)
    stop = {**params, "stop_regex": pattern}
    out = post(server, "/generate", {**body, "sampling_params": stop}).json()
    assert out["text"] == greedy[: found.start()], (out, greedy)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
