"""Fuzzing from the server's own OpenAPI document: for every JSON endpoint, bodies drawn
from its request schema (valid ones, then each with one field replaced by junk) are never
answered 5xx, and afterwards the server still answers a greedy request exactly as before.
Every body-less endpoint is called too. Generation lengths are capped in the schema the
fuzzer reads so that a run stays short."""

from __future__ import annotations

import copy
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import SERVED_NAME
from tests.server.schema_bodies import bodies

# generation lengths, and n (choices per prompt), capped so that a run stays short
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_new_tokens", "n")
LENGTH_CAP = 3
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),  # JSON has neither (see below)
    st.text(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def _openapi(server) -> dict:
    from lazyspec.server.app import ServerSettings, create_app

    return create_app(server.worker, ServerSettings(SERVED_NAME)).openapi()


def _cap_lengths(schema: dict) -> dict:
    """A copy of ``schema`` whose generation-length fields are at most LENGTH_CAP."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            for name, sub in node.get("properties", {}).items():
                if name in LENGTH_FIELDS and isinstance(sub, dict):
                    sub["maximum"] = min(sub.get("maximum", LENGTH_CAP), LENGTH_CAP)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def _json_endpoints(document: dict) -> list[tuple[str, dict]]:
    out = []
    for path, methods in document["paths"].items():
        body = methods.get("post", {}).get("requestBody", {})
        schema = body.get("content", {}).get("application/json", {}).get("schema")
        if schema is not None:
            out.append((path, schema))
    return out


def _greedy(server) -> list[int]:
    body = {
        "input_ids": [11, 12, 13, 14],
        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
    }
    response = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["output_ids"]


def test_every_generation_endpoint_declares_its_body(server):
    paths = {path for path, _ in _json_endpoints(_openapi(server))}
    assert {"/v1/completions", "/v1/chat/completions", "/generate"} <= paths


@pytest.fixture(scope="module")
def fuzz_cases(live_server) -> list[tuple[str, dict]]:
    return [(path, _cap_lengths(schema)) for path, schema in _json_endpoints(_openapi(live_server))]


def _bodies(cases: list[tuple[str, dict]]) -> st.SearchStrategy:
    valid = st.one_of([st.tuples(st.just(path), bodies(schema)) for path, schema in cases])

    def spoil(case: tuple[str, dict], data) -> tuple[str, dict]:
        path, body = case
        if isinstance(body, dict) and body:
            key = data.draw(st.sampled_from(sorted(body)))
            if key not in LENGTH_FIELDS:
                body = {**body, key: data.draw(JUNK)}
        return path, body

    spoiled = st.builds(spoil, valid, st.data())
    return st.one_of(valid, spoiled)


def test_schema_fuzzing_never_gets_a_5xx(server, fuzz_cases):
    before = _greedy(server)
    seen = []

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=_bodies(fuzz_cases))
    def run(case):
        path, body = case
        response = httpx.post(f"{server.url}{path}", json=body, timeout=120)
        seen.append(response.status_code)
        assert response.status_code < 500, (path, body, response.status_code, response.text)

    run()
    assert any(code == 200 for code in seen), "no fuzzed body was ever accepted"
    assert any(400 <= code < 500 for code in seen), "no fuzzed body was ever refused"
    for path, methods in _openapi(server)["paths"].items():
        if "get" in methods:
            response = httpx.get(f"{server.url}{path}", timeout=60)
            assert response.status_code < 500, (path, response.text)
    assert _greedy(server) == before


NON_FINITE = ("Infinity", "-Infinity", "NaN")  # JSON tokens Python's parser accepts
NUMBER_FIELDS = {
    "/v1/completions": ("temperature", "top_p", "presence_penalty", "frequency_penalty"),
    "/generate": ("temperature", "top_p", "top_k", "repetition_penalty"),
}


@pytest.mark.parametrize("token", NON_FINITE)
def test_non_finite_numbers_are_refused_not_a_5xx(server, token):
    """``Infinity``, ``-Infinity`` and ``NaN``, which Python's JSON parser reads as floats,
    in a sampling field or as the prompt, are refused with a 4xx; the server then answers a
    greedy request exactly as before."""
    before = _greedy(server)
    mark = "NON_FINITE_HERE"  # replaced by the bare token in the encoded body

    def body(**fields) -> str:
        return json.dumps(fields).replace(f'"{mark}"', token)

    cases = [("/v1/completions", body(model=SERVED_NAME, prompt=mark))]
    for field in NUMBER_FIELDS["/v1/completions"]:
        fields = {"model": SERVED_NAME, "prompt": "the", "max_tokens": 2, field: mark}
        cases.append(("/v1/completions", body(**fields)))
    for field in NUMBER_FIELDS["/generate"]:
        params = {"max_new_tokens": 2, field: mark}
        cases.append(("/generate", body(text="the", sampling_params=params)))
    headers = {"content-type": "application/json"}
    for path, text in cases:
        assert token in text and mark not in text
        response = httpx.post(f"{server.url}{path}", content=text, headers=headers, timeout=60)
        assert 400 <= response.status_code < 500, (path, text, response.status_code, response.text)
    assert _greedy(server) == before
