"""The program table (``engine/programs.py``): enumerated once from the ``Layout``, each
program once; warm-up compiles exactly its programs and compiling its entries ahead of a
call compiles nothing more; two kernel tunings compile two programs, and serving with the
default tuning compiles nothing after warm-up."""

from __future__ import annotations

import collections
from types import SimpleNamespace

import jax

from lazyspec.config import EngineConfig
from lazyspec.engine.engine import Engine
from lazyspec.engine.programs import (
    DECODE,
    EXTEND,
    FINISH,
    FORWARD,
    FUSED,
    MASK,
    SEED,
    SPLIT,
    TABLE,
    program_keys,
)
from lazyspec.engine.runner import Runner
from lazyspec.kernels.backend import default_tuning
from lazyspec.scheduler.layout import plan_memory
from lazyspec.testing.char_tokenizer import char_tokenizer
from lazyspec.testing.compiles import backend_compiles
from lazyspec.testing.tiny_models import TINY_CHUNKS, tiny_model

SETTINGS = dict(TINY_CHUNKS, max_running_requests=2, max_total_tokens=512, context_length=128)


def _kinds(keys) -> collections.Counter:
    return collections.Counter(key.kind for key in keys)


def _jit_compiled(runner: Runner) -> int:
    """Executables the runner's jitted programs hold (compiled by a call of one; every
    runner's, as jitted functions of one step share theirs)."""
    return sum(jitted._cache_size() for jitted in runner.programs.all())


def test_keys_name_each_program_once():
    """Every extend bucket; every decode shape in both forms per copy; a grammar batch's
    split pair per shape (or, served fused with K decode steps, its one-token shapes per
    copy); one table chunk, count seed and mask update."""
    model_cfg = SimpleNamespace(max_position_embeddings=4096)
    layout = plan_memory(EngineConfig(**SETTINGS), model_cfg)
    shapes = layout.decode_shapes
    for copies, grammar in ((1, None), (2, SPLIT), (2, FUSED)):
        keys = program_keys(layout, copies, grammar)
        assert len(set(keys)) == len(keys)
        split = len(shapes) if grammar == SPLIT else 0
        assert _kinds(keys) == {
            EXTEND: len(layout.extend_shapes),
            DECODE: len(shapes) * 2 * copies,
            **({FORWARD: split, FINISH: split} if split else {}),
            TABLE: 1,
            SEED: 1,
            MASK: 1,
        }
    stepped = plan_memory(EngineConfig(**SETTINGS, num_continuous_decode_steps=2), model_cfg)
    assert {positions for _, positions in stepped.decode_shapes} == {2}
    one_token = {
        (key.rows, key.tokens, key.greedy, key.copy)
        for key in program_keys(stepped, 2, FUSED)
        if key.kind == DECODE and key.tokens == 1
    }
    assert one_token == {
        (stepped.decode_rows(rows, 1), 1, False, copy)
        for rows in stepped.decode_buckets
        for copy in range(2)
    }


def test_warmup_compiles_the_table_exactly():
    """Warm-up compiles one executable per key of the table (two copies of the decode
    program, the split pair of a grammar batch) and binds it, so the runner calls it: no
    jitted function is called, so none compiles; compiling every entry ahead of a call then
    compiles nothing: the table's arguments are the ones serving calls with."""
    jax.clear_caches()  # no program of an earlier test stands in
    model = SimpleNamespace(**{**vars(tiny_model()), "tokenizer": char_tokenizer()})
    engine = Engine(model=model, decode_program_copies=2, **SETTINGS)
    table = engine.runner.program_table()
    assert engine.runner.num_compiled() == len(table) == len(engine.runner.program_keys)
    assert _jit_compiled(engine.runner) == 0
    with backend_compiles() as seen:
        for program in table:
            program.compile()
    assert not seen, f"{len(seen)} programs of the table compiled again"


def test_two_tunings_compile_two_programs():
    """A kernel tuning is part of every program's static key: an engine with another tuning
    compiles its own program of a key warm-up compiled already, one with an equal tuning
    shares it; serving with the default tuning after warm-up compiles nothing (no XLA
    compilation at all)."""
    jax.clear_caches()
    model = tiny_model()
    served = Engine(model=model, **SETTINGS)
    compiled = served.runner.num_compiled()
    assert compiled == len(served.runner.program_keys)
    params = {"max_new_tokens": 6, "ignore_eos": True}
    with backend_compiles() as seen:
        served.generate(input_ids=[[5, 6, 7], list(range(3, 90))], sampling_params=params)
    assert served.runner.num_compiled() == compiled and not seen
    pair_grid = not default_tuning().moe.pair_grid
    other = Engine(
        model=model, skip_warmup=True, kernel_tuning=f"moe.pair_grid={pair_grid}", **SETTINGS
    )
    assert other.runner.static.tuning != served.runner.static.tuning
    key = other.runner.program_keys[0]
    with backend_compiles() as seen:
        other.runner.warm(key)
    assert other.runner.programs is served.runner.programs  # one set of pool shardings
    assert len(seen) == 1 and _jit_compiled(served.runner) == 1
    with backend_compiles() as seen:
        Engine(model=model, skip_warmup=True, **SETTINGS).runner.warm(key)
    assert not seen  # the served engine's program, compiled once
