"""Response bodies of the HTTP server: per-request output state (``Choice``) and the
OpenAI completions / chat and SGLang ``/generate`` shapes, whole or as server-sent events."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from lazyspec.server.limits import ApiError
from lazyspec.server.protocol import GenerationSpec
from lazyspec.server.text_stream import TextStream
from lazyspec.server.worker import TokenEvent


class Choice:
    """Output state of one engine request: tokens, logprobs, text, finish."""

    def __init__(self, tokenizer: Any, spec: GenerationSpec, rid: str, prompt_tokens: int) -> None:
        self.text = TextStream(
            tokenizer, spec.stop, spec.no_stop_trim, spec.skip_special_tokens, spec.stop_regex
        )
        self.rid, self.prompt_tokens = rid, prompt_tokens
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[float, int]]] = []
        self.cached_tokens = self.spec_verify_ct = 0
        self.finish_reason: dict[str, Any] | None = None
        self.error: ApiError | None = None  # the engine ended this request with an error
        # prompt logprobs (logprob_start_len): (logprob, id) pairs and each one's top pairs
        self.input_logprobs: list[tuple[float | None, int]] | None = None
        self.input_top_logprobs: list[list[tuple[float, int]] | None] | None = None

    def apply(self, event: TokenEvent) -> str:
        """Take one event; returns the new text that may be shown."""
        self.token_ids += event.token_ids
        self.logprobs += event.logprobs
        self.top_logprobs += event.top_logprobs
        self.cached_tokens, self.spec_verify_ct = event.cached_tokens, event.spec_verify_ct
        if event.input_logprobs is not None:
            self.input_logprobs = event.input_logprobs
            self.input_top_logprobs = event.input_top_logprobs
        final = event.finish_reason is not None
        delta = self.text.push(event.token_ids, final=final)
        if self.text.stopped is not None:
            self.finish_reason = {"type": "stop", "matched": self.text.stopped}
        elif final:
            self.finish_reason = event.finish_reason
            if event.error is not None:
                status = event.error_status
                self.error = ApiError(
                    event.error,
                    status=status,
                    error_type="server_error" if status >= 500 else "invalid_request_error",
                )
        return delta

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stopped_by_string(self) -> bool:
        return self.text.stopped is not None

    @property
    def finish_type(self) -> str:
        return (self.finish_reason or {}).get("type", "unknown")


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage(choices: list[Choice], n: int = 1) -> dict[str, Any]:
    """Token counts of ``choices`` (``n`` per prompt, prompt-major): each prompt counted
    once, with the most of it any of its choices found cached; every choice's outputs."""
    groups = [choices[i : i + n] for i in range(0, len(choices), n)]
    prompt = sum(group[0].prompt_tokens for group in groups)
    cached = sum(max(c.cached_tokens for c in group) for group in groups)
    completion = sum(len(c.token_ids) for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def model_list(name: str, max_context: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "lazyspec",
                "max_model_len": max_context,
            }
        ],
    }


def _special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of the tokenizer's special added tokens (BOS, EOS, ...)."""
    if tokenizer is None:
        return frozenset()
    return frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)


def _token_text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False) if tokenizer else str(token)


class _Renderer:
    object_name = ""

    def __init__(self, model: str, tokenizer: Any, spec: GenerationSpec) -> None:
        self.model, self.tokenizer, self.spec = model, tokenizer, spec
        self.id = f"{'chatcmpl' if 'chat' in self.object_name else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def envelope(self, choices: list[dict], object_name: str | None = None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_name or self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def usage_chunk(self, choices: list[Choice], object_name: str | None = None) -> str:
        return sse({**self.envelope([], object_name), "usage": usage(choices, self.spec.n)})


class CompletionRenderer(_Renderer):
    """/v1/completions bodies. ``logprobs: N`` gives each position's N most likely tokens
    plus the sampled one in ``top_logprobs``; echoed prompt tokens have logprob null."""

    object_name = "text_completion"

    def logprobs(
        self, token_ids: list[int], logprobs: list, tops: list, offset: int
    ) -> dict[str, Any]:
        tokens = [_token_text(self.tokenizer, t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        top_dicts = []
        for token, lp, top in zip(tokens, logprobs, tops):
            if lp is None:
                top_dicts.append(None)
                continue
            alternatives = {_token_text(self.tokenizer, t): v for v, t in top[: self.spec.logprobs]}
            top_dicts.append({**alternatives, token: lp})
        return {
            "tokens": tokens,
            "token_logprobs": list(logprobs),
            "top_logprobs": top_dicts,
            "text_offset": offsets,
        }

    def prompt_text(self, index: int) -> str:
        text = self.spec.prompt_texts[index]
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(self.spec.prompts[index])
        return text or ""

    def echoed_logprobs(self, index: int, choice: Choice) -> tuple[list, list, list]:
        """The echoed prompt's (ids, logprobs, tops): computed on the prompt (the first
        token's logprob null), or all null when the engine sent none. Special tokens the
        tokenizer added (a BOS) are left out, as OpenAI's echo leaves them out of ``text``,
        so that ``text_offset`` indexes the text."""
        ids = list(self.spec.prompts[index])
        if choice.input_logprobs is None:
            lps, tops = [None] * len(ids), [[]] * len(ids)
        else:
            lps = [lp for lp, _ in choice.input_logprobs]
            tops = [top or [] for top in choice.input_top_logprobs]
        keep = self._shown(ids, self.prompt_text(index))
        return [ids[i] for i in keep], [lps[i] for i in keep], [tops[i] for i in keep]

    def _shown(self, ids: list[int], text: str) -> list[int]:
        """Indices of the ``ids`` whose text ``text`` shows: a special token is dropped
        unless ``text`` holds it where it stands."""
        special = _special_ids(self.tokenizer)
        keep, offset = [], 0
        for i, token in enumerate(ids):
            piece = _token_text(self.tokenizer, token)
            if text.startswith(piece, offset):
                offset += len(piece)
            elif token in special:
                continue
            keep.append(i)
        return keep

    def full(self, choices: list[Choice]) -> dict[str, Any]:
        out = []
        for i, c in enumerate(choices):
            prefix = self.prompt_text(i) if self.spec.echo else ""
            logprobs = None
            if self.spec.logprobs is not None:
                ids, lps, tops = c.token_ids, list(c.logprobs), list(c.top_logprobs)
                if self.spec.echo:
                    echo_ids, echo_lps, echo_tops = self.echoed_logprobs(i, c)
                    ids, lps, tops = echo_ids + ids, echo_lps + lps, echo_tops + tops
                logprobs = self.logprobs(ids, lps, tops, 0)
            out.append(
                {
                    "index": i,
                    "text": prefix + c.text.text,
                    "logprobs": logprobs,
                    "finish_reason": _openai_finish(c),
                }
            )
        return {**self.envelope(out), "usage": usage(choices, self.spec.n)}

    async def stream(self, events, choices: list[Choice]) -> AsyncIterator[str]:
        echoed: set[int] = set()
        async for i, delta, event in events:
            c = choices[i]
            if self.spec.echo and i not in echoed:  # after its first event: its logprobs
                echoed.add(i)
                echo_logprobs = None
                if self.spec.logprobs is not None:
                    echo_logprobs = self.logprobs(*self.echoed_logprobs(i, c), 0)
                yield sse(self.envelope([self._chunk(i, self.prompt_text(i), echo_logprobs, None)]))
            logprobs = None
            if self.spec.logprobs is not None:
                prefix_len = len(self.prompt_text(i)) if self.spec.echo else 0
                logprobs = self.logprobs(
                    event.token_ids,
                    event.logprobs,
                    event.top_logprobs,
                    prefix_len + len(c.text.text) - len(delta),
                )
            if delta or c.finished or logprobs is not None:
                yield sse(self.envelope([self._chunk(i, delta, logprobs, _openai_finish(c))]))
        if self.spec.include_usage:
            yield self.usage_chunk(choices)

    @staticmethod
    def _chunk(index: int, text: str, logprobs, finish) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


class ChatRenderer(_Renderer):
    """/v1/chat/completions bodies; ``top_logprobs: N`` lists each position's N most likely
    tokens, most likely first."""

    object_name = "chat.completion"

    def _item(self, token: int, logprob: float) -> dict[str, Any]:
        text = _token_text(self.tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def logprobs(
        self, token_ids: list[int], logprobs: list[float], tops: list[list[tuple[float, int]]]
    ) -> dict[str, Any]:
        content = []
        for token, lp, top in zip(token_ids, logprobs, tops):
            alternatives = [self._item(t, v) for v, t in top[: self.spec.logprobs]]
            content.append({**self._item(token, lp), "top_logprobs": alternatives})
        return {"content": content}

    def _logprobs_or_none(self, token_ids, logprobs, tops):
        return None if self.spec.logprobs is None else self.logprobs(token_ids, logprobs, tops)

    def full(self, choices: list[Choice]) -> dict[str, Any]:
        out = [
            {
                "index": i,
                "message": {"role": "assistant", "content": c.text.text},
                "logprobs": self._logprobs_or_none(c.token_ids, c.logprobs, c.top_logprobs),
                "finish_reason": _openai_finish(c),
            }
            for i, c in enumerate(choices)
        ]
        return {**self.envelope(out), "usage": usage(choices, self.spec.n)}

    async def stream(self, events, choices: list[Choice]) -> AsyncIterator[str]:
        chunk = "chat.completion.chunk"
        for i in range(len(choices)):
            first = {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            yield sse(self.envelope([first], chunk))
        async for i, delta, event in events:
            c = choices[i]
            logprobs = self._logprobs_or_none(event.token_ids, event.logprobs, event.top_logprobs)
            if delta or c.finished or logprobs is not None:
                body = {
                    "index": i,
                    "delta": {"content": delta} if delta else {},
                    "logprobs": logprobs,
                    "finish_reason": _openai_finish(c),
                }
                yield sse(self.envelope([body], chunk))
        if self.spec.include_usage:
            yield self.usage_chunk(choices, chunk)


OPENAI_FINISH_REASONS = ("stop", "length")  # of OpenAI's values, the ones a choice can end with


def _openai_finish(choice: Choice) -> str | None:
    """OpenAI's ``finish_reason``: "stop" or "length"; None while running and for an
    aborted choice, which has no OpenAI value: its stream ends with an error event instead
    (as SGLang's does for an abort it did not ask for; the request's abort is in /metrics)."""
    reason = choice.finish_type if choice.finished else None
    return reason if reason in OPENAI_FINISH_REASONS else None


def generate_result(c: Choice, spec: GenerationSpec) -> dict[str, Any]:
    """One SGLang /generate result (cumulative when streamed)."""
    meta = {
        "id": c.rid,
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": len(c.token_ids),
        "cached_tokens": c.cached_tokens,
        "finish_reason": c.finish_reason,
        "spec_verify_ct": c.spec_verify_ct,
    }
    if c.input_logprobs is not None:
        meta["input_token_logprobs"] = [[lp, t, None] for lp, t in c.input_logprobs]
        if spec.logprobs:
            meta["input_top_logprobs"] = [
                None if top is None else [[v, t, None] for v, t in top[: spec.logprobs]]
                for top in c.input_top_logprobs
            ]
    if spec.logprobs is not None:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(c.logprobs, c.token_ids)]
        if spec.logprobs:
            meta["output_top_logprobs"] = [
                [[v, t, None] for v, t in top[: spec.logprobs]] for top in c.top_logprobs
            ]
    return {"text": c.text.text, "output_ids": list(c.token_ids), "meta_info": meta}


def generate_stream(spec: GenerationSpec):
    async def render(events, choices: list[Choice]) -> AsyncIterator[str]:
        async for i, _, _ in events:
            result = generate_result(choices[i], spec)
            if spec.batched:
                result["index"] = i
            yield sse(result)

    return render
