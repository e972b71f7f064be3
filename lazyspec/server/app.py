"""The HTTP server: OpenAI-compatible and SGLang-native endpoints over an ``EngineWorker``.

``create_app`` builds a FastAPI app. Handlers parse, validate and tokenize the body
(``protocol``) in a thread pool, off the event loop; submit engine requests through the
worker's command queue, and read their tokens from an asyncio queue; they never touch the
engine. Middleware (``guard``) checks the Host header, the API key and the body size first.
Errors are answered as ``{"error": {message, type, param, code}}`` with a 4xx/5xx status.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lazyspec.scheduler.grammar import grammar_of
from lazyspec.server.chat import ChatTemplate
from lazyspec.server.fields import check_fields
from lazyspec.server.guard import (
    DEFAULT_MAX_REQUEST_BYTES,
    LOOPBACK_HOSTS,
    check_json_content_type,
    guard_stack,
)
from lazyspec.server.limits import ApiError, Limits, max_body_prompt_chars, max_prompt_chars
from lazyspec.server.protocol import GenerationSpec, parse_chat, parse_completion, parse_generate
from lazyspec.server.readers import parse_json_body
from lazyspec.server.render import (
    ChatRenderer,
    Choice,
    CompletionRenderer,
    generate_result,
    generate_stream,
    model_list,
    sse,
)
from lazyspec.server.schema import chat_body, completion_body, generate_body, request_body
from lazyspec.server.worker import EngineWorker, RequestGroup, Submission, TokenEvent

logger = logging.getLogger(__name__)

NUM_PARSE_THREADS = 4  # requests parsed and tokenized at once (HF tokenizers drop the GIL)
# bodies up to this size parse in a pool of their own, so that a few large bodies (seconds
# of tokenizing each, within the limits) never make an ordinary request wait for a thread
SMALL_BODY_BYTES = 64 * 2**10
NUM_SMALL_PARSE_THREADS = 2
NUM_TEXT_THREADS = 2  # detokenizers of long outputs, apart so big prompts cannot stall them
INLINE_DETOKENIZE_TOKENS = 2048  # shorter outputs decode on the loop (well under 1 ms)
RETRY_AFTER_S = 5  # the Retry-After header of every 503
DRAIN_POLL_S = 0.05
CLOSE_WAIT_S = 10.0  # after aborting at shutdown: time for the error events to go out
SHUTDOWN_MESSAGE = "the server is shutting down"


ENDPOINTS = {parse_completion: "completions", parse_chat: "chat", parse_generate: "generate"}


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    max_queued_requests: int | None = None  # None: unbounded
    chat_template: ChatTemplate | None = None
    api_key: str | None = None  # None: no key needed
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    allowed_hosts: tuple[str, ...] | None = LOOPBACK_HOSTS  # Host names; None: no check
    allowed_origins: tuple[str, ...] = ()  # CORS origins ("*": any); (): no CORS headers
    stream_interval: int = 1  # output tokens per streamed chunk (the last may hold fewer)
    watchdog_timeout: float | None = None  # a step running longer makes /health 503


class _GuardedStream(StreamingResponse):
    """A streaming response whose ``on_close`` runs however the stream ends (done, error,
    client gone), even if the body iterator never started."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
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
        self.tokenizer = worker.tokenizer
        self.template = settings.chat_template or ChatTemplate(None)
        queued = settings.max_queued_requests
        self.limits = Limits(
            worker.vocab_size,
            worker.max_context,
            (settings.served_model_name,),
            max_prompt_chars(self.tokenizer, worker.max_context),
            None if queued is None else worker.max_running + queued,
            max_body_prompt_chars(self.tokenizer, worker.max_context, worker.kv_tokens),
        )
        self.parse_pool = ThreadPoolExecutor(NUM_PARSE_THREADS, "lazyspec-parse")
        self.small_parse_pool = ThreadPoolExecutor(NUM_SMALL_PARSE_THREADS, "lazyspec-parse-small")
        self.text_pool = ThreadPoolExecutor(NUM_TEXT_THREADS, "lazyspec-detokenize")
        self.num_live = 0
        self._held: set[RequestGroup] = set()  # groups whose queue places are taken
        self.draining = False  # set once by drain(): nothing is admitted afterwards
        self._abort_now = False
        self._watchdog_logged: float | None = None  # the stalled step already logged

    async def parse(
        self, parser: Callable[..., GenerationSpec], raw: bytes, *args: Any
    ) -> GenerationSpec:
        """``parser(body, tokenizer, limits, *args)`` of the JSON ``raw``, run in a parse
        pool so that a long prompt never blocks the event loop (small bodies in their own
        pool, so that they never wait behind large ones)."""

        def work() -> GenerationSpec:
            body = parse_json_body(raw)
            check_fields(body, ENDPOINTS[parser])
            spec = parser(body, self.tokenizer, self.limits, *args)
            for sampling in spec.sampling:
                try:  # compiled here, off the engine thread; the engine finds it cached
                    self.worker.engine.check_grammar(sampling)
                except ValueError as exc:
                    raise ApiError(str(exc), param=grammar_of(sampling)[0]) from None
            return spec

        pool = self.small_parse_pool if len(raw) <= SMALL_BODY_BYTES else self.parse_pool
        return await asyncio.get_running_loop().run_in_executor(pool, work)

    async def open(self, spec: GenerationSpec) -> tuple[RequestGroup, list[Choice]]:
        """Admit ``spec``'s requests (503 when the queue is full or the server is shutting
        down, 400 if the engine refuses)."""
        self.check_admitting()
        limit = self.settings.max_queued_requests
        wanted = self.num_live + len(spec.prompts)
        if limit is not None and len(spec.prompts) > self.worker.max_running + limit:
            raise ApiError(  # no retry can help: the request alone exceeds the capacity
                f"{len(spec.prompts)} prompts exceed the server's capacity "
                f"({self.worker.max_running} running + max_queued_requests={limit})",
                code="too_many_prompts",
            )
        if limit is not None and wanted > self.worker.max_running + limit:
            raise ApiError(
                f"the server is at capacity ({self.num_live} requests live, "
                f"max_queued_requests={limit}); retry later",
                status=503,
                code="queue_full",
                error_type="server_overloaded",
            )
        # copy j > 0 of a prompt waits for copy 0's prefill, then matches its checkpoint
        subs = [
            Submission(
                f"req-{uuid.uuid4().hex}",
                i,
                ids,
                sampling,
                i - i % spec.n if i % spec.n else None,
                spec.logprob_start_len,
                spec.logprobs is not None,
            )
            for i, (ids, sampling) in enumerate(zip(spec.prompts, spec.sampling))
        ]
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
        choices = [Choice(self.tokenizer, spec, sub.rid, len(sub.input_ids)) for sub in subs]
        return group, choices

    def check_watchdog(self) -> None:
        """ApiError 503 (logged once per stalled step) while the engine step now running has
        run longer than ``settings.watchdog_timeout``."""
        limit = self.settings.watchdog_timeout
        seconds = self.worker.step_seconds()
        if limit is None or seconds <= limit:
            self._watchdog_logged = None
            return
        if self._watchdog_logged != self.worker.step_started:
            self._watchdog_logged = self.worker.step_started
            logger.error("watchdog: an engine step has run %.1f s (limit %.1f s)", seconds, limit)
        raise ApiError(
            f"an engine step has run {seconds:.1f} s, over --watchdog-timeout={limit}",
            status=503,
            code="watchdog",
            error_type="server_error",
        )

    def check_admitting(self) -> None:
        """ApiError 503 once ``drain`` has begun."""
        if self.draining:
            raise ApiError(
                SHUTDOWN_MESSAGE, status=503, code="shutting_down", error_type="server_unavailable"
            )

    async def drain(self, timeout: float) -> int:
        """Graceful shutdown. Mutates: from now on nothing is admitted (503). Live requests
        run for up to ``timeout`` seconds (``abort_now`` cuts the wait), then the rest are
        aborted: each stream ends with an error event and ``[DONE]``, each other request with
        a 500. Returns once their answers are out (or after CLOSE_WAIT_S); the number aborted."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.num_live and not self._abort_now and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        num_aborted = self.num_live
        if num_aborted:
            logger.info("aborting %d requests still live at shutdown", num_aborted)
            await asyncio.wrap_future(self.worker.fail_all(SHUTDOWN_MESSAGE))
            deadline = loop.time() + CLOSE_WAIT_S
            while self.num_live and loop.time() < deadline:
                await asyncio.sleep(DRAIN_POLL_S)
        return num_aborted

    def abort_now(self) -> None:
        """Cut a running ``drain``'s wait: abort the live requests now (safe before it)."""
        self._abort_now = True

    def release(self, group: RequestGroup) -> None:
        """Abort what is still running and give the group's queue places back (idempotent)."""
        group.close()
        if group in self._held:
            self._held.discard(group)
            self.num_live -= len(group.submissions)
            self.metrics.num_live.set(self.num_live)

    async def events(
        self, group: RequestGroup, choices: list[Choice], interval: int = 1
    ) -> AsyncIterator[tuple[int, str, Any]]:
        """(index, new text, event) until every choice finished; a stop string ends its
        engine request early. With ``interval`` > 1 a choice's events are merged until they
        hold that many tokens (or it finishes)."""
        pending: dict[int, TokenEvent] = {}
        while not all(c.finished for c in choices):
            event = await group.next_event()
            if event.index in pending:
                event = merge_events(pending.pop(event.index), event)
            if event.finish_reason is None and len(event.token_ids) < interval:
                pending[event.index] = event
                continue
            choice = choices[event.index]
            if choice.finished:
                continue
            if len(choice.token_ids) < INLINE_DETOKENIZE_TOKENS:
                delta = choice.apply(event)
            else:  # each event decodes the whole output again: too slow for the loop
                loop = asyncio.get_running_loop()
                delta = await loop.run_in_executor(self.text_pool, choice.apply, event)
            if choice.stopped_by_string:
                group.finish(event.index)
            yield event.index, delta, event

    async def collect(self, spec: GenerationSpec, endpoint: str, request: Request) -> list[Choice]:
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
                raise choice.error
        self.count(endpoint, choices, start)
        return choices

    def count(self, endpoint: str, choices: list[Choice], start: float) -> None:
        self.metrics.e2e_latency.observe(time.perf_counter() - start)
        for choice in choices:
            self.metrics.requests.labels(endpoint, choice.finish_type).inc()

    async def stream(
        self, spec: GenerationSpec, endpoint: str, render: Callable[..., AsyncIterator[str]]
    ) -> Response:
        """Open the requests now (so errors are a plain 4xx), then stream ``render``'s SSE."""
        start = time.perf_counter()
        group, choices = await self.open(spec)

        async def body() -> AsyncIterator[str]:
            events = self.events(group, choices, self.settings.stream_interval)
            async for chunk in render(events, choices):
                yield chunk
            errors = [c.error for c in choices if c.error]
            if errors:
                yield sse(errors[0].body())
            yield "data: [DONE]\n\n"
            self.count(endpoint, choices, start)

        return _GuardedStream(body(), lambda: self.release(group))


def merge_events(first: TokenEvent, then: TokenEvent) -> TokenEvent:
    """One event holding ``first``'s tokens then ``then``'s (its counters and finish)."""
    return dataclasses.replace(
        then,
        token_ids=first.token_ids + then.token_ids,
        logprobs=first.logprobs + then.logprobs,
        top_logprobs=first.top_logprobs + then.top_logprobs,
        input_logprobs=first.input_logprobs or then.input_logprobs,
        input_top_logprobs=first.input_top_logprobs or then.input_top_logprobs,
    )


def retry_after(status: int) -> dict[str, str] | None:
    """The headers of an answer with ``status``: a Retry-After on every 503."""
    return {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None


def create_app(worker: EngineWorker, settings: ServerSettings) -> FastAPI:
    """The FastAPI app; ``worker`` must be started (``worker.start()``) before serving."""
    front = _Frontend(worker, settings)
    app = FastAPI(title="lazyspec", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.frontend = front
    name = settings.served_model_name

    def error_response(error: ApiError) -> Response:
        front.metrics.rejected.labels(str(error.status)).inc()
        # ASCII-escaped JSON: a message may quote client text that is not valid UTF-8
        return Response(
            json.dumps(error.body()),
            status_code=error.status,
            media_type="application/json",
            headers=retry_after(error.status),
        )

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
        return error_response(
            ApiError(f"internal error: {exc!r}", status=500, error_type="server_error")
        )

    guard_stack(app, settings, error_response)

    async def body_of(request: Request) -> bytes:
        check_json_content_type(request.headers.get("content-type"))
        return await request.body()

    @app.get("/health")
    @app.head("/health", include_in_schema=False)
    async def health() -> dict:
        front.check_admitting()
        if not worker.alive:
            raise ApiError(
                "the engine thread is not running", status=503, error_type="server_error"
            )
        front.check_watchdog()
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return model_list(name, worker.max_context)

    async def openai_reply(request: Request, spec, endpoint: str, renderer_class):
        """An OpenAI endpoint's answer: server-sent events or one body, by ``spec.stream``."""
        renderer = renderer_class(name, front.tokenizer, spec)
        if spec.stream:
            return await front.stream(spec, endpoint, renderer.stream)
        return renderer.full(await front.collect(spec, endpoint, request))

    @app.post("/v1/completions", openapi_extra=request_body(completion_body(front.limits)))
    async def completions(request: Request):
        spec = await front.parse(parse_completion, await body_of(request))
        return await openai_reply(request, spec, "completions", CompletionRenderer)

    @app.post("/v1/chat/completions", openapi_extra=request_body(chat_body(front.limits)))
    async def chat(request: Request):
        spec = await front.parse(parse_chat, await body_of(request), front.template)
        return await openai_reply(request, spec, "chat", ChatRenderer)

    @app.post("/generate", openapi_extra=request_body(generate_body(front.limits)))
    async def generate(request: Request):
        spec = await front.parse(parse_generate, await body_of(request))
        if spec.stream:
            return await front.stream(spec, "generate", generate_stream(spec))
        choices = await front.collect(spec, "generate", request)
        out = [generate_result(c, spec) for c in choices]
        return out if spec.batched else out[0]

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> dict:
        if request.headers.get("content-type") is not None or await request.body():
            check_json_content_type(request.headers.get("content-type"))  # no form, no text
        if not await asyncio.wrap_future(worker.call(worker.flush_cache)):
            raise ApiError("cache not flushed: requests are still running", status=400, code="busy")
        return {"success": True, "message": "Cache flushed."}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict:
        info = await asyncio.wrap_future(worker.call(worker.server_info))
        info.update(
            {
                "served_model_name": name,
                "num_http_live_requests": front.num_live,
                "max_queued_requests": settings.max_queued_requests,
            }
        )
        return json.loads(json.dumps(info, default=str))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(front.metrics.render(), media_type="text/plain; version=0.0.4")

    return app
