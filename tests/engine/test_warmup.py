"""Start-up compilation (``engine/warmup.py``): the table compiled in a thread pool, the
programs a first request needs first; a request that arrives while the rest compile waits
for its programs and gets the same tokens, and no program compiles in the serving thread or
twice; a warm restart loads every program stored, compiling nothing."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import shutil
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import jax
import pytest

from lazyspec.config import EngineConfig
from lazyspec.engine import warmup
from lazyspec.engine.engine import Engine
from lazyspec.engine.executables import STORE_DIR
from lazyspec.engine.programs import (
    DECODE,
    EXTEND,
    FINISH,
    FORWARD,
    MASK,
    SEED,
    SPLIT,
    TABLE,
    ProgramKey,
    program_keys,
)
from lazyspec.engine.warmup import (
    BACKEND_COMPILE,
    THREAD_NAME,
    LoweringGate,
    TableCompiler,
    compile_table,
    first_request_keys,
    table_threads,
    warm_order,
)
from lazyspec.scheduler.layout import plan_memory
from lazyspec.server.lifecycle import enable_compilation_cache
from lazyspec.testing.tiny_models import NEMOTRON_HF, TINY_CHUNKS, build_tiny_model

CACHE_SETTINGS = (
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
)

SETTINGS = dict(TINY_CHUNKS, max_running_requests=4, max_total_tokens=1024, context_length=128)


def _model(**overrides) -> SimpleNamespace:
    """A tiny model of a config of its own: no program of it is compiled yet."""
    return build_tiny_model({**NEMOTRON_HF, **overrides})


@contextlib.contextmanager
def _compiles_by_thread() -> Iterator[list[tuple[str, str]]]:
    """(thread name, function name) of every backend compilation inside the block."""
    seen: list[tuple[str, str]] = []

    def listen(event: str, seconds: float, fun_name: str = "", **_: object) -> None:
        if event == BACKEND_COMPILE:
            seen.append((threading.current_thread().name, fun_name))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def test_the_first_request_programs_come_first():
    """The first request's programs (table chunk, count seed, mask update, the smallest
    extend bucket, the first copies of the decode programs of a batch of one) lead the
    order, then those decode programs' second copies; then fewer rows first, each second
    copy after every first-copy program, and each split forward before its finish."""
    layout = plan_memory(EngineConfig(**SETTINGS), SimpleNamespace(max_position_embeddings=4096))
    keys = program_keys(layout, 2, SPLIT)
    order, first = warm_order(layout, keys), first_request_keys(layout, keys)
    assert sorted(map(repr, order)) == sorted(map(repr, keys))
    assert set(order[: len(first)]) == first
    assert collections.Counter(key.kind for key in first) == {
        TABLE: 1,
        SEED: 1,
        MASK: 1,
        EXTEND: 1,
        DECODE: 2,  # general and greedy, the first copies
    }
    assert {(k.rows, k.tokens) for k in first if k.kind == EXTEND} == {layout.extend_shapes[0]}
    assert {k.rows for k in first if k.kind == DECODE} == {layout.decode_rows(1, 1)}
    assert not any(k.copy for k in first)
    second = order[len(first) : len(first) + 2]
    assert {dataclasses.replace(k, copy=0) for k in second} == {
        k for k in first if k.kind == DECODE
    }
    assert all(k.copy for k in second)
    rest = order[len(first) + 2 :]
    singles = [k for k in rest if not k.copy]
    assert len(singles) > 4 and [k.rows for k in singles] == sorted(k.rows for k in singles)
    copies = rest[len(singles) :]  # each second copy after every first-copy program
    assert copies and all(k.copy for k in copies), rest
    for at, key in enumerate(order):
        if key.kind == FINISH:
            assert order.index(key.__class__(FORWARD, key.rows, key.tokens)) < at


def test_the_gate_lets_one_thread_in_the_lowest_rank_first():
    """Threads waiting at the lowering gate enter one at a time, by rank, whatever the
    order they came in."""
    gate, entered, inside = LoweringGate(), [], []

    def enter(rank: int) -> None:
        with gate.turn(rank):
            inside.append(rank)
            entered.append((rank, len(inside)))
            time.sleep(0.01)
            inside.remove(rank)

    with gate.turn(-1):  # held while the others queue
        threads = [threading.Thread(target=enter, args=(rank,)) for rank in (5, 2, 9, 1)]
        for thread in threads:
            thread.start()
        while len(gate._waiting) < len(threads):  # every one queued behind the holder
            time.sleep(0.001)
    for thread in threads:
        thread.join()
    assert entered == [(1, 1), (2, 1), (5, 1), (9, 1)]


class _FakeProgram:
    """A program whose lowering and compilation take a while and count who else is at it."""

    def __init__(self, key, counts: dict, lock: threading.Lock) -> None:
        self.key, self.counts, self.lock = key, counts, lock

    def _busy(self, what: str, seconds: float) -> None:
        with self.lock:
            self.counts[what] += 1
            self.counts[f"most {what}"] = max(self.counts[f"most {what}"], self.counts[what])
        time.sleep(seconds)
        with self.lock:
            self.counts[what] -= 1

    def lower(self):
        self._busy("lowering", 0.01)
        return SimpleNamespace(compile=lambda: self._busy("compiling", 0.1))


def test_the_table_lowers_one_program_at_a_time_and_compiles_side_by_side():
    """Four compile threads: never two lowerings at once (they hold the GIL), several
    compilations at once (they release it)."""
    keys = [ProgramKey(EXTEND, rows, 64) for rows in range(1, 13)]
    counts, lock = collections.Counter(), threading.Lock()
    programs = [_FakeProgram(key, counts, lock) for key in keys]
    compiler = TableCompiler(programs, keys, frozenset(keys[:2]), num_threads=4).start()
    compiler.join()
    assert compiler.status()["num_programs_compiled"] == len(keys)
    assert counts["most lowering"] == 1 and counts["most compiling"] > 1, counts


def test_an_unset_thread_count_is_the_platforms(monkeypatch):
    """``compile_table`` without a thread count takes the runner's platform's
    ``TABLE_THREADS`` entry (two on a GPU); a platform without one, the CPU count at most
    eight."""
    assert table_threads("gpu") == 2
    assert table_threads("cpu") == min(8, len(os.sched_getaffinity(0)))
    engine = Engine(model=_model(), skip_warmup=True, **SETTINGS)
    assert engine.runner.sharding.platform == "cpu"
    monkeypatch.setitem(warmup.TABLE_THREADS, "cpu", 5)
    made = []

    class Recorded(Exception):
        pass

    def record(*args, **kwargs):
        made.append(args[3])  # TableCompiler(programs, order, first, num_threads, ...)
        raise Recorded

    monkeypatch.setattr(warmup, "TableCompiler", record)
    for asked, want in ((None, 5), (3, 3)):
        with pytest.raises(Recorded):
            compile_table(engine.runner, num_threads=asked)
        assert made.pop() == want


def test_a_request_during_warmup_waits_for_its_programs():
    """Ready after the first request's programs, a batch of three (an extend of 4 rows and
    decode programs of 4 rows, compiled last) waits for them: the same tokens as an engine
    warmed in full, no compilation in the serving thread, and each program compiled once."""
    model = _model(layer_norm_epsilon=2e-5)
    engine = Engine(model=model, skip_warmup=True, **SETTINGS)
    prompts = [[5, 6, 7], list(range(3, 40)), [9, 8, 7, 6]]
    params = {"max_new_tokens": 5, "ignore_eos": True}
    runner = engine.runner
    with _compiles_by_thread() as seen:
        compiler = compile_table(runner, background=True, num_threads=1)
        needed = max((k for k in runner.program_keys if k.kind == EXTEND), key=lambda k: k.rows)
        assert needed not in compiler.first and not compiler.compiled(needed)  # not vacuous
        got = engine.generate(input_ids=prompts, sampling_params=params)
        compiler.join()
    assert compiler.status()["num_programs_compiled"] == len(runner.program_keys)
    serving = [name for thread, name in seen if not thread.startswith(THREAD_NAME)]
    assert not [name for name in serving if "step" in name], serving
    table = [name for thread, name in seen if thread.startswith(THREAD_NAME)]
    assert len(table) == len(runner.program_keys), table  # each program once
    warmed = Engine(model=model, **SETTINGS)  # the same programs, compiled: none compiles
    want = warmed.generate(input_ids=prompts, sampling_params=params)
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in want]


class _Held:
    """A program whose lowering waits for ``release``."""

    def __init__(self, program, release: threading.Event) -> None:
        self.key, self.program, self.release = program.key, program, release

    def lower(self):
        self.release.wait()
        return self.program.lower()


def test_a_decode_step_runs_the_first_copy_while_the_second_compiles(monkeypatch):
    """Ready without the decode programs' second copies: while they cannot compile, a
    request is served by the first copies alone, compiling nothing in the serving thread,
    with the tokens of an engine warmed in full."""
    model = _model(layer_norm_epsilon=4e-5)
    engine = Engine(model=model, skip_warmup=True, decode_program_copies=2, **SETTINGS)
    prompts, params = [[5, 6, 7]], {"max_new_tokens": 6, "ignore_eos": True}
    release, got = threading.Event(), []
    table = tuple(
        _Held(program, release) if program.key.copy else program
        for program in engine.runner.program_table()
    )
    monkeypatch.setattr(engine.runner, "program_table", lambda: table)

    def serve() -> None:
        got.extend(engine.generate(input_ids=prompts, sampling_params=params))

    with _compiles_by_thread() as seen:
        compiler = compile_table(engine.runner, background=True, num_threads=1)
        try:
            assert any(key.copy for key in compiler.order)
            serving = threading.Thread(target=serve, daemon=True)
            serving.start()
            serving.join(timeout=120)
            assert not serving.is_alive(), "a decode step waited for a second copy"
        finally:
            release.set()
            compiler.join()
    in_serving = [name for thread, name in seen if not thread.startswith(THREAD_NAME)]
    assert not [name for name in in_serving if "step" in name], in_serving
    want = Engine(model=model, decode_program_copies=2, **SETTINGS).generate(
        input_ids=prompts, sampling_params=params
    )
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in want]


@contextlib.contextmanager
def _server_cache(path) -> Iterator[None]:
    """The server's cache settings (every program kept, however small and fast to compile)
    in ``path`` inside the block, JAX's own outside it."""
    from jax.experimental.compilation_cache import compilation_cache

    saved = {name: getattr(jax.config, name) for name in CACHE_SETTINGS}
    compilation_cache.reset_cache()  # the cache is set up at the first compilation after
    try:
        enable_compilation_cache(str(path))
        yield
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


def test_a_warm_restart_loads_every_program_stored(tmp_path):
    """With the server's cache settings, each program XLA compiles is stored as an
    executable, and a second copy of a decode program is its first copy's, loaded again.
    An engine built again after the in-memory caches are dropped loads every program of
    its table: nothing traced, lowered or compiled, and it serves the tokens of an engine
    without caches, compiling nothing. With the store gone, every program is found
    compiled in memory, then (the in-memory caches dropped) read from the persistent cache;
    on a CPU none of those is stored (``stores_cache_hits``)."""
    model = _model(layer_norm_epsilon=3e-5)
    request = dict(
        input_ids=[[5, 6, 7], list(range(3, 40))],
        sampling_params={"max_new_tokens": 5, "ignore_eos": True},
    )
    with _server_cache(tmp_path):
        jax.clear_caches()  # programs of the same shapes that earlier tests compiled
        engine = Engine(model=model, decode_program_copies=2, compile_threads=3, **SETTINGS)
        cold, keys = engine.warmup_status(), engine.runner.program_keys
        jax.clear_caches()
        with _compiles_by_thread() as compiled:
            engine = Engine(model=model, decode_program_copies=2, **SETTINGS)
            got = [out["output_ids"] for out in engine.generate(**request)]
        names = {f"jit({jitted.__name__})" for jitted in engine.runner.programs.all()}
        compiled = [(thread, name) for thread, name in compiled if name in names]
        warm = engine.warmup_status()
        stored = sorted(path.name for path in (tmp_path / STORE_DIR).iterdir())
        shutil.rmtree(tmp_path / STORE_DIR)
        again = Engine(model=model, decode_program_copies=2, **SETTINGS).warmup_status()
        jax.clear_caches()
        cached = Engine(model=model, decode_program_copies=2, **SETTINGS).warmup_status()
        assert not (tmp_path / STORE_DIR).exists() or not any((tmp_path / STORE_DIR).iterdir())
    plain = Engine(model=model, skip_warmup=True, **SETTINGS)
    want = [out["output_ids"] for out in plain.generate(**request)]
    num_programs = cold["num_programs"]
    num_copies = sum(key.copy for key in keys)
    assert num_copies > 1 and len(stored) == num_programs - num_copies
    assert cold["done"] and warm["done"] and warm["num_programs"] == num_programs > 4
    assert cold["compile_threads"] == 3  # EngineConfig.compile_threads
    assert cold["num_xla_compiles"] == cold["persistent_cache_misses"] == len(stored)
    assert cold["num_programs_loaded"] == num_copies and cold["persistent_cache_hits"] == 0
    assert warm["num_programs_loaded"] == num_programs
    assert warm["num_xla_compiles"] == warm["persistent_cache_hits"] == 0
    assert not compiled, compiled
    assert got == want
    assert again["num_xla_compiles"] == again["num_programs_loaded"] == 0  # found in memory
    assert cached["persistent_cache_hits"] == num_programs
    assert cached["num_xla_compiles"] == cached["num_programs_loaded"] == 0
