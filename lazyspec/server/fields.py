"""The request fields each endpoint knows: OpenAI's, and the ones SGLang's server takes
(its ``extra_body`` sampling fields on /v1, its ``GenerateReqInput`` on /generate).

A field is read by the parsers (``protocol``), accepted and ignored because it changes
nothing here (metadata such as ``user``), or accepted only at the value that asks for
nothing (``lora_path: null``, ``session_id: null``): any other value is a 400 saying it is not
supported. A field neither OpenAI nor SGLang defines is a 400 that names it.
"""

from __future__ import annotations

from typing import Any

from lazyspec.server.limits import ApiError

# SGLang's extra_body sampling fields on both /v1 endpoints that the parsers read
SGLANG_V1_SAMPLING = (
    "top_k",
    "min_tokens",
    "json_schema",
    "regex",
    "ebnf",
    "repetition_penalty",
    "stop_token_ids",
    "no_stop_trim",
    "ignore_eos",
    "skip_special_tokens",
    "min_p",
    "stop_regex",
)
_OPENAI_SHARED = (
    "model",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "n",
    "presence_penalty",
    "response_format",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
)
READ = {
    "completions": frozenset((*_OPENAI_SHARED, *SGLANG_V1_SAMPLING, "prompt", "best_of", "echo")),
    "chat": frozenset(
        (
            *_OPENAI_SHARED,
            *SGLANG_V1_SAMPLING,
            "messages",
            "max_completion_tokens",
            "top_logprobs",
            "chat_template_kwargs",
        )
    ),
    "generate": frozenset(
        (
            "text",
            "input_ids",
            "sampling_params",
            "stream",
            "return_logprob",
            "logprob_start_len",
            "top_logprobs_num",
        )
    ),
}
# metadata: accepted whatever the value, for it changes no output here
_METADATA = ("user", "rid", "extra_key", "priority", "custom_labels", "routed_dp_rank")
IGNORED = {
    "completions": frozenset(_METADATA),
    "chat": frozenset(
        (
            *_METADATA,
            "tool_choice",  # without tools it can only mean none
            "parallel_tool_calls",
            "separate_reasoning",
            "stream_reasoning",
            "service_tier",
            "store",
            "metadata",
            "prompt_cache_key",
            "safety_identifier",
        )
    ),
    "generate": frozenset((*_METADATA, "return_text_in_logprobs")),
}
# accepted only at the value that asks for nothing (null, false, 0, "", {} or [])
_UNSUPPORTED_SHARED = (
    "lora_path",
    "session_id",
    "session_params",
    "custom_params",
    "custom_logit_processor",
    "return_hidden_states",
    "return_routed_experts",
    "return_cached_tokens_details",
    "return_token_ids",
    "cache_salt",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "data_parallel_rank",
    "disagg_prefill_dp_rank",
    "images_config",
)
UNSUPPORTED = {
    "completions": frozenset((*_UNSUPPORTED_SHARED, "suffix")),
    "chat": frozenset(
        (
            *_UNSUPPORTED_SHARED,
            "tools",
            "functions",
            "function_call",
            "reasoning_effort",
            "continue_final_message",
            "return_prompt_token_ids",
            "return_meta_info",
            "input_ids",
            "modalities",
            "audio",
            "prediction",
            "web_search_options",
        )
    ),
    "generate": frozenset(
        (
            *_UNSUPPORTED_SHARED,
            "image_data",
            "audio_data",
            "video_data",
            "input_embeds",
            "return_logprob_token_ids",
            "token_ids_logprob",
        )
    ),
}


def check_fields(body: dict[str, Any], endpoint: str) -> None:
    """ApiError 400 naming the first field of ``body`` that ``endpoint`` ("completions",
    "chat" or "generate") does not know, or that asks for something not supported."""
    read, ignored, unsupported = READ[endpoint], IGNORED[endpoint], UNSUPPORTED[endpoint]
    for name, value in body.items():
        if name in read or name in ignored:
            continue
        if name in unsupported:
            if value in (None, False, 0, "", [], {}):
                continue
            raise ApiError(
                f"{name}={value!r} is not supported by this server (only its default is)",
                param=name,
                code="unsupported_field",
            )
        raise ApiError(
            f"unknown field {name!r}: neither OpenAI's API nor SGLang's defines it here",
            param=name,
            code="unknown_field",
        )
