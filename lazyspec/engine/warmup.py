"""Start-up compilation of the program table (``programs.py``).

``TableCompiler`` compiles every entry ahead of a call (``Program.compile``) in a thread
pool, in order of likely use (``warm_order``): an XLA compilation releases the GIL, tracing
and lowering do not, so the threads lower one program at a time, the earliest in that order
first (``LoweringGate``), and compile side by side. The programs a first request needs
(``first_request_keys``) come first, so an engine can serve once they are compiled while
the rest compile on. Each executable is bound to the runner as it is compiled
(``Runner.bind``), which calls it from then on; a launch of a program still compiling waits
for it (``TableCompiler.wait``, called by the runner) rather than compiling a second copy.
Where JAX's persistent cache is on, each program is first looked up in the executable store
beside it (``executables.py``): a warm start loads the table without tracing it.

``CompileCounts`` reads JAX's monitoring events while the table compiles: XLA compilations
and their seconds, and the persistent compilation cache's hits and misses.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import heapq
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from lazyspec.engine.executables import ExecutableStore, store_for_jax_cache
from lazyspec.engine.programs import (
    DECODE,
    EXTEND,
    FINISH,
    FORWARD,
    MASK,
    SEED,
    TABLE,
    Program,
    ProgramKey,
)
from lazyspec.scheduler.layout import Layout

if TYPE_CHECKING:
    from lazyspec.engine.runner import Runner

logger = logging.getLogger(__name__)

# JAX's events: one per backend compilation, a persistent-cache read included (its seconds
# are the read's); one per persistent-cache hit; one per miss written to the cache
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HITS = "/jax/compilation_cache/cache_hits"
CACHE_MISSES = "/jax/compilation_cache/cache_misses"
THREAD_NAME = "lazyspec-compile"
# Threads compiling a program table where ``EngineConfig.compile_threads`` is unset, by
# platform; elsewhere the CPU count, at most eight (``table_threads``). On a GPU, compilations
# side by side slow each other far more than they overlap: the 2.5 B preset's table on an
# H100 spent ~8 s a program with eight threads (433 s for 52 programs, 189 s of wall time,
# GEMM autotuning off) against ~1.5 s a program one at a time (81 s for 59). Two threads
# let one program trace and lower (one at a time: ``LoweringGate``) while another compiles.
# (benchmarks/log/2026-12-07-executable-store.md; the sweep over 1, 2, 4 and 8 threads is
# ``ENGINE_STARTUP_THREADS`` in benchmarks/tools/device_checks.sh.)
TABLE_THREADS = {"gpu": 2}
# the step kinds in the order a batch of one size needs them
_KIND_RANK = {kind: rank for rank, kind in enumerate((EXTEND, DECODE, FORWARD, FINISH))}


def first_request_keys(layout: Layout, keys: Iterable[ProgramKey]) -> frozenset[ProgramKey]:
    """The programs a first request needs: the table-chunk, count-seed and mask-update
    programs, the smallest extend bucket, and the decode programs of a batch of one (each
    form; their second copies, and a grammar row's split pair, are left to compile on: the
    runner calls the first copy until its second is compiled)."""
    num_verify = layout.decode_num_verify(1)
    one = (layout.decode_rows(layout.decode_buckets[0], num_verify), num_verify)
    return frozenset(
        key
        for key in keys
        if key.kind in (TABLE, SEED, MASK)
        or (key.kind == EXTEND and (key.rows, key.tokens) == layout.extend_shapes[0])
        or (key.kind == DECODE and (key.rows, key.tokens) == one and not key.copy)
    )


def compiled_before(key: ProgramKey, cache_used: bool) -> ProgramKey | None:
    """The program whose compilation ``key``'s waits for, if any: a split step's finish
    lowers its forward (compile that once); with the persistent cache on (``cache_used``),
    a second copy of a decode program, the first copy's HLO, is read from the cache once
    the first copy's compilation wrote it (without the cache it compiles at once)."""
    if key.kind == FINISH:
        return dataclasses.replace(key, kind=FORWARD)
    if key.copy and cache_used:
        return dataclasses.replace(key, copy=0)
    return None


def warm_order(layout: Layout, keys: Sequence[ProgramKey]) -> tuple[ProgramKey, ...]:
    """``keys`` in the order they are compiled: the first request's programs and their
    second copies, then by batch rows (fewer first: a lightly loaded server meets them
    first), then step kind, tokens and form; the second copies of the decode programs last
    in each of the two groups (each a cache read once its first copy is compiled,
    ``compiled_before``). A split step's forward comes before its finish (which lowers
    after it)."""
    first = first_request_keys(layout, keys)

    def rank(key: ProgramKey) -> tuple:
        kind = _KIND_RANK.get(key.kind, -1)
        group = dataclasses.replace(key, copy=0) not in first
        return (group, key.copy, key.rows, kind, key.tokens, not key.greedy)

    return tuple(sorted(keys, key=rank))


@dataclasses.dataclass
class CompileCounts:
    """What JAX compiled while a table compiled. With the persistent cache on, every
    backend compilation is a hit (read from disk) or a miss (compiled, then written)."""

    num_backend_compiles: int = 0
    compile_seconds: float = 0.0  # summed over threads
    cache_hits: int = 0
    cache_misses: int = 0

    @property
    def num_xla_compiles(self) -> int:
        """Programs XLA compiled (the backend compilations not read from the cache)."""
        return self.num_backend_compiles - self.cache_hits


class CompileListener:
    """Counts JAX's compile events (from any thread) between ``start`` and ``stop``."""

    def __init__(self) -> None:
        self.counts = CompileCounts()
        self._lock = threading.Lock()
        self._local = threading.local()  # each thread's XLA compilations

    def _on_duration(self, event: str, seconds: float, **_: object) -> None:
        if event == BACKEND_COMPILE:
            with self._lock:
                self.counts.num_backend_compiles += 1
                self.counts.compile_seconds += seconds
            self._local.compiles = self.thread_xla_compiles() + 1

    def _on_event(self, event: str, **_: object) -> None:
        field = {CACHE_HITS: "cache_hits", CACHE_MISSES: "cache_misses"}.get(event)
        if field is not None:
            with self._lock:
                setattr(self.counts, field, getattr(self.counts, field) + 1)
        if event == CACHE_HITS:  # a backend compilation that read the cache
            self._local.compiles = self.thread_xla_compiles() - 1

    def thread_xla_compiles(self) -> int:
        """Programs XLA compiled in the calling thread (JAX records a compilation's events in
        the thread that compiles): not read from the persistent cache, nor found compiled
        in this process."""
        return getattr(self._local, "compiles", 0)

    def start(self) -> None:
        import jax

        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)

    def stop(self) -> None:
        import jax

        jax.monitoring.unregister_event_duration_listener(self._on_duration)
        jax.monitoring.unregister_event_listener(self._on_event)

    def snapshot(self) -> CompileCounts:
        with self._lock:
            return dataclasses.replace(self.counts)


def compile_and_store(
    program: Program,
    lowered: Any,
    store: ExecutableStore | None,
    listener: CompileListener,
) -> Any:
    """``program``'s ``lowered`` form compiled and, with a ``store``, written to it as the
    store keeps what a cache held or not (``ExecutableStore.save``): ``listener`` (started)
    tells whether XLA compiled it in this call."""
    compiles = listener.thread_xla_compiles()
    compiled = lowered.compile()
    if store is not None:
        store.save(program, compiled, listener.thread_xla_compiles() > compiles)
    return compiled


class LoweringGate:
    """Lets one thread at a time trace and lower a program, of those waiting the one of the
    lowest rank. Lowering holds the GIL: side by side, lowerings only slow each other, and
    the first request's programs would share it with the whole table's (a warm start of
    the README server, its programs read from the persistent cache: 12 s to ready with
    one compile thread, 30-42 s with eight, on two CPU cores)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: list[int] = []  # a heap of the waiting threads' ranks
        self._busy = False

    @contextlib.contextmanager
    def turn(self, rank: int) -> Iterator[None]:
        """Wait until no thread holds the gate and no waiting one has a lower ``rank``;
        hold it for the ``with`` block."""
        with self._cond:
            heapq.heappush(self._waiting, rank)
            while self._busy or self._waiting[0] != rank:
                self._cond.wait()
            heapq.heappop(self._waiting)
            self._busy = True
        try:
            yield
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()


def table_threads(platform: str | None, most: int = 8) -> int:
    """Threads compiling a program table on ``platform`` by default: its ``TABLE_THREADS``
    entry, else this process's CPU count, at most ``most``."""
    if platform in TABLE_THREADS:
        return TABLE_THREADS[platform]
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return min(most, len(cpus) if cpus else os.cpu_count() or 1)


class TableCompiler:
    """Compiles a program table in a thread pool, in ``order``; safe from any thread."""

    def __init__(
        self,
        programs: Sequence[Program],
        order: Sequence[ProgramKey],
        first: frozenset[ProgramKey],
        num_threads: int | None = None,
        bind: Callable[[ProgramKey, Any], None] | None = None,
        store: ExecutableStore | None = None,
    ) -> None:
        """``order``: the keys of ``programs`` as they are submitted; ``first``: the keys
        that make the engine ready. ``num_threads``: default ``table_threads(None)`` (tracing
        holds the GIL, so more than a few gain little). ``bind`` is handed each program's
        executable as it is compiled (``Runner.bind``), before the program counts as
        compiled; ``store``: where executables are loaded from instead of compiled, and
        written once compiled (``executables``)."""
        by_key = {program.key: program for program in programs}
        assert len(order) == len(by_key) and set(order) == set(by_key), "not the table's keys"
        self.order, self.first = tuple(order), first
        self._programs = by_key
        self._rank = {key: rank for rank, key in enumerate(self.order)}
        self._gate = LoweringGate()
        self.num_threads = num_threads or table_threads(None)
        self._futures: dict[ProgramKey, concurrent.futures.Future] = {}
        self._listener = CompileListener()
        self._lock = threading.Lock()
        self._num_done = self._num_cancelled = 0
        self._finished = threading.Event()  # set once every program is done, counts read
        self._started = self._ready_s = self._done_s = None
        self._cache_used = False  # whether the persistent compilation cache is on (start)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._bind, self._store = bind, store
        self._num_loaded = 0  # executables read from the store

    def start(self) -> TableCompiler:
        """Submit every program, in order; returns at once."""
        self._started = time.perf_counter()
        self._cache_used = _settle_cache_use()
        self._listener.start()
        self._pool = concurrent.futures.ThreadPoolExecutor(self.num_threads, THREAD_NAME)
        for key in self.order:
            self._futures[key] = future = self._pool.submit(self._compile, key)
            future.add_done_callback(self._on_done)
        self._pool.shutdown(wait=False)  # the threads end once the queue is empty
        return self

    def _compile(self, key: ProgramKey) -> None:
        before = compiled_before(key, self._cache_used)
        if before in self._futures:
            self._futures[before].result()
        program = self._programs[key]
        compiled = None if self._store is None else self._store.load(program)
        if compiled is not None:
            with self._lock:
                self._num_loaded += 1
        else:
            with self._gate.turn(self._rank[key]):
                lowered = program.lower()
            compiled = compile_and_store(program, lowered, self._store, self._listener)
        if self._bind is not None:
            self._bind(key, compiled)

    def _on_done(self, future: concurrent.futures.Future) -> None:
        if not future.cancelled() and future.exception() is not None:
            logger.error("compiling a program failed", exc_info=future.exception())
        with self._lock:
            self._num_done += 1
            self._num_cancelled += future.cancelled()
            now = time.perf_counter() - self._started
            first = [self._futures.get(key) for key in self.first]
            if self._ready_s is None and all(f is not None and f.done() for f in first):
                self._ready_s = now
            if self._num_done < len(self.order):
                return
            self._done_s = now
        self._listener.stop()
        status = self.status()
        logger.info(
            "program table: %d programs compiled (%d cancelled) in %.1f s (ready after %.1f "
            "s), %d XLA compilations, %.1f s of compiling; persistent cache: %d hits, %d "
            "misses; %d programs loaded as stored",
            status["num_programs_compiled"],
            status["num_programs_cancelled"],
            status["all_seconds"],
            status["ready_seconds"] or 0.0,
            status["num_xla_compiles"],
            status["compile_seconds"],
            status["persistent_cache_hits"],
            status["persistent_cache_misses"],
            status["num_programs_loaded"],
        )
        self._finished.set()

    def wait(self, key: ProgramKey) -> None:
        """Block until ``key``'s program is compiled; raises its compilation's error."""
        future = self._futures.get(key)
        if future is not None:
            future.result()

    def wait_for(
        self, keys: Iterable[ProgramKey], progress: Callable[[int, int], None] | None = None
    ) -> None:
        """Block until the programs of ``keys`` are compiled; ``progress(done, total)`` is
        called with 0 first and after each (in this thread; what it raises propagates)."""
        futures = [self._futures[key] for key in keys]
        if progress is not None:
            progress(0, len(futures))
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            future.result()
            if progress is not None:
                progress(done, len(futures))

    def join(self) -> None:
        """Block until every program is compiled (or cancelled) and ``status`` is final;
        raises the first compilation's error."""
        self.wait_for(self.order)
        self._finished.wait()

    def compiled(self, key: ProgramKey) -> bool:
        """True once ``key``'s program is compiled (or failed to)."""
        future = self._futures.get(key)
        return future is not None and future.done()

    @property
    def done(self) -> bool:
        """True once every program is compiled (or cancelled)."""
        return self._done_s is not None

    def cancel(self) -> None:
        """Drop the programs not started (those compiling run to their end)."""
        for future in self._futures.values():
            future.cancel()

    def status(self) -> dict:
        """The table's progress and what compiling it took so far."""
        counts = self._listener.snapshot()
        return {
            "num_programs": len(self.order),
            "num_programs_first": len(self.first),
            "num_programs_compiled": self._num_done - self._num_cancelled,
            "num_programs_cancelled": self._num_cancelled,
            "compile_threads": self.num_threads,
            "ready": self._ready_s is not None,
            "done": self.done,
            "ready_seconds": self._ready_s,
            "all_seconds": self._done_s,
            "num_xla_compiles": counts.num_xla_compiles,
            "compile_seconds": round(counts.compile_seconds, 3),
            "persistent_cache_hits": counts.cache_hits,
            "persistent_cache_misses": counts.cache_misses,
            "num_programs_loaded": self._num_loaded,
        }


def _settle_cache_use() -> bool:
    """Have JAX set up its persistent compilation cache now, in this thread; whether it is
    used. JAX does so at its first compilation, and threads that compile first together
    race (jax 0.10): one may find the cache not yet decided on (``is_cache_used``) or not
    yet built (``_get_cache``) and compile without it, neither reading nor writing its
    entry."""
    try:
        import jax.extend.backend
        from jax._src import compilation_cache

        backend = jax.extend.backend.get_backend()
        if compilation_cache.is_cache_used(backend):
            compilation_cache._get_cache(backend)
            return True
    except (ImportError, AttributeError):  # another jax: its first compilations decide
        logger.debug("could not set up the compilation cache ahead", exc_info=True)
    return False


def compile_table(
    runner: Runner,
    progress: Callable[[int, int], None] | None = None,
    background: bool = False,
    num_threads: int | None = None,
) -> TableCompiler:
    """Compile ``runner``'s table in a thread pool (``TableCompiler``), then run each program
    waited for once through the calls serving makes (``Runner.warm``: no compilation). Waits
    for every program, or with ``background`` only for the first request's: the rest
    compile on, and a launch that needs one of them waits for it (``Runner.compiling``).
    ``progress(done, total)`` counts the programs waited for (``TableCompiler.wait_for``);
    what it raises cancels the programs not started and propagates."""
    keys = runner.program_keys
    first = first_request_keys(runner.layout, keys)
    order = warm_order(runner.layout, keys)
    store = store_for_jax_cache(list(runner.sharding.mesh.devices.flat))
    table = runner.program_table()
    num_threads = num_threads or table_threads(runner.sharding.platform)
    compiler = TableCompiler(table, order, first, num_threads, bind=runner.bind, store=store)
    compiler.start()
    runner.compiling = compiler
    waited = [key for key in order if key in first or not background]
    try:
        compiler.wait_for(waited, progress)
    except BaseException:
        compiler.cancel()
        raise
    if not background:
        compiler.join()
        runner.compiling = None
    for key in waited:
        runner.warm(key)
    return compiler


def warm_in_turn(runner: Runner, progress: Callable[[int, int], None] | None = None) -> None:
    """Run every program of ``runner``'s table once, in turn, each compiling as it is called
    (with several processes: the others compile as they follow each call)."""
    keys = warm_order(runner.layout, runner.program_keys)
    for done, key in enumerate(keys):
        if progress is not None:
            progress(done, len(keys))
        runner.warm(key)
    if progress is not None:
        progress(len(keys), len(keys))
