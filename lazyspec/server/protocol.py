"""Request parsing for the OpenAI (/v1/completions, /v1/chat/completions) and SGLang
(/generate) endpoints.

Every parser takes the decoded JSON body and returns a ``GenerationSpec`` (token-id prompts +
validated sampling), or raises ``ApiError`` (``limits``) naming the offending field. Nothing
here touches the engine. Chat messages and their template are ``chat``'s; the text side of
outputs is ``text_stream``'s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lazyspec.scheduler.request import SEED_RANGE, SamplingParams
from lazyspec.server.chat import parse_messages
from lazyspec.server.limits import MAX_CHOICES, MAX_LOGPROBS, ApiError, Limits, check_request_size
from lazyspec.server.readers import (
    bool_field,
    check_model,
    check_text_len,
    encode_prompt,
    grammar_field,
    include_usage,
    int_field,
    parse_prompts,
    sampling_params,
    stop_strings,
    text_options,
    v1_grammar,
)

# the sampling parameters the server takes besides the engine's (``SamplingParams``): stop
# strings, detokenizing, choices
SERVER_SAMPLING_PARAMS = frozenset(
    {"stop", "stop_regex", "skip_special_tokens", "no_stop_trim", "n"}
)


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
    n = int_field(body, "n", 1, 1, MAX_CHOICES)
    if best_of:
        value = int_field(body, "best_of", None)
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


# ---------------------------------------------------------------- endpoints


def parse_completion(body: dict, tokenizer: Any, limits: Limits) -> GenerationSpec:
    """POST /v1/completions."""
    check_model(body, limits)
    n = _num_choices(body, best_of=True)
    if "prompt" not in body:
        raise ApiError("prompt is required", param="prompt")
    check_request_size(limits, "prompt", body["prompt"], n)
    prompts, texts, _ = parse_prompts(body["prompt"], tokenizer, limits, "prompt")
    max_new = int_field(body, "max_tokens", 16, 1, limits.max_context)
    spec = GenerationSpec(
        prompts,
        texts,
        sampling_params(
            body, max_new, prompts, limits, "max_tokens", "min_tokens", v1_grammar(body)
        ),
        stop_strings(body),
        bool_field(body, "stream", False),
        include_usage(body),
        logprobs := int_field(body, "logprobs", None, 0, MAX_LOGPROBS),
        echo := bool_field(body, "echo", False),
        n=n,
        logprob_start_len=0 if echo and logprobs is not None else None,
        **text_options(body),
    )
    return with_choices(spec)


def parse_chat(body: dict, tokenizer: Any, limits: Limits, template: Any) -> GenerationSpec:
    """POST /v1/chat/completions; ``template`` renders the messages (a ChatTemplate)."""
    check_model(body, limits)
    n = _num_choices(body, best_of=False)
    check_request_size(limits, "messages", None, n)  # the text is checked with the messages
    messages = parse_messages(body.get("messages"))
    check_text_len(sum(len(m["content"]) for m in messages), limits, "messages")
    extra = body.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict):
        raise ApiError(
            f"chat_template_kwargs={extra!r} must be an object", param="chat_template_kwargs"
        )
    text = template.render(messages, extra)
    prompt = encode_prompt(text, tokenizer, limits, "messages", special=False)
    max_new = int_field(body, "max_completion_tokens", None, 1, limits.max_context)
    if max_new is None:
        max_new = int_field(body, "max_tokens", None, 1, limits.max_context)
    top = int_field(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    want = bool_field(body, "logprobs", False)
    if top is not None and not want:
        raise ApiError("top_logprobs needs logprobs=true", param="top_logprobs")
    spec = GenerationSpec(
        [prompt],
        [None],
        sampling_params(
            body, max_new, [prompt], limits, "max_tokens", "min_tokens", v1_grammar(body)
        ),
        stop_strings(body),
        bool_field(body, "stream", False),
        include_usage(body),
        (top or 0) if want else None,
        n=n,
        **text_options(body),
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
    known = SamplingParams.names() | SERVER_SAMPLING_PARAMS
    unknown = sorted(set(params) - known)
    if unknown:
        raise ApiError(f"unknown sampling parameter(s) {unknown}", param="sampling_params")
    n = _num_choices(params, best_of=False)
    check_request_size(limits, param, body[param], n)
    prompts, texts, batched = parse_prompts(
        body[param], tokenizer, limits, param, text=param == "text"
    )
    max_new = int_field(params, "max_new_tokens", 128, 0, limits.max_context)
    top = int_field(body, "top_logprobs_num", 0, 0, MAX_LOGPROBS)
    return_logprob = bool_field(body, "return_logprob", False)
    start = int_field(body, "logprob_start_len", -1, -1, limits.max_context)
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
        sampling_params(
            params,
            max_new,
            prompts,
            limits,
            "max_new_tokens",
            "min_new_tokens",
            grammar_field(params),
        ),
        stop_strings(params),
        bool_field(body, "stream", False),
        logprobs=top if return_logprob else None,
        batched=batched or n > 1,  # SGLang answers n > 1 with a list
        n=n,
        logprob_start_len=start if return_logprob and start >= 0 else None,
        **text_options(params),
    )
    return with_choices(spec)
