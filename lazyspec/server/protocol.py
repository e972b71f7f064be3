"""Request parsing for the OpenAI (/v1/completions, /v1/chat/completions) and SGLang
(/generate) endpoints, and the text side of outputs.

Every parser takes the decoded JSON body and returns a ``GenerationSpec`` (token-id prompts +
validated sampling), or raises ``ApiError`` naming the offending field. Nothing here touches
the engine. ``TextStream`` turns a growing list of token ids into text deltas that never
split a UTF-8 character and never show any part of a stop string.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
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
    TOP_LOGPROBS,
    SamplingParams,
)
from lazyspec.server.stop_regex import StopPatterns, stop_patterns

MAX_STOP_STRINGS = 16
MAX_CHOICES = 128  # n: samples per prompt
MAX_LOGPROBS = TOP_LOGPROBS  # alternatives per position the engine computes
ROLES = ("system", "developer", "user", "assistant", "tool")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
MAX_JSON_DEPTH = 64  # nested arrays/objects in a body; json.loads recurses once per level
# The smallest repetition_penalty taken. SGLang and vLLM take any value above 0, but the
# penalty divides a repeated token's positive logit in float32: 1e-300 rounds to 0, the
# logits to inf and the sample to garbage (one token, no text). 0.01 already multiplies
# those logits by 100, so nothing a smaller value could mean is lost.
REPETITION_PENALTY_MIN = 0.01


class ApiError(Exception):
    """An error answered to the client as ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        error_type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
        self.code, self.error_type = code, error_type

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_context: int  # prompt + max new tokens, at most
    model_names: tuple[str, ...]
    max_prompt_chars: int | None = None  # longer prompt text is refused untokenized
    # engine requests one body may start (prompts x n): running + queued places; None: any
    max_requests: int | None = None
    # prompt text of one body, all its prompts together, worth tokenizing; None: any
    max_body_prompt_chars: int | None = None


MIN_CHARS_PER_TOKEN = 64


def chars_per_token(tokenizer: Any) -> int | None:
    """An upper bound on the characters one token covers: the longest vocabulary entry (its
    stored form, which is never shorter than the text it covers), at least
    MIN_CHARS_PER_TOKEN, a margin for normalizers that shorten text. None without one."""
    if tokenizer is None:
        return None
    longest = max((len(token) for token in tokenizer.get_vocab()), default=0)
    return max(MIN_CHARS_PER_TOKEN, longest)


def max_prompt_chars(tokenizer: Any, max_context: int) -> int | None:
    """The longest prompt text worth tokenizing: ``max_context`` tokens of
    ``chars_per_token`` each. Longer text cannot fit the context. None without a
    tokenizer."""
    bound = chars_per_token(tokenizer)
    return None if bound is None else max_context * bound


def max_body_prompt_chars(tokenizer: Any, max_context: int, kv_tokens: int) -> int | None:
    """The most prompt text one body may have tokenized: the whole KV pool's tokens (at
    least one context) of ``chars_per_token`` each. A body over it holds more prompt text
    than the pool could take at once, so its tokenization would only hold the parse threads
    for seconds; None without a tokenizer."""
    bound = chars_per_token(tokenizer)
    return None if bound is None else max(max_context, kv_tokens) * bound


@dataclass(frozen=True)
class GenerationSpec:
    """What every generation endpoint boils down to: one engine request per choice, ``n``
    per prompt, prompt-major (choice i samples prompt i // n; ``prompts``, ``prompt_texts``
    and ``sampling`` hold one entry per choice)."""

    prompts: list[list[int]]
    prompt_texts: list[str | None]
    sampling: list[SamplingParams]
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool = False
    logprobs: int | None = None  # None: off; else how many alternatives were asked for
    echo: bool = False
    batched: bool = False
    n: int = 1  # choices per prompt: copy j > 0 waits for copy 0's prefill (prefix cache)
    logprob_start_len: int | None = None  # prompt logprobs from this token on (None: none)
    no_stop_trim: bool = False  # SGLang's: a matched stop string stays in the text
    skip_special_tokens: bool = True  # SGLang's: special tokens are left out of the text
    stop_regex: tuple[str, ...] = ()  # SGLang's: the output stops where one of these matches


def _num_choices(body: dict, best_of: bool) -> int:
    """``n`` in [1, MAX_CHOICES]; ``best_of`` (where the endpoint has it) may only equal n."""
    n = _integer(body, "n", 1, 1, MAX_CHOICES)
    if best_of:
        value = _integer(body, "best_of", None)
        if value is not None and value != n:
            raise ApiError(
                f"best_of={value} is not supported: only best_of = n ({n}) is (no server-side "
                "ranking of extra samples)",
                param="best_of",
            )
    return n


def copy_seed(seed: int | None, copy: int) -> int | None:
    """The seed of copy ``copy`` of a request seeded with ``seed``: copies differ (for copy
    < 2**32) and stay in SEED_RANGE; None stays None (each request's default seed differs
    already)."""
    if seed is None or copy == 0:
        return seed
    shifted = seed + copy
    return shifted if shifted <= SEED_RANGE[1] else shifted - 2**32


def with_choices(spec: GenerationSpec) -> GenerationSpec:
    """``spec`` (one entry per prompt) with each prompt repeated ``spec.n`` times, copy j's
    seed ``copy_seed(seed, j)``."""
    if spec.n == 1:
        return spec
    n, indices = spec.n, [i for i in range(len(spec.prompts)) for _ in range(spec.n)]
    sampling = [
        dataclasses.replace(spec.sampling[i], seed=copy_seed(spec.sampling[i].seed, k % n))
        for k, i in enumerate(indices)
    ]
    return dataclasses.replace(
        spec,
        prompts=[spec.prompts[i] for i in indices],
        prompt_texts=[spec.prompt_texts[i] for i in indices],
        sampling=sampling,
    )


def check_request_size(limits: Limits, param: str, prompt: Any, n: int) -> None:
    """Refuse a body by its raw JSON before any prompt is tokenized or copied: ``prompt``
    (the body's prompt field, undecoded) times ``n`` must fit ``limits.max_requests``, and
    its text, all prompts together, ``limits.max_body_prompt_chars``. Costs one pass over
    the prompt list (no tokenizing, no copies); a malformed prompt is left to the parser."""
    batched = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    num_prompts = len(prompt) if batched else 1
    count = num_prompts * n
    if limits.max_requests is not None and count > limits.max_requests:
        raise ApiError(  # no retry can help: the request alone exceeds the capacity
            f"{num_prompts} prompts x n={n} = {count} requests exceed the server's capacity "
            f"({limits.max_requests}: running + max_queued_requests)",
            param="n" if n > 1 else param,
            code="too_many_prompts",
        )
    if limits.max_body_prompt_chars is None or not batched:
        return  # one prompt: max_prompt_chars (smaller) applies before it is tokenized
    num_chars = sum(len(text) for text in prompt if isinstance(text, str))
    if num_chars > limits.max_body_prompt_chars:
        raise ApiError(
            f"the prompts hold {num_chars} characters, more than one request may have "
            f"tokenized (max_body_prompt_chars={limits.max_body_prompt_chars}: the KV pool's "
            "tokens at the longest token's length); send fewer or shorter prompts",
            param=param,
            code="prompt_too_long",
        )


# ---------------------------------------------------------------- field readers


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


def _integer(
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


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(f"{name}={value!r} must be a finite number", param=name)
    return float(value)


def _boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(f"{name}={value!r} must be true or false", param=name)
    return value


def _stop_strings(body: dict, name: str = "stop") -> tuple[str, ...]:
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


def _check_model(body: dict, limits: Limits) -> None:
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


def _token_ids(value: list, limits: Limits, param: str) -> list[int]:
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


def _check_text_len(num_chars: int, limits: Limits, param: str) -> None:
    if limits.max_prompt_chars is not None and num_chars > limits.max_prompt_chars:
        raise ApiError(
            f"the prompt text ({num_chars} characters) is longer than any prompt that fits "
            f"the context limit {limits.max_context} (max_prompt_chars={limits.max_prompt_chars})",
            param=param,
        )


def _encode(
    text: str, tokenizer: Any, limits: Limits, param: str, special: bool = True
) -> list[int]:
    if tokenizer is None:
        raise ApiError("this model has no tokenizer.json: send token ids", param=param)
    _check_text_len(len(text), limits, param)
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
        return [_encode(value, tokenizer, limits, param)], [value], False
    if not isinstance(value, list) or not value:
        raise ApiError(
            f"{param} must be a non-empty string, token-id list, or a list of them", param=param
        )
    if all(isinstance(v, str) for v in value):
        if not all(value):
            raise ApiError("the prompt is empty", param=param)
        return [_encode(v, tokenizer, limits, param) for v in value], list(value), True
    if all(isinstance(v, list) for v in value):
        return [_token_ids(v, limits, param) for v in value], [None] * len(value), True
    return [_token_ids(value, limits, param)], [None], False


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
        out[name] = _number(body, name, 0.0)
        if not low <= out[name] <= high:
            raise ApiError(f"{name}={out[name]} must be in [{low}, {high}]", param=name)
    out["repetition_penalty"] = value = _number(body, "repetition_penalty", 1.0)
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


def _v1_grammar(body: dict) -> dict[str, str]:
    """/v1's grammar: ``response_format``, or SGLang's top-level ``json_schema`` (a string
    or an object), ``regex`` or ``ebnf``; at most one of them."""
    given = dict(_response_format(body))
    if isinstance(body.get("json_schema"), dict):
        body = {**body, "json_schema": json.dumps(body["json_schema"])}
    sglang = _grammar(body)
    if given and sglang:
        raise ApiError(
            f"give at most one of response_format, json_schema, regex and ebnf (got "
            f"response_format and {sorted(sglang)[0]})",
            param=sorted(sglang)[0],
        )
    return given or sglang


def _text_options(body: dict) -> dict[str, Any]:
    """SGLang's ``no_stop_trim``, ``skip_special_tokens`` and ``stop_regex`` as
    GenerationSpec fields."""
    return {
        "no_stop_trim": _boolean(body, "no_stop_trim", False),
        "skip_special_tokens": _boolean(body, "skip_special_tokens", True),
        "stop_regex": _stop_regexes(body),
    }


def _stop_regexes(body: dict) -> tuple[str, ...]:
    try:
        return stop_patterns(body.get("stop_regex"), MAX_STOP_STRINGS)
    except ValueError as exc:
        raise ApiError(f"stop_regex: {exc}", param="stop_regex") from None


def _grammar(params: dict) -> dict[str, str]:
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


def _sampling(
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
    temperature = _number(body, "temperature", 1.0)
    top_p = _number(body, "top_p", 1.0)
    min_p = _number(body, "min_p", 0.0)
    if not 0 <= min_p <= 1:
        raise ApiError(f"min_p={min_p} must be in [0, 1]", param="min_p")
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise ApiError(
            f"temperature={temperature} must be in [0, {MAX_TEMPERATURE}]", param="temperature"
        )
    if not 0 < top_p <= 1:
        raise ApiError(f"top_p={top_p} must be in (0, 1]", param="top_p")
    top_k = _integer(body, "top_k", -1)
    if top_k != -1 and not 1 <= top_k <= limits.vocab_size:
        raise ApiError(
            f"top_k={top_k} must be -1 (off) or in [1, {limits.vocab_size}] (the vocabulary)",
            param="top_k",
        )
    seed = _integer(body, "seed", None, *SEED_RANGE)
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list):
        raise ApiError(
            f"stop_token_ids={stop_ids!r} must be a list of token ids", param="stop_token_ids"
        )
    stop_ids = _token_ids(stop_ids, limits, "stop_token_ids") if stop_ids else []
    min_new = _integer(body, min_param, 0, 0, limits.max_context)
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
                ignore_eos=_boolean(body, "ignore_eos", False),
                stop_token_ids=tuple(stop_ids),
                seed=seed,
                min_new_tokens=min_new,
                logit_bias=logit_bias,
                **penalties,
                **(grammar or {}),
            )
        )
    return out


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise ApiError(f"stream_options={options!r} must be an object", param="stream_options")
    return _boolean(options, "include_usage", False)


# ---------------------------------------------------------------- endpoints


def parse_completion(body: dict, tokenizer: Any, limits: Limits) -> GenerationSpec:
    """POST /v1/completions."""
    _check_model(body, limits)
    n = _num_choices(body, best_of=True)
    if "prompt" not in body:
        raise ApiError("prompt is required", param="prompt")
    check_request_size(limits, "prompt", body["prompt"], n)
    prompts, texts, _ = parse_prompts(body["prompt"], tokenizer, limits, "prompt")
    max_new = _integer(body, "max_tokens", 16, 1, limits.max_context)
    spec = GenerationSpec(
        prompts,
        texts,
        _sampling(body, max_new, prompts, limits, "max_tokens", "min_tokens", _v1_grammar(body)),
        _stop_strings(body),
        _boolean(body, "stream", False),
        _include_usage(body),
        logprobs := _integer(body, "logprobs", None, 0, MAX_LOGPROBS),
        echo := _boolean(body, "echo", False),
        n=n,
        logprob_start_len=0 if echo and logprobs is not None else None,
        **_text_options(body),
    )
    return with_choices(spec)


def parse_chat(body: dict, tokenizer: Any, limits: Limits, template: Any) -> GenerationSpec:
    """POST /v1/chat/completions; ``template`` renders the messages (a ChatTemplate)."""
    _check_model(body, limits)
    n = _num_choices(body, best_of=False)
    check_request_size(limits, "messages", None, n)  # the text is checked with the messages
    messages = parse_messages(body.get("messages"))
    _check_text_len(sum(len(m["content"]) for m in messages), limits, "messages")
    extra = body.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict):
        raise ApiError(
            f"chat_template_kwargs={extra!r} must be an object", param="chat_template_kwargs"
        )
    text = template.render(messages, extra)
    prompt = _encode(text, tokenizer, limits, "messages", special=False)
    max_new = _integer(body, "max_completion_tokens", None, 1, limits.max_context)
    if max_new is None:
        max_new = _integer(body, "max_tokens", None, 1, limits.max_context)
    top = _integer(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    want = _boolean(body, "logprobs", False)
    if top is not None and not want:
        raise ApiError("top_logprobs needs logprobs=true", param="top_logprobs")
    spec = GenerationSpec(
        [prompt],
        [None],
        _sampling(body, max_new, [prompt], limits, "max_tokens", "min_tokens", _v1_grammar(body)),
        _stop_strings(body),
        _boolean(body, "stream", False),
        _include_usage(body),
        (top or 0) if want else None,
        n=n,
        **_text_options(body),
    )
    return with_choices(spec)


def parse_generate(body: dict, tokenizer: Any, limits: Limits) -> GenerationSpec:
    """POST /generate (SGLang): text or input_ids, sampling_params, stream, return_logprob,
    top_logprobs_num."""
    if (body.get("text") is None) == (body.get("input_ids") is None):
        raise ApiError("give exactly one of text and input_ids", param="text")
    param = "text" if body.get("text") is not None else "input_ids"
    if param == "text" and not (
        isinstance(body["text"], str)
        or isinstance(body["text"], list)
        and all(isinstance(t, str) for t in body["text"])
    ):
        raise ApiError(f"text={body['text']!r} must be a string or a list of strings", param=param)
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise ApiError(f"sampling_params={params!r} must be an object", param="sampling_params")
    known = {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "ignore_eos",
        "stop",
        "stop_regex",
        "stop_token_ids",
        "seed",
        "min_new_tokens",
        "logit_bias",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "json_schema",
        "regex",
        "ebnf",
        "skip_special_tokens",
        "no_stop_trim",
        "n",
    }
    unknown = sorted(set(params) - known)
    if unknown:
        raise ApiError(f"unknown sampling parameter(s) {unknown}", param="sampling_params")
    n = _num_choices(params, best_of=False)
    check_request_size(limits, param, body[param], n)
    prompts, texts, batched = parse_prompts(
        body[param], tokenizer, limits, param, text=param == "text"
    )
    max_new = _integer(params, "max_new_tokens", 128, 0, limits.max_context)
    top = _integer(body, "top_logprobs_num", 0, 0, MAX_LOGPROBS)
    return_logprob = _boolean(body, "return_logprob", False)
    start = _integer(body, "logprob_start_len", -1, -1, limits.max_context)
    shortest = min(len(ids) for ids in prompts)
    if return_logprob and start >= shortest:
        raise ApiError(
            f"logprob_start_len={start} must be -1 (no prompt logprobs) or in [0, {shortest}) "
            "(the prompt's length)",
            param="logprob_start_len",
        )
    spec = GenerationSpec(
        prompts,
        texts,
        _sampling(
            params,
            max_new,
            prompts,
            limits,
            "max_new_tokens",
            "min_new_tokens",
            _grammar(params),
        ),
        _stop_strings(params),
        _boolean(body, "stream", False),
        logprobs=top if return_logprob else None,
        batched=batched or n > 1,  # SGLang answers n > 1 with a list
        n=n,
        logprob_start_len=start if return_logprob and start >= 0 else None,
        **_text_options(params),
    )
    return with_choices(spec)


def parse_messages(value: Any) -> list[dict[str, str]]:
    """Chat messages -> [{"role", "content"}] with text content (parts joined)."""
    if not isinstance(value, list) or not value:
        raise ApiError("messages must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ApiError(
                f"messages[{i}] must be an object with a role in {list(ROLES)}", param="messages"
            )
        out.append({"role": message["role"], "content": _content(message.get("content"), i)})
    return out


# OpenAI content part types that carry media: served models read text only (the vision
# tower of a vision-language checkpoint is not loaded)
MEDIA_PARTS = ("image_url", "input_audio", "video_url", "file")


def _content(content: Any, i: int) -> str:
    """A message's content as text: a string, or a list of ``{"type": "text"}`` parts
    (joined). A media part is refused by name (the model reads text only)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in MEDIA_PARTS:
                raise ApiError(
                    f"messages[{i}].content[{j}] has type {kind!r}: this server reads text "
                    "only (image, audio, video and file input are not supported)",
                    param="messages",
                    code="unsupported_content",
                )
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "".join(texts)
    raise ApiError(
        f"messages[{i}].content must be a string or a list of text parts", param="messages"
    )


# ---------------------------------------------------------------- text output


class TextStream:
    """Incremental detokenization with stop strings and stop patterns (``stop_regex``).
    ``push`` returns the new text that is safe to show: no incomplete UTF-8 tail, no prefix
    of a stop string, no text a match still forming may begin in (``stop_regex.py``); at
    the first stop string or match the text is cut before it and ``stopped`` names it."""

    def __init__(
        self,
        tokenizer: Any,
        stop: tuple[str, ...] = (),
        keep_stop: bool = False,
        skip_special_tokens: bool = True,
        stop_regex: tuple[str, ...] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.keep_stop, self.skip_special_tokens = keep_stop, skip_special_tokens
        self.patterns = StopPatterns(stop_regex)
        self.hold = max(max((len(s) for s in stop), default=1) - 1, self.patterns.hold)
        self.token_ids: list[int] = []
        self.text = ""
        self.stopped: str | None = None

    def push(self, token_ids: list[int], final: bool = False) -> str:
        if self.stopped is not None or self.tokenizer is None:
            return ""
        self.token_ids.extend(token_ids)
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        if not final:  # a character still incomplete (U+FFFD until its last byte comes)
            full = full.rstrip("\ufffd")  # is neither shown nor matched yet
        start = len(self.text)
        cut = self._first_stop(full, start)
        if cut is not None:
            end = cut
        elif final:
            end = len(full)
        else:
            end = len(full) - self.hold
            while end > start and full[end - 1] == "\ufffd":
                end -= 1
        delta = full[start:end] if end > start else ""
        self.text += delta
        return delta

    def _first_stop(self, full: str, shown: int) -> int | None:
        """Where the text ends at the earliest stop string or match (None: none yet)."""
        best = self.patterns.first(full, shown)  # (start, end, pattern)
        search_from = max(0, shown - self.hold)
        for s in self.stop:
            at = full.find(s, search_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, at + len(s), s)
        if best is None:
            return None
        self.stopped = best[2]
        end = best[1] if self.keep_stop else best[0]  # no_stop_trim keeps it
        return max(end, len(self.text))


class ChatTemplate:
    """Renders chat messages with the model's jinja2 chat template (sandboxed, no
    transformers), or as ``role: content`` lines ending in ``assistant:`` without one."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source
        self.specials = {"bos_token": bos_token, "eos_token": eos_token}
        self._template = None
        if source is not None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = lambda v, indent=None: json.dumps(
                v, ensure_ascii=False, indent=indent
            )
            env.globals["raise_exception"] = _template_exception
            self._template = env.from_string(source)

    @classmethod
    def from_folder(cls, folder: str | Path) -> ChatTemplate:
        """From ``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template``."""
        folder = Path(folder)
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        jinja_path = folder / "chat_template.jinja"
        if source is None and jinja_path.is_file():
            source = jinja_path.read_text()
        return cls(
            source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        )

    def render(self, messages: list[dict[str, str]], extra: dict[str, Any] | None = None) -> str:
        """The prompt text; ``extra`` (``chat_template_kwargs``) adds template variables."""
        if self._template is None:
            return "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"
        try:
            variables = {**(extra or {}), **self.specials}
            variables.update(messages=messages, add_generation_prompt=True)
            return self._template.render(**variables)
        except ApiError:
            raise
        except Exception as exc:  # a template error is the request's fault or the model's
            raise ApiError(
                f"the chat template failed on these messages: {exc}", param="messages"
            ) from None


def _template_exception(message: str) -> None:
    raise ApiError(f"chat template: {message}", param="messages")


def _token_text(token: Any) -> str:
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return token if isinstance(token, str) else ""
