"""JSON schemas of the request bodies, for the OpenAPI document (``app.openapi()``).

Each field has the type and range its parser in ``protocol`` accepts; ``null`` is accepted
wherever the parser treats it as "not given". Fields the parsers do not read are allowed and
ignored (except in ``sampling_params``, where an unknown name is an error). Two rules span
fields and are left to the server: prompt tokens + new tokens <= ``max_context`` (and
/generate's ``logprob_start_len`` < the prompt's length); /v1/completions' ``best_of`` must
equal ``n``.
"""

from __future__ import annotations

from typing import Any

from lazyspec.scheduler.request import (
    LOGIT_BIAS_RANGE,
    MAX_LOGIT_BIAS,
    MAX_TEMPERATURE,
    PENALTY_RANGE,
    REPETITION_PENALTY_MAX,
    SEED_RANGE,
)
from lazyspec.server.limits import (
    MAX_CHOICES,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    REPETITION_PENALTY_MIN,
    ROLES,
    Limits,
)
from lazyspec.server.stop_regex import MAX_PATTERN_CHARS

Schema = dict[str, Any]


def _nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


def _integer(low: int | None = None, high: int | None = None) -> Schema:
    bounds = {"minimum": low, "maximum": high}
    return _nullable({"type": "integer", **{k: v for k, v in bounds.items() if v is not None}})


def _boolean() -> Schema:
    return {"type": ["boolean", "null"]}


def _token_ids(limits: Limits) -> Schema:
    token = {"type": "integer", "minimum": 0, "maximum": limits.vocab_size - 1}
    return {"type": "array", "items": token, "minItems": 1, "maxItems": limits.max_context}


def _text(limits: Limits) -> Schema:
    schema: Schema = {"type": "string", "minLength": 1}
    if limits.max_prompt_chars is not None:
        schema["maxLength"] = limits.max_prompt_chars
    return schema


def _prompt(limits: Limits) -> Schema:
    """A text, a token-id list, or a non-empty list of either (a batch)."""
    return {
        "anyOf": [
            _text(limits),
            _token_ids(limits),
            {"type": "array", "items": _text(limits), "minItems": 1},
            {"type": "array", "items": _token_ids(limits), "minItems": 1},
        ]
    }


def _sampling(limits: Limits) -> dict[str, Schema]:
    stop_string = {"type": "string", "minLength": 1}
    # a Python regular expression that cannot match the empty text
    stop_pattern = {"type": "string", "minLength": 1, "maxLength": MAX_PATTERN_CHARS}
    stop_ids = {"type": "array", "items": _token_ids(limits)["items"]}
    top_k = {"type": "integer", "minimum": 1, "maximum": limits.vocab_size}
    low, high = PENALTY_RANGE
    return {
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": MAX_TEMPERATURE}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _nullable({"anyOf": [{"const": -1}, top_k]}),
        "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
        "seed": _integer(*SEED_RANGE),
        "ignore_eos": _boolean(),
        "stop_token_ids": _nullable(stop_ids),
        "stop": _nullable(
            {
                "anyOf": [
                    stop_string,
                    {"type": "array", "items": stop_string, "maxItems": MAX_STOP_STRINGS},
                ]
            }
        ),
        "stop_regex": _nullable(
            {
                "anyOf": [
                    stop_pattern,
                    {"type": "array", "items": stop_pattern, "maxItems": MAX_STOP_STRINGS},
                ]
            }
        ),
        "n": _integer(1, MAX_CHOICES),
        "frequency_penalty": _nullable({"type": "number", "minimum": low, "maximum": high}),
        "presence_penalty": _nullable({"type": "number", "minimum": low, "maximum": high}),
        "repetition_penalty": _nullable(
            {
                "type": "number",
                "minimum": REPETITION_PENALTY_MIN,
                "maximum": REPETITION_PENALTY_MAX,
            }
        ),
        "logit_bias": _nullable(
            {
                "type": "object",
                "maxProperties": MAX_LOGIT_BIAS,
                "propertyNames": {"pattern": "^[0-9]+$"},
                "additionalProperties": {
                    "type": "number",
                    "minimum": LOGIT_BIAS_RANGE[0],
                    "maximum": LOGIT_BIAS_RANGE[1],
                },
            }
        ),
    }


def _openai_common(limits: Limits) -> dict[str, Schema]:
    return {
        "model": _nullable({"enum": list(limits.model_names)}),
        **_sampling(limits),
        "min_tokens": _integer(0, limits.max_context),
        "stream": _boolean(),
        "stream_options": _nullable(
            {"type": "object", "properties": {"include_usage": _boolean()}}
        ),
    }


def completion_body(limits: Limits) -> Schema:
    """POST /v1/completions."""
    properties = {
        **_openai_common(limits),
        "prompt": _prompt(limits),
        "max_tokens": _integer(1, limits.max_context),
        "logprobs": _integer(0, MAX_LOGPROBS),
        "echo": _boolean(),
        "best_of": _integer(1, MAX_CHOICES),  # the server refuses any value but n
    }
    return {"type": "object", "properties": properties, "required": ["prompt"]}


def chat_body(limits: Limits) -> Schema:
    """POST /v1/chat/completions; top_logprobs needs logprobs=true."""
    part = {
        "type": "object",
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
        "required": ["type", "text"],
    }
    content = {"anyOf": [{"type": ["string", "null"]}, {"type": "array", "items": part}]}
    message = {
        "type": "object",
        "properties": {"role": {"enum": list(ROLES)}, "content": content},
        "required": ["role"],
    }
    properties = {
        **_openai_common(limits),
        "messages": {"type": "array", "items": message, "minItems": 1},
        "max_tokens": _integer(1, limits.max_context),
        "max_completion_tokens": _integer(1, limits.max_context),
        "logprobs": _boolean(),
        "top_logprobs": _integer(0, MAX_LOGPROBS),
    }
    return {
        "type": "object",
        "properties": properties,
        "required": ["messages"],
        "if": {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
        "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
    }


def generate_body(limits: Limits) -> Schema:
    """POST /generate (SGLang): exactly one of text and input_ids."""
    texts = {"anyOf": [_text(limits), {"type": "array", "items": _text(limits), "minItems": 1}]}
    ids = {
        "anyOf": [
            _token_ids(limits),
            {"type": "array", "items": _token_ids(limits), "minItems": 1},
        ]
    }
    sampling = {
        **_sampling(limits),
        "max_new_tokens": _integer(0, limits.max_context),
        "min_new_tokens": _integer(0, limits.max_context),
        "skip_special_tokens": {},
        "no_stop_trim": {},
    }
    properties = {
        "sampling_params": _nullable(
            {"type": "object", "properties": sampling, "additionalProperties": False}
        ),
        "stream": _boolean(),
        "return_logprob": _boolean(),
        "top_logprobs_num": _integer(0, MAX_LOGPROBS),
        "logprob_start_len": _integer(-1, limits.max_context),
    }
    absent = {"type": "null"}
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {**properties, "text": texts, "input_ids": absent},
                "required": ["text"],
            },
            {
                "type": "object",
                "properties": {**properties, "input_ids": ids, "text": absent},
                "required": ["input_ids"],
            },
        ]
    }


def request_body(schema: Schema) -> dict[str, Any]:
    """``openapi_extra`` for an endpoint whose JSON body is ``schema``."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
