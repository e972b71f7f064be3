"""The engine thread: the only code that touches the ``Engine`` while the server runs.

``EngineWorker`` owns the engine in one background thread. The HTTP side sends it commands
through a thread-safe queue (add requests, abort, run a callable such as flush / info); the
thread steps the engine while it is busy and, after every step, pushes each request's new
tokens (and its finish) to that request's asyncio queue with ``loop.call_soon_threadsafe``.
The HTTP side never blocks on the device. ``RequestGroup`` is the asyncio-side handle of the
engine requests that one HTTP request started. The server uses only the engine's serving
surface (``add_request``, ``step``, ``abort``, ``stop``, ``stats``, ...), never its scheduler,
cache, allocators or runner (tests/server/test_engine_boundary.py checks).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lazyspec.scheduler.request import Req, SamplingParams, input_token_logprobs
from lazyspec.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from lazyspec.engine.engine import Engine

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.05


@dataclass(frozen=True)
class Submission:
    """One engine request: ``index`` tags its events within its HTTP request. With ``after``
    (the index of another submission of the same call, with the same prompt) it reaches the
    engine only once that one has finished its prefill, so that it matches the prompt's
    cached checkpoint instead of prefilling it again (``n`` > 1)."""

    rid: str
    index: int
    input_ids: list[int]
    sampling: SamplingParams
    after: int | None = None
    logprob_start_len: int | None = None  # prompt logprobs from this token on
    # the client asked for logprobs: without, the engine computes none (a greedy request's
    # steps then take the argmax alone, ``DecodeBatch.greedy``)
    return_logprob: bool = False


@dataclass(frozen=True)
class TokenEvent:
    """New output of one request since its previous event (cumulative counters)."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[float, int]]]  # per token: the top (logprob, id) pairs
    cached_tokens: int
    spec_verify_ct: int
    finish_reason: dict[str, Any] | None = None  # set on the request's last event
    error: str | None = None  # the engine failed while running this request
    error_status: int = 500  # the HTTP status that error is answered with
    # on the request's first event, when it asked for them: (logprob, id) of the prompt
    # tokens from its logprob_start_len on (the first token's logprob None), and each one's
    # top (logprob, id) pairs (None for the first token)
    input_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None


@dataclass
class _Stream:
    req: Req
    index: int
    loop: asyncio.AbstractEventLoop
    sink: asyncio.Queue
    arrival: float
    sent: int = 0
    accepts_seen: int = 0
    last_time: float | None = None


@dataclass
class _Counters:
    accepted_tokens: int = 0
    verify_steps: int = 0
    finished: dict[str, int] = field(default_factory=dict)


class EngineWorker:
    """Runs ``engine`` in a daemon thread; every public method is safe from any thread."""

    def __init__(self, engine: Engine, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics or ServerMetrics()
        # facts fixed at construction, read by the HTTP side without a round trip
        self.max_running = engine.max_running
        self.max_context = engine.max_request_len
        self.kv_tokens = int(engine.memory_plan["kv_tokens"])
        self.vocab_size = engine.vocab_size
        self.tokenizer = engine.tokenizer
        self.counters = _Counters()
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        # submissions waiting for another request's prefill, by that request's id
        self._held: dict[str, list[tuple[Submission, Any, asyncio.Queue, float]]] = {}
        self._stopping = False
        self.step_started: float | None = None  # monotonic time the running step began
        self._thread = threading.Thread(target=self._run, name="lazyspec-engine", daemon=True)

    # ------------------------------------------------------------------ any thread

    def start(self) -> EngineWorker:
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Abort everything still running, drain the in-flight step and end the thread."""
        self._stopping = True
        self._commands.put(("wake", None, None))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def step_seconds(self) -> float:
        """How long the engine step now running has run (0 between steps)."""
        started = self.step_started
        return 0.0 if started is None else time.monotonic() - started

    def submit(
        self, submissions: list[Submission], loop: asyncio.AbstractEventLoop, sink: asyncio.Queue
    ) -> concurrent.futures.Future:
        """Queue requests; the future fails with ValueError if the engine refuses any (then
        none of them runs). Events go to ``sink`` on ``loop``."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("add", (submissions, loop, sink, time.perf_counter()), future))
        return future

    def finish_early(self, rids: list[str]) -> None:
        """Finish requests early (stop string matched) from any thread; they are cached."""
        self._commands.put(("stop", list(rids), None))

    def abort(self, rids: list[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); their slots and pages free."""
        self._commands.put(("abort", list(rids), None))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` in the engine thread between steps; the future holds its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, future))
        return future

    def fail_all(self, message: str) -> concurrent.futures.Future:
        """Abort every live request between steps; each gets a last event with
        ``error=message`` (its slots and pages free). The future resolves once they are sent."""
        return self.call(lambda engine: self._fail_all(message))

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        while True:
            self._drain_commands(block=not self.engine.busy and not self._stopping)
            if self._stopping:
                self._shutdown()
                return
            if self.engine.busy:
                self.step_started = time.monotonic()
                try:
                    self.engine.step()
                except Exception as exc:  # the device or engine failed: fail, keep serving
                    logger.exception("engine step failed")
                    self._fail_all(f"engine step failed: {exc!r}")
                finally:
                    self.step_started = None
            self._publish()
            self.metrics.observe_engine(self.engine, self._accept_length())

    def _drain_commands(self, block: bool) -> None:
        try:
            command = (
                self._commands.get(timeout=IDLE_POLL_S) if block else self._commands.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            self._handle(*command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, payload: Any, future: concurrent.futures.Future | None) -> None:
        try:
            if kind == "add":
                self._add(*payload)
                result = None
            elif kind == "abort":
                self._drop_held(set(payload))
                for rid in payload:
                    self.engine.abort(rid)
                result = None
            elif kind == "stop":
                for rid in payload:
                    self.engine.stop(rid)
                result = None
            elif kind == "call":
                result = payload(self.engine)
            else:
                result = None
        except Exception as exc:  # reported to the caller; the loop goes on
            if future is None:
                logger.exception("command %s failed", kind)
            else:
                future.set_exception(exc)
            return
        if future is not None:
            future.set_result(result)

    def _add(self, submissions: list[Submission], loop, sink, arrival: float) -> None:
        """Add the submissions without ``after`` now and hold the others. A held one has its
        leader's prompt and sampling but the seed, so the leader's acceptance stands for
        it."""
        now = [sub for sub in submissions if sub.after is None]
        added: list[Req] = []
        try:
            for sub in now:
                added.append(
                    self.engine.add_request(
                        input_ids=sub.input_ids,
                        sampling_params=sub.sampling,
                        return_logprob=sub.return_logprob,
                        rid=sub.rid,
                        logprob_start_len=sub.logprob_start_len,
                    )
                )
        except (ValueError, TypeError):
            for req in added:
                self.engine.abort(req.rid)
            raise
        for sub, req in zip(now, added):
            self._streams[sub.rid] = _Stream(req, sub.index, loop, sink, arrival)
        for sub in submissions:
            if sub.after is not None:
                leader = submissions[sub.after].rid
                self._held.setdefault(leader, []).append((sub, loop, sink, arrival))

    def _release_held(self) -> None:
        """Add the held submissions whose leader has its first output (its prompt's
        checkpoint is in the tree now) or has finished; one the engine refuses gets an error
        event."""
        for leader, held in list(self._held.items()):
            stream = self._streams.get(leader)
            if stream is not None and not stream.req.output_ids and not stream.req.finished:
                continue
            del self._held[leader]
            for sub, loop, sink, arrival in held:
                try:
                    req = self.engine.add_request(
                        input_ids=sub.input_ids,
                        sampling_params=sub.sampling,
                        return_logprob=sub.return_logprob,
                        rid=sub.rid,
                        logprob_start_len=sub.logprob_start_len,
                    )
                except (ValueError, TypeError) as exc:
                    event = TokenEvent(
                        sub.index, [], [], [], 0, 0, {"type": "abort"}, str(exc), 400
                    )
                    _deliver_to(loop, sink, event)
                    continue
                self._streams[sub.rid] = _Stream(req, sub.index, loop, sink, arrival)

    def _drop_held(self, rids: set[str]) -> list[tuple[Submission, Any, asyncio.Queue, float]]:
        """Mutates: forget the held submissions with these ids; returns them."""
        dropped = []
        for leader, held in list(self._held.items()):
            keep = [entry for entry in held if entry[0].rid not in rids]
            dropped += [entry for entry in held if entry[0].rid in rids]
            if keep:
                self._held[leader] = keep
            else:
                del self._held[leader]
        return dropped

    def _publish(self) -> None:
        """Push every request's new tokens / finish to its queue; forget finished ones."""
        now = time.perf_counter()
        for rid, stream in list(self._streams.items()):
            req = stream.req
            num = len(req.output_ids)
            if num == stream.sent and not req.finished:
                continue
            error, status = _engine_error(req)
            event = TokenEvent(
                stream.index,
                req.output_ids[stream.sent : num],
                req.output_logprobs[stream.sent : num],
                req.output_top_logprobs[stream.sent : num],
                req.cached_tokens,
                req.spec_verify_ct,
                req.finish_reason if req.finished else None,
                error=error,
                error_status=status,
            )
            if stream.sent == 0 and req.logprob_start_len is not None:
                event = dataclasses.replace(
                    event,
                    input_logprobs=input_token_logprobs(req),
                    input_top_logprobs=[None] * (req.logprob_start_len == 0)
                    + list(req.input_top_logprobs),
                )
            self._observe_latency(stream, num - stream.sent, now)
            self._observe_accepts(stream)
            stream.sent = num
            if req.finished:
                del self._streams[rid]
                self._observe_finish(req)
            self._deliver(stream, event)
        self._release_held()

    def _deliver(self, stream: _Stream, event: TokenEvent) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.sink.put_nowait, event)
        except RuntimeError:  # the client's event loop is gone: nobody will read this
            if not stream.req.finished:
                self.engine.abort(stream.req.rid)

    def _observe_latency(self, stream: _Stream, num_new: int, now: float) -> None:
        if num_new <= 0:
            return
        if stream.last_time is None:
            self.metrics.time_to_first_token.observe(now - stream.arrival)
            num_new -= 1
        elif num_new:
            gap = (now - stream.last_time) / num_new
            for _ in range(num_new):
                self.metrics.inter_token_latency.observe(gap)
        stream.last_time = now

    def _observe_accepts(self, stream: _Stream) -> None:
        hist = stream.req.accept_hist
        new = hist[stream.accepts_seen :]
        stream.accepts_seen = len(hist)
        self.counters.accepted_tokens += sum(new)
        self.counters.verify_steps += len(new)

    def _observe_finish(self, req: Req) -> None:
        reason = (req.finish_reason or {}).get("type", "unknown")
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
        self.metrics.prompt_tokens.inc(len(req.input_ids))
        self.metrics.cached_tokens.inc(req.cached_tokens)
        self.metrics.generation_tokens.inc(len(req.output_ids))

    def _accept_length(self) -> float | None:
        steps = self.counters.verify_steps
        return self.counters.accepted_tokens / steps if steps else None

    def _fail_all(self, message: str) -> None:
        held = [entry for entries in self._held.values() for entry in entries]
        self._held.clear()
        for sub, loop, sink, _ in held:
            _deliver_to(
                loop, sink, TokenEvent(sub.index, [], [], [], 0, 0, {"type": "abort"}, message)
            )
        for rid, stream in list(self._streams.items()):
            try:
                self.engine.abort(rid)
            except Exception:
                logger.exception("abort of %s failed", rid)
            del self._streams[rid]
            event = TokenEvent(
                stream.index,
                [],
                [],
                [],
                stream.req.cached_tokens,
                stream.req.spec_verify_ct,
                {"type": "abort"},
                error=message,
            )
            self._deliver(stream, event)

    def _shutdown(self) -> None:
        self._held.clear()
        for rid in list(self._streams):
            self.engine.abort(rid)
        try:
            while self.engine.busy:
                self.engine.step()
            self.engine.shutdown()  # several processes: releases the others
        except Exception:
            logger.exception("draining the engine at shutdown failed")
        self._publish()

    # ------------------------------------------------------------------ engine-thread helpers

    def flush_cache(self, engine: Engine) -> bool:
        """(Engine thread) Flush the tree if no request is live; drains the in-flight step."""
        if self._streams or engine.has_requests:
            return False
        while engine.busy:
            engine.step()
        return bool(engine.flush_cache())

    def server_info(self, engine: Engine) -> dict[str, Any]:
        """(Engine thread) ``engine.get_server_info()`` plus the server's own counters."""
        info = engine.get_server_info()
        c = self.counters
        prompt, cached = info["cache_queried_tokens"], info["cache_hit_tokens"]
        info.update(
            {
                # the engine's counters: once per admitted request, whatever its end
                "cache_hit_rate": cached / prompt if prompt else 0.0,
                "num_prompt_tokens": prompt,
                "num_cached_tokens": cached,
                "num_live_requests": len(self._streams),
                "finished_requests": dict(c.finished),
                "server_avg_accept_length": self._accept_length(),
                "vocab_size": engine.vocab_size,
            }
        )
        return info


def _deliver_to(loop: asyncio.AbstractEventLoop, sink: asyncio.Queue, event: TokenEvent) -> None:
    """Put ``event`` on ``sink`` in ``loop`` (nothing if that loop is gone)."""
    try:
        loop.call_soon_threadsafe(sink.put_nowait, event)
    except RuntimeError:
        pass


def _engine_error(req: Req) -> tuple[str | None, int]:
    """(message, HTTP status) of a request the engine ended with an error (an abort that
    says why: it could not be prepared, or can never fit); (None, 500) otherwise."""
    reason = req.finish_reason if req.finished else None
    if reason and reason.get("type") == "abort" and reason.get("message"):
        return str(reason["message"]), int(reason.get("status_code", 500))
    return None, 500


class RequestGroup:
    """The engine requests of one HTTP request, seen from the asyncio side."""

    def __init__(self, worker: EngineWorker, submissions: list[Submission]) -> None:
        self.worker = worker
        self.submissions = submissions
        self.events: asyncio.Queue = asyncio.Queue()
        self._open = {sub.rid for sub in submissions}

    async def start(self) -> None:
        """Hand the requests to the engine; ValueError (nothing runs) if it refuses one."""
        future = self.worker.submit(self.submissions, asyncio.get_running_loop(), self.events)
        try:
            await asyncio.wrap_future(future)
        except (ValueError, TypeError):
            self._open.clear()  # refused as a whole: nothing to abort
            raise

    async def next_event(self, timeout: float | None = None) -> TokenEvent:
        """The next event of any request of the group (asyncio.TimeoutError on timeout)."""
        event = await asyncio.wait_for(self.events.get(), timeout)
        if event.finish_reason is not None:
            self._open.discard(self.submissions[event.index].rid)
        return event

    @property
    def done(self) -> bool:
        return not self._open

    def finish(self, index: int) -> None:
        """Stop request ``index`` early (a stop string matched); its checkpoint is cached."""
        rid = self.submissions[index].rid
        if rid in self._open:
            self._open.discard(rid)
            self.worker.finish_early([rid])

    def close(self) -> None:
        """Abort every request of the group that has not finished (client gone, error)."""
        if self._open:
            self.worker.abort(sorted(self._open))
            self._open.clear()
