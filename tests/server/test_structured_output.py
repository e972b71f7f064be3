"""Structured output over HTTP: response_format on /v1, json_schema / regex / ebnf on /generate.

The served model has random weights: only the grammar makes its output parse.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from tests.server.conftest import SERVED_NAME

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


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def test_generate_json_schema_and_regex_outputs_parse(server):
    for text in (["the state of", "draft tokens are"], "a slot"):  # the same batch shapes
        plain = {"text": text, "sampling_params": {"max_new_tokens": 8}}
        assert _post(server, "/generate", plain).status_code == 200
    compiled = server.info()["num_compiled_programs"]
    body = {
        "text": ["the state of", "draft tokens are"],
        "sampling_params": {"max_new_tokens": 40, "json_schema": json.dumps(SCHEMA)},
    }
    response = _post(server, "/generate", body)
    assert response.status_code == 200, response.text
    for out in response.json():
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), SCHEMA)
    body = {"text": "a slot", "sampling_params": {"max_new_tokens": 24, "regex": REGEX}}
    response = _post(server, "/generate", body)
    assert response.status_code == 200, response.text
    assert re.fullmatch(REGEX, response.json()["text"]), response.json()
    assert server.info()["num_compiled_programs"] == compiled  # the mask update is warm


def test_chat_response_format_json_schema(server):
    body = {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": "give me a checkpoint"}],
        "max_tokens": 40,
        "temperature": 0.8,
        "seed": 7,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
    }
    response = _post(server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_completion_response_format_json_object(server):
    body = {
        "model": SERVED_NAME,
        "prompt": "while attention keeps pages",
        "max_tokens": 64,
        "temperature": 0,
        "response_format": {"type": "json_object"},
    }
    response = _post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert isinstance(json.loads(choice["text"]), dict)


@pytest.mark.parametrize(
    "path,body,words",
    [
        ("/generate", {"sampling_params": {"json_schema": '{"type": "objekt"}'}}, "objekt"),
        ("/generate", {"sampling_params": {"json_schema": '{"type": '}}, "invalid json_schema"),
        ("/generate", {"sampling_params": {"regex": "a(b"}}, "parenthesis"),
        ("/generate", {"sampling_params": {"ebnf": 'root ::= "a" |'}}, "invalid ebnf"),
        ("/generate", {"sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "at most one"),
        (
            "/v1/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "schema",
        ),
        ("/v1/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ],
)
def test_malformed_grammars_are_400(server, path, body, words):
    if path == "/generate":
        body = {"text": "the state", **body}
    else:
        body = {"model": SERVED_NAME, "prompt": "the state", "max_tokens": 4, **body}
    response = _post(server, path, body)
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"], response.json()
    # the engine thread is alive: a plain request still runs
    ok = _post(server, "/generate", {"text": "the", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200, ok.text
