"""The HTTP server: OpenAI-compatible and SGLang-native endpoints over an ``EngineWorker``.

``create_app`` builds a FastAPI app. Handlers parse and validate the body (``protocol``),
submit engine requests through the worker's command queue, and read their tokens from an
asyncio queue; they never touch the engine. Errors are answered as
``{"error": {message, type, param, code}}`` with a 4xx/5xx status.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lazyspec.server.protocol import (ApiError, ChatTemplate, GenerationSpec, Limits,
                                      TextStream, parse_chat, parse_completion,
                                      parse_generate, parse_json_body)
from lazyspec.server.worker import EngineWorker, RequestGroup, Submission, TokenEvent

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    max_queued_requests: int | None = None  # None: unbounded
    chat_template: ChatTemplate | None = None


class _GuardedStream(StreamingResponse):
    """A streaming response whose ``on_close`` runs however the stream ends (done, error,
    client gone), even if the body iterator never started."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _ClientGone(Exception):
    """The client disconnected before its (non-streamed) response was ready."""


async def _until_disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Frontend:
    """State shared by the handlers of one app."""

    def __init__(self, worker: EngineWorker, settings: ServerSettings) -> None:
        self.worker = worker
        self.settings = settings
        self.metrics = worker.metrics
        model = worker.engine.model
        self.tokenizer = model.tokenizer
        self.template = settings.chat_template or ChatTemplate(None)
        self.limits = Limits(model.config.vocab_size, worker.max_context,
                             (settings.served_model_name,))
        self.num_live = 0
        self._held: set[RequestGroup] = set()  # groups whose queue places are taken

    async def open(self, spec: GenerationSpec) -> tuple[RequestGroup, list[Choice]]:
        """Admit ``spec``'s requests (503 when the queue is full, 400 if the engine refuses)."""
        limit = self.settings.max_queued_requests
        if limit is not None and self.num_live + len(spec.prompts) > self.worker.max_running + limit:
            raise ApiError(f"the server is at capacity ({self.num_live} requests live, "
                           f"max_queued_requests={limit}); retry later", status=503,
                           code="queue_full", error_type="server_overloaded")
        subs = [Submission(f"req-{uuid.uuid4().hex}", i, ids, sampling)
                for i, (ids, sampling) in enumerate(zip(spec.prompts, spec.sampling))]
        group = RequestGroup(self.worker, subs)
        self._held.add(group)
        self.num_live += len(subs)
        self.metrics.num_live.set(self.num_live)
        try:
            await group.start()
        except (ValueError, TypeError) as exc:
            self.release(group)
            raise ApiError(str(exc)) from None
        except BaseException:
            self.release(group)
            raise
        choices = [Choice(self.tokenizer, spec.stop, sub.rid, len(sub.input_ids))
                   for sub in subs]
        return group, choices

    def release(self, group: RequestGroup) -> None:
        """Abort what is still running and give the group's queue places back (idempotent)."""
        group.close()
        if group in self._held:
            self._held.discard(group)
            self.num_live -= len(group.submissions)
            self.metrics.num_live.set(self.num_live)

    async def events(self, group: RequestGroup,
                     choices: list[Choice]) -> AsyncIterator[tuple[int, str, Any]]:
        """(index, new text, event) until every choice finished; a stop string ends its
        engine request early."""
        while not all(c.finished for c in choices):
            event = await group.next_event()
            choice = choices[event.index]
            if choice.finished:
                continue
            delta = choice.apply(event)
            if choice.stopped_by_string:
                group.finish(event.index)
            yield event.index, delta, event

    async def collect(self, spec: GenerationSpec, endpoint: str,
                      request: Request) -> list[Choice]:
        """Run ``spec`` to the end (non-streaming); 500 if the engine failed, _ClientGone
        (requests aborted) if the client disconnects first."""
        start = time.perf_counter()
        group, choices = await self.open(spec)

        async def drain() -> None:
            async for _ in self.events(group, choices):
                pass

        work = asyncio.ensure_future(drain())
        watch = asyncio.ensure_future(_until_disconnect(request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                raise _ClientGone()
            work.result()
        finally:
            work.cancel()
            watch.cancel()
            self.release(group)
        for choice in choices:
            if choice.error:
                raise ApiError(choice.error, status=500, error_type="server_error")
        self.count(endpoint, choices, start)
        return choices

    def count(self, endpoint: str, choices: list[Choice], start: float) -> None:
        self.metrics.e2e_latency.observe(time.perf_counter() - start)
        for choice in choices:
            self.metrics.requests.labels(endpoint, choice.finish_type).inc()

    async def stream(self, spec: GenerationSpec, endpoint: str,
                     render: Callable[..., AsyncIterator[str]]) -> Response:
        """Open the requests now (so errors are a plain 4xx), then stream ``render``'s SSE."""
        start = time.perf_counter()
        group, choices = await self.open(spec)

        async def body() -> AsyncIterator[str]:
            async for chunk in render(self.events(group, choices), choices):
                yield chunk
            if any(c.error for c in choices):
                error = ApiError(next(c.error for c in choices if c.error), status=500,
                                 error_type="server_error")
                yield sse(error.body())
            yield "data: [DONE]\n\n"
            self.count(endpoint, choices, start)

        return _GuardedStream(body(), lambda: self.release(group))


# ---------------------------------------------------------------- output state and shapes


class Choice:
    """Output state of one engine request: tokens, logprobs, text, finish."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...], rid: str, prompt_tokens: int) -> None:
        self.text = TextStream(tokenizer, stop)
        self.rid, self.prompt_tokens = rid, prompt_tokens
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[float, int]]] = []
        self.cached_tokens = self.spec_verify_ct = 0
        self.finish_reason: dict[str, Any] | None = None
        self.error: str | None = None

    def apply(self, event: TokenEvent) -> str:
        """Take one event; returns the new text that may be shown."""
        self.token_ids += event.token_ids
        self.logprobs += event.logprobs
        self.top_logprobs += event.top_logprobs
        self.cached_tokens, self.spec_verify_ct = event.cached_tokens, event.spec_verify_ct
        final = event.finish_reason is not None
        delta = self.text.push(event.token_ids, final=final)
        if self.text.stopped is not None:
            self.finish_reason = {"type": "stop", "matched": self.text.stopped}
        elif final:
            self.finish_reason, self.error = event.finish_reason, event.error
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


def usage(choices: list[Choice]) -> dict[str, Any]:
    prompt = sum(c.prompt_tokens for c in choices)
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in choices)}}


def model_list(name: str, max_context: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                        "owned_by": "lazyspec", "max_model_len": max_context}]}


def _token_text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False) if tokenizer else str(token)


class _Renderer:
    object_name = ""

    def __init__(self, model: str, tokenizer: Any, spec: GenerationSpec) -> None:
        self.model, self.tokenizer, self.spec = model, tokenizer, spec
        self.id = f"{'chatcmpl' if 'chat' in self.object_name else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def envelope(self, choices: list[dict], object_name: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": object_name or self.object_name,
                "created": self.created, "model": self.model, "choices": choices}

    def usage_chunk(self, choices: list[Choice]) -> str:
        return sse({**self.envelope([]), "usage": usage(choices)})


class CompletionRenderer(_Renderer):
    """/v1/completions bodies. ``logprobs: N`` gives each position's N most likely tokens
    plus the sampled one in ``top_logprobs``; echoed prompt tokens have logprob null."""

    object_name = "text_completion"

    def logprobs(self, token_ids: list[int], logprobs: list, tops: list,
                 offset: int) -> dict[str, Any]:
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
        return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": top_dicts,
                "text_offset": offsets}

    def prompt_text(self, index: int) -> str:
        text = self.spec.prompt_texts[index]
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(self.spec.prompts[index])
        return text or ""

    def full(self, choices: list[Choice]) -> dict[str, Any]:
        out = []
        for i, c in enumerate(choices):
            prefix = self.prompt_text(i) if self.spec.echo else ""
            logprobs = None
            if self.spec.logprobs is not None:
                ids, lps, tops = c.token_ids, list(c.logprobs), list(c.top_logprobs)
                if self.spec.echo:
                    echoed = len(self.spec.prompts[i])
                    ids, lps = self.spec.prompts[i] + ids, [None] * echoed + lps
                    tops = [[]] * echoed + tops
                logprobs = self.logprobs(ids, lps, tops, 0)
            out.append({"index": i, "text": prefix + c.text.text, "logprobs": logprobs,
                        "finish_reason": _openai_finish(c)})
        return {**self.envelope(out), "usage": usage(choices)}

    async def stream(self, events, choices: list[Choice]) -> AsyncIterator[str]:
        if self.spec.echo:
            for i in range(len(choices)):
                yield sse(self.envelope([self._chunk(i, self.prompt_text(i), None, None)]))
        async for i, delta, event in events:
            c = choices[i]
            logprobs = None
            if self.spec.logprobs is not None:
                logprobs = self.logprobs(event.token_ids, event.logprobs, event.top_logprobs,
                                         len(c.text.text) - len(delta))
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

    def logprobs(self, token_ids: list[int], logprobs: list[float],
                 tops: list[list[tuple[float, int]]]) -> dict[str, Any]:
        content = []
        for token, lp, top in zip(token_ids, logprobs, tops):
            alternatives = [self._item(t, v) for v, t in top[: self.spec.logprobs]]
            content.append({**self._item(token, lp), "top_logprobs": alternatives})
        return {"content": content}

    def _logprobs_or_none(self, token_ids, logprobs, tops):
        return None if self.spec.logprobs is None else self.logprobs(token_ids, logprobs, tops)

    def full(self, choices: list[Choice]) -> dict[str, Any]:
        c = choices[0]
        choice = {"index": 0, "message": {"role": "assistant", "content": c.text.text},
                  "logprobs": self._logprobs_or_none(c.token_ids, c.logprobs, c.top_logprobs),
                  "finish_reason": _openai_finish(c)}
        return {**self.envelope([choice]), "usage": usage(choices)}

    async def stream(self, events, choices: list[Choice]) -> AsyncIterator[str]:
        chunk = "chat.completion.chunk"
        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}
        yield sse(self.envelope([first], chunk))
        async for i, delta, event in events:
            c = choices[i]
            logprobs = self._logprobs_or_none(event.token_ids, event.logprobs,
                                              event.top_logprobs)
            if delta or c.finished or logprobs is not None:
                body = {"index": i, "delta": {"content": delta} if delta else {},
                        "logprobs": logprobs, "finish_reason": _openai_finish(c)}
                yield sse(self.envelope([body], chunk))
        if self.spec.include_usage:
            yield sse({**self.envelope([], chunk), "usage": usage(choices)})


def _openai_finish(choice: Choice) -> str | None:
    return None if not choice.finished else choice.finish_type


def generate_result(c: Choice, spec: GenerationSpec) -> dict[str, Any]:
    """One SGLang /generate result (cumulative when streamed)."""
    meta = {"id": c.rid, "prompt_tokens": c.prompt_tokens, "completion_tokens": len(c.token_ids),
            "cached_tokens": c.cached_tokens, "finish_reason": c.finish_reason,
            "spec_verify_ct": c.spec_verify_ct}
    if spec.logprobs is not None:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(c.logprobs, c.token_ids)]
        if spec.logprobs:
            meta["output_top_logprobs"] = [[[v, t, None] for v, t in top[: spec.logprobs]]
                                           for top in c.top_logprobs]
    return {"text": c.text.text, "output_ids": list(c.token_ids), "meta_info": meta}


def generate_stream(spec: GenerationSpec):
    async def render(events, choices: list[Choice]) -> AsyncIterator[str]:
        async for i, _, _ in events:
            result = generate_result(choices[i], spec)
            if spec.batched:
                result["index"] = i
            yield sse(result)

    return render


def create_app(worker: EngineWorker, settings: ServerSettings) -> FastAPI:
    """The FastAPI app; ``worker`` must be started (``worker.start()``) before serving."""
    front = _Frontend(worker, settings)
    app = FastAPI(title="lazyspec", docs_url=None, redoc_url=None)
    app.state.frontend = front
    name = settings.served_model_name

    def error_response(error: ApiError) -> Response:
        front.metrics.rejected.labels(str(error.status)).inc()
        # ASCII-escaped JSON: a message may quote client text that is not valid UTF-8
        return Response(json.dumps(error.body()), status_code=error.status,
                        media_type="application/json")

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(ApiError(str(exc.detail), status=exc.status_code))

    @app.exception_handler(_ClientGone)
    async def _client_gone(request: Request, exc: _ClientGone) -> Response:
        return error_response(ApiError("client closed the request", status=499))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in %s", request.url.path)
        return error_response(ApiError(f"internal error: {exc!r}", status=500,
                                       error_type="server_error"))

    async def body_of(request: Request) -> dict:
        return parse_json_body(await request.body())

    @app.get("/health")
    async def health() -> dict:
        if not worker.alive:
            raise ApiError("the engine thread is not running", status=503,
                           error_type="server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return model_list(name, worker.max_context)

    @app.post("/v1/completions")
    async def completions(request: Request):
        spec = parse_completion(await body_of(request), front.tokenizer, front.limits)
        if spec.stream:
            return await front.stream(spec, "completions",
                                      CompletionRenderer(name, front.tokenizer, spec).stream)
        choices = await front.collect(spec, "completions", request)
        return CompletionRenderer(name, front.tokenizer, spec).full(choices)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        spec = parse_chat(await body_of(request), front.tokenizer, front.limits, front.template)
        if spec.stream:
            return await front.stream(spec, "chat",
                                      ChatRenderer(name, front.tokenizer, spec).stream)
        choices = await front.collect(spec, "chat", request)
        return ChatRenderer(name, front.tokenizer, spec).full(choices)

    @app.post("/generate")
    async def generate(request: Request):
        spec = parse_generate(await body_of(request), front.tokenizer, front.limits)
        if spec.stream:
            return await front.stream(spec, "generate", generate_stream(spec))
        choices = await front.collect(spec, "generate", request)
        out = [generate_result(c, spec) for c in choices]
        return out if spec.batched else out[0]

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> dict:
        if not await asyncio.wrap_future(worker.call(worker.flush_cache)):
            raise ApiError("cache not flushed: requests are still running", status=400,
                           code="busy")
        return {"success": True, "message": "Cache flushed."}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict:
        info = await asyncio.wrap_future(worker.call(worker.server_info))
        info.update({"served_model_name": name, "num_http_live_requests": front.num_live,
                     "max_queued_requests": settings.max_queued_requests})
        return json.loads(json.dumps(info, default=str))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(front.metrics.render(), media_type="text/plain; version=0.0.4")

    return app
