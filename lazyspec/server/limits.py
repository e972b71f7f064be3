"""What a request may ask for, and ``ApiError``: the answer (a 4xx body naming the field)
when it asks for more or for something malformed.

``Limits`` is the server's side of the bargain (vocabulary, context, served names, how much
prompt text is worth tokenizing); ``check_request_size`` refuses a body by its raw JSON before
any prompt is tokenized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lazyspec.scheduler.request import TOP_LOGPROBS

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
