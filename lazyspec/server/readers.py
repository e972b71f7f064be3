"""Readers of the fields of a request body: each takes the decoded JSON (or the raw bytes)
and returns one validated value, or raises ``ApiError`` naming the field. The endpoint
parsers (``protocol``) assemble them; ``sampling_params`` reads every sampling field into
one ``SamplingParams`` per prompt.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from lazyspec.scheduler.grammar import JSON_OBJECT_SCHEMA
from lazyspec.scheduler.request import (
    GRAMMAR_FIELDS,
    LOGIT_BIAS_RANGE,
    MAX_LOGIT_BIAS,
    MAX_MIN_TOKENS_STOP_IDS,
    MAX_TEMPERATURE,
    PENALTY_RANGE,
    REPETITION_PENALTY_MAX,
    SEED_RANGE,
    SamplingParams,
)
from lazyspec.server.limits import (
    MAX_JSON_DEPTH,
    MAX_STOP_STRINGS,
    REPETITION_PENALTY_MIN,
    RESPONSE_FORMATS,
    ApiError,
    Limits,
)
from lazyspec.server.stop_regex import stop_patterns


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in the JSON text ``raw``, from a linear
    scan that skips string contents. Exact for valid JSON; for malformed JSON never less
    than the depth ``json.loads`` reaches before it fails. Vectorised, so a 16 MB body
    costs milliseconds."""
    data = np.frombuffer(raw, np.uint8)
    quotes = np.flatnonzero(data == ord('"'))
    slashes = np.flatnonzero(data == ord("\\"))
    if quotes.size and slashes.size:  # a quote after an odd run of backslashes is escaped
        run_last = np.flatnonzero(np.diff(slashes, append=-2) != 1)
        run_len = np.diff(run_last, prepend=-1)
        run_end = slashes[run_last]
        at = np.minimum(np.searchsorted(run_end, quotes - 1), run_end.size - 1)
        quotes = quotes[~((run_end[at] == quotes - 1) & (run_len[at] % 2 == 1))]
    opens = (data == ord("[")) | (data == ord("{"))
    brackets = np.flatnonzero(opens | (data == ord("]")) | (data == ord("}")))
    brackets = brackets[np.searchsorted(quotes, brackets) % 2 == 0]  # outside strings
    return int(np.cumsum(np.where(opens[brackets], 1, -1)).max(initial=0))


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or ApiError (also when nested deeper than
    MAX_JSON_DEPTH, checked before parsing)."""
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise ApiError(f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(f"the body must be a JSON object, got {type(body).__name__}")
    try:  # JSON escapes can smuggle in unpaired surrogates, which no tokenizer accepts
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(
            "the body holds a string that is not valid Unicode (an unpaired surrogate)"
        ) from None
    return body


def int_field(
    body: dict, name: str, default: int | None, low: int | None = None, high: int | None = None
) -> int | None:
    """``body[name]`` as an integer in [low, high] (bounds inclusive; None = unbounded)."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(f"{name}={value!r} must be an integer", param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ApiError(f"{name}={value!r} must be in [{low}, {high}]", param=name)
    return value


def float_field(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(f"{name}={value!r} must be a finite number", param=name)
    return float(value)


def bool_field(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(f"{name}={value!r} must be true or false", param=name)
    return value


def stop_strings(body: dict, name: str = "stop") -> tuple[str, ...]:
    value = body.get(name)
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if (
        not isinstance(items, list)
        or len(items) > MAX_STOP_STRINGS
        or not all(isinstance(s, str) and s for s in items)
    ):
        raise ApiError(
            f"{name}={value!r} must be a non-empty string or a list of at most "
            f"{MAX_STOP_STRINGS} non-empty strings",
            param=name,
        )
    return tuple(items)


def check_model(body: dict, limits: Limits) -> None:
    model = body.get("model")
    if model is None:
        return
    if model not in limits.model_names:
        raise ApiError(
            f"the model {model!r} does not exist; served: {list(limits.model_names)}",
            status=404,
            param="model",
            code="model_not_found",
        )


def token_ids(value: list, limits: Limits, param: str) -> list[int]:
    if not value:
        raise ApiError("the prompt is empty", param=param)
    for token in value:
        if isinstance(token, bool) or not isinstance(token, int):
            raise ApiError(f"token id {token!r} is not an integer", param=param)
        if not 0 <= token < limits.vocab_size:
            raise ApiError(
                f"token id {token} is outside the vocabulary [0, {limits.vocab_size})", param=param
            )
    return list(value)


def check_text_len(num_chars: int, limits: Limits, param: str) -> None:
    if limits.max_prompt_chars is not None and num_chars > limits.max_prompt_chars:
        raise ApiError(
            f"the prompt text ({num_chars} characters) is longer than any prompt that fits "
            f"the context limit {limits.max_context} (max_prompt_chars={limits.max_prompt_chars})",
            param=param,
        )


def encode_prompt(
    text: str, tokenizer: Any, limits: Limits, param: str, special: bool = True
) -> list[int]:
    if tokenizer is None:
        raise ApiError("this model has no tokenizer.json: send token ids", param=param)
    check_text_len(len(text), limits, param)
    ids = tokenizer.encode(text, add_special_tokens=special).ids
    if not ids:
        raise ApiError("the prompt is empty", param=param)
    return list(ids)


def parse_prompts(
    value: Any, tokenizer: Any, limits: Limits, param: str, text: bool = True
) -> tuple[list[list[int]], list[str | None], bool]:
    """A text, a token-id list, or a list of either -> (id lists, texts, batched);
    ``text=False`` takes token ids only."""
    if not text and (
        isinstance(value, str) or isinstance(value, list) and any(isinstance(v, str) for v in value)
    ):
        raise ApiError(
            f"{param} must be a list of token ids or a list of such lists, not text", param=param
        )
    if isinstance(value, str):
        if not value:
            raise ApiError("the prompt is empty", param=param)
        return [encode_prompt(value, tokenizer, limits, param)], [value], False
    if not isinstance(value, list) or not value:
        raise ApiError(
            f"{param} must be a non-empty string, token-id list, or a list of them", param=param
        )
    if all(isinstance(v, str) for v in value):
        if not all(value):
            raise ApiError("the prompt is empty", param=param)
        return [encode_prompt(v, tokenizer, limits, param) for v in value], list(value), True
    if all(isinstance(v, list) for v in value):
        return [token_ids(v, limits, param) for v in value], [None] * len(value), True
    return [token_ids(value, limits, param)], [None], False


def _logit_bias(body: dict, limits: Limits) -> tuple[tuple[int, float], ...]:
    """``logit_bias``: {token id (an integer or its decimal string): bias in [-100, 100]}."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ApiError(f"logit_bias={value!r} must map token ids to numbers", param="logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise ApiError(
            f"logit_bias holds {len(value)} tokens; at most {MAX_LOGIT_BIAS} are supported",
            param="logit_bias",
        )
    low, high = LOGIT_BIAS_RANGE
    pairs = {}
    for key, bias in value.items():
        text = str(key)
        if not (text.isascii() and text.isdigit()) or not 0 <= int(text) < limits.vocab_size:
            raise ApiError(
                f"logit_bias key {key!r} is not a token id in [0, {limits.vocab_size})",
                param="logit_bias",
            )
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not low <= bias <= high:
            raise ApiError(
                f"logit_bias[{key!r}]={bias!r} must be a number in [{low}, {high}]",
                param="logit_bias",
            )
        if int(text) in pairs:
            raise ApiError(f"logit_bias names token {int(text)} twice", param="logit_bias")
        pairs[int(text)] = float(bias)
    return tuple(pairs.items())


def _penalties(body: dict) -> dict[str, float]:
    """frequency_penalty and presence_penalty in [-2, 2] (OpenAI's range), repetition_penalty
    in [REPETITION_PENALTY_MIN, 2] (SGLang's (0, 2] less the values float32 cannot apply)."""
    low, high = PENALTY_RANGE
    out = {}
    for name in ("frequency_penalty", "presence_penalty"):
        out[name] = float_field(body, name, 0.0)
        if not low <= out[name] <= high:
            raise ApiError(f"{name}={out[name]} must be in [{low}, {high}]", param=name)
    out["repetition_penalty"] = value = float_field(body, "repetition_penalty", 1.0)
    if not REPETITION_PENALTY_MIN <= value <= REPETITION_PENALTY_MAX:
        raise ApiError(
            f"repetition_penalty={value} must be in "
            f"[{REPETITION_PENALTY_MIN}, {REPETITION_PENALTY_MAX}] (1 = no penalty)",
            param="repetition_penalty",
        )
    return out


def _response_format(body: dict) -> dict[str, str]:
    """/v1 ``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}`` (any JSON
    object) or ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``, as
    the SamplingParams grammar field it sets."""
    value = body.get("response_format")
    if value is None:
        return {}
    if not isinstance(value, dict) or value.get("type") not in RESPONSE_FORMATS:
        raise ApiError(
            f"response_format={value!r} must be an object with type one of {RESPONSE_FORMATS}",
            param="response_format",
        )
    if value["type"] == "text":
        return {}
    if value["type"] == "json_object":
        return {"json_schema": JSON_OBJECT_SCHEMA}
    spec = value.get("json_schema")
    schema = spec.get("schema", spec.get("schema_")) if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise ApiError(
            f"response_format json_schema needs {{'name': ..., 'schema': {{...}}}}, got {spec!r}",
            param="response_format",
        )
    return {"json_schema": json.dumps(schema)}


def v1_grammar(body: dict) -> dict[str, str]:
    """/v1's grammar: ``response_format``, or SGLang's top-level ``json_schema`` (a string
    or an object), ``regex`` or ``ebnf``; at most one of them."""
    given = dict(_response_format(body))
    if isinstance(body.get("json_schema"), dict):
        body = {**body, "json_schema": json.dumps(body["json_schema"])}
    sglang = grammar_field(body)
    if given and sglang:
        raise ApiError(
            f"give at most one of response_format, json_schema, regex and ebnf (got "
            f"response_format and {sorted(sglang)[0]})",
            param=sorted(sglang)[0],
        )
    return given or sglang


def text_options(body: dict) -> dict[str, Any]:
    """SGLang's ``no_stop_trim``, ``skip_special_tokens`` and ``stop_regex`` as
    GenerationSpec fields."""
    return {
        "no_stop_trim": bool_field(body, "no_stop_trim", False),
        "skip_special_tokens": bool_field(body, "skip_special_tokens", True),
        "stop_regex": stop_regexes(body),
    }


def stop_regexes(body: dict) -> tuple[str, ...]:
    try:
        return stop_patterns(body.get("stop_regex"), MAX_STOP_STRINGS)
    except ValueError as exc:
        raise ApiError(f"stop_regex: {exc}", param="stop_regex") from None


def grammar_field(params: dict) -> dict[str, str]:
    """/generate's ``json_schema``, ``regex`` or ``ebnf`` (strings; at most one)."""
    given = {name: params[name] for name in GRAMMAR_FIELDS if params.get(name) is not None}
    if len(given) > 1:
        raise ApiError(
            f"give at most one of json_schema, regex and ebnf (got {sorted(given)})",
            param=sorted(given)[1],
        )
    for name, value in given.items():
        if not isinstance(value, str):
            raise ApiError(f"{name}={value!r} must be a string", param=name)
    return given


def sampling_params(
    body: dict,
    max_new: int | None,
    prompts: list[list[int]],
    limits: Limits,
    max_param: str,
    min_param: str,
    grammar: dict[str, str] | None = None,
) -> list[SamplingParams]:
    """One SamplingParams per prompt; ``max_new`` None = fill the rest of the context;
    ``grammar``: the one grammar field to constrain the output with, if any."""
    temperature = float_field(body, "temperature", 1.0)
    top_p = float_field(body, "top_p", 1.0)
    min_p = float_field(body, "min_p", 0.0)
    if not 0 <= min_p <= 1:
        raise ApiError(f"min_p={min_p} must be in [0, 1]", param="min_p")
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise ApiError(
            f"temperature={temperature} must be in [0, {MAX_TEMPERATURE}]", param="temperature"
        )
    if not 0 < top_p <= 1:
        raise ApiError(f"top_p={top_p} must be in (0, 1]", param="top_p")
    top_k = int_field(body, "top_k", -1)
    if top_k != -1 and not 1 <= top_k <= limits.vocab_size:
        raise ApiError(
            f"top_k={top_k} must be -1 (off) or in [1, {limits.vocab_size}] (the vocabulary)",
            param="top_k",
        )
    seed = int_field(body, "seed", None, *SEED_RANGE)
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list):
        raise ApiError(
            f"stop_token_ids={stop_ids!r} must be a list of token ids", param="stop_token_ids"
        )
    stop_ids = token_ids(stop_ids, limits, "stop_token_ids") if stop_ids else []
    min_new = int_field(body, min_param, 0, 0, limits.max_context)
    if min_new > 0 and len(stop_ids) > MAX_MIN_TOKENS_STOP_IDS:
        raise ApiError(
            f"{min_param} > 0 takes at most {MAX_MIN_TOKENS_STOP_IDS} stop_token_ids",
            param="stop_token_ids",
        )
    logit_bias = _logit_bias(body, limits)
    penalties = _penalties(body)
    out = []
    for ids in prompts:
        room = limits.max_context - len(ids)
        wanted = room if max_new is None else max_new
        if wanted > room:
            raise ApiError(
                f"prompt ({len(ids)} tokens) + {max_param} ({wanted}) exceeds the "
                f"context limit {limits.max_context}",
                param=max_param,
            )
        if min_new > wanted:
            raise ApiError(
                f"{min_param}={min_new} must be <= {max_param} ({wanted})", param=min_param
            )
        out.append(
            SamplingParams(
                max_new_tokens=wanted,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                min_p=min_p,
                ignore_eos=bool_field(body, "ignore_eos", False),
                stop_token_ids=tuple(stop_ids),
                seed=seed,
                min_new_tokens=min_new,
                logit_bias=logit_bias,
                **penalties,
                **(grammar or {}),
            )
        )
    return out


def include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise ApiError(f"stream_options={options!r} must be an object", param="stream_options")
    return bool_field(options, "include_usage", False)
