"""The executable store (``engine/executables.py``): a program stored once loads in a later
start and computes what its compilation did; whatever decides a program (its arguments,
static ones by value, the environment) decides its file, so a change is a miss; a file
that does not load is a miss, not an error."""

from __future__ import annotations

import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.engine.executables import ExecutableStore
from lazyspec.engine.programs import TABLE, Program, ProgramKey


def _scale(factor: float, x: jax.Array) -> jax.Array:
    return factor * jnp.tanh(x)


class _Factor:
    """Three, hashed by identity, with a repr that names its address."""

    def __mul__(self, x: jax.Array) -> jax.Array:
        return 3.0 * x


def _program(length: int = 8, factor: object = 3.0, dtype=jnp.float32, copy: int = 0):
    spec = jax.ShapeDtypeStruct((length,), dtype)
    key = ProgramKey(TABLE, 1, length, copy=copy)
    return Program(key, jax.jit(_scale, static_argnums=0), lambda carry=True: (factor, spec))


@pytest.fixture
def store(tmp_path) -> ExecutableStore:
    return ExecutableStore(tmp_path / "programs", jax.devices())


def test_a_stored_program_loads_and_computes_what_it_compiled(store):
    program = _program()
    assert store.load(program) is None
    compiled = program.compile()
    assert store.save(program, compiled)
    jax.clear_caches()
    loaded = store.load(program)
    assert loaded is not None and loaded is not compiled
    x = np.linspace(-2, 2, 8, dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(compiled(x)))
    np.testing.assert_allclose(np.asarray(loaded(x)), 3.0 * np.tanh(x), rtol=1e-6)
    # a copy of the program shares its file, and loads an executable of its own
    copy = store.load(_program(copy=1))
    assert copy is not None and copy is not loaded
    np.testing.assert_array_equal(np.asarray(copy(x)), np.asarray(compiled(x)))


def test_what_decides_a_program_decides_its_file(store, monkeypatch):
    path = store.path(_program())
    assert path is not None and path == store.path(_program())
    others = [_program(length=16), _program(factor=2.0), _program(dtype=jnp.bfloat16)]
    assert len({path, *(store.path(other) for other in others)}) == 4
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=true")
    other = ExecutableStore(store.directory, jax.devices())
    assert other.environment != store.environment
    assert other.path(_program()) != path
    with jax.default_matmul_precision("highest"):  # JAX's configuration, as it is now
        precise = ExecutableStore(store.directory, jax.devices())
    assert precise.path(_program()) not in (path, other.path(_program()))


def test_a_file_that_does_not_load_is_a_miss(store, caplog):
    program = _program()
    assert store.save(program, program.compile())
    store.path(program).write_bytes(b"not an executable")
    with caplog.at_level(logging.WARNING, logger="lazyspec.engine.executables"):
        assert store.load(program) is None
    assert "did not load" in caplog.text


def test_an_argument_known_by_its_address_is_not_stored(store):
    program = _program(factor=_Factor())  # its repr would never be equal again
    assert store.path(program) is None
    assert not store.save(program, program.compile()) and store.load(program) is None
    assert not store.directory.exists()


def test_a_cpu_program_the_persistent_cache_held_is_not_stored(store):
    """XLA:CPU's executable read from the persistent cache does not serialize whole (it
    loads, then fails to run): such a program is compiled again next start, not stored."""
    program = _program()
    assert not store.stores_cache_hits  # a CPU's devices
    assert not store.save(program, program.compile(), fresh=False)
    assert store.load(program) is None
    assert store.save(program, program.compile())


def test_the_store_keeps_its_most_recently_used_files_within_its_size(tmp_path):
    """Past ``max_bytes`` a save deletes the least recently used files; a load counts as a
    use."""
    first, second, third = _program(8), _program(16), _program(32)
    probe = ExecutableStore(tmp_path / "probe", jax.devices())
    assert probe.save(first, first.compile())
    size = probe.path(first).stat().st_size
    store = ExecutableStore(tmp_path / "programs", jax.devices(), max_bytes=int(2.5 * size))
    for age, program in ((300, first), (200, second)):
        assert store.save(program, program.compile())
        past = time.time() - age
        os.utime(store.path(program), (past, past))
    assert store.load(first) is not None  # now the most recently used
    assert store.save(third, third.compile())
    assert store.load(second) is None and not store.path(second).exists()
    assert store.load(first) is not None and store.load(third) is not None
