"""Compiled programs kept on disk between runs, so a warm start neither traces nor lowers.

JAX's persistent compilation cache skips XLA's compilation, but it is keyed by the lowered
module: every program is still traced and lowered at each start (about 2.3 s a decode
program of the embedded model on an H100, most of a warm start). ``ExecutableStore`` keeps
each program of the table (``programs.Program``) serialized (``jax.experimental.
serialize_executable``) under a fingerprint of everything that decides it without tracing
it: its key, its arguments (static ones by value, the others by shape, dtype and
sharding), the source of ``lazyspec`` and its kernels, the JAX and XLA versions, the
devices, the XLA flags and JAX's configuration. A start whose fingerprint matches loads the
executable (a fraction of a second); any difference, or a file that does not load, is a
miss, and the program is lowered and compiled as without the store, then written (on a
CPU only what XLA compiled then, not what a cache held: ``stores_cache_hits``).

The store lies beside JAX's persistent cache (``STORE_DIR`` in
``jax_compilation_cache_dir``) and is used only where that cache is on and one process
drives the devices. The source is read from disk: code replaced while a process runs (a
monkeypatch) is not seen, so keep the cache off where that is done. Loading an executable
runs code it holds: keep the directory as private as the compilation cache itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax

logger = logging.getLogger(__name__)

STORE_DIR = "lazyspec-programs"
# the store's size at the most: past it, the least recently used files go (a load touches
# its file); each change of the source starts a new set of files
MAX_BYTES = 4 * 2**30
# bumped when what a file holds changes
FORMAT = 1
# environment variables that change what a program compiles to
_ENV_PREFIXES = ("XLA_", "JAX_", "LIBTPU", "TPU_", "LAZYSPEC_")


def store_for_jax_cache(devices: list) -> ExecutableStore | None:
    """The store beside JAX's persistent compilation cache, for programs on ``devices``;
    None where that cache is off or several processes drive the devices."""
    directory = jax.config.jax_compilation_cache_dir
    if not (directory and jax.config.jax_enable_compilation_cache) or jax.process_count() > 1:
        return None
    return ExecutableStore(Path(directory) / STORE_DIR, devices)


class ExecutableStore:
    """Programs' compiled executables in ``directory``, one file per fingerprint."""

    def __init__(self, directory: Path, devices: list, max_bytes: int = MAX_BYTES) -> None:
        self.directory = Path(directory)
        self.devices = {device.id: device for device in devices}
        self.max_bytes = max_bytes
        self.environment = environment()  # as the store is made (one engine's warm-up)
        # whether an executable XLA did not compile in this call (JAX read it from its
        # persistent cache, now or for an earlier call in this process) is stored too:
        # XLA:CPU's does not serialize whole (its kernels are missing when it is loaded
        # again, and it fails as it runs); a GPU's does (H100, jax 0.11)
        self.stores_cache_hits = devices[0].platform != "cpu"

    def path(self, program: Any) -> Path | None:
        """The file of ``program``'s executable; None if its arguments cannot be told apart
        by value (a repr naming an object's address would never match again)."""
        # the copies of a program share its file: each copy loads its own executable
        text = describe(dataclasses.replace(program.key, copy=0), program.signature())
        if " at 0x" in text:
            return None
        digest = hashlib.sha256(self.environment.encode())
        digest.update(text.encode())
        return self.directory / f"{digest.hexdigest()}.exe"

    def load(self, program: Any) -> jax.stages.Compiled | None:
        """``program``'s executable as stored, or None (not stored, or it does not load)."""
        path = self.path(program)
        if path is None or not path.is_file():
            return None
        from jax.experimental.serialize_executable import deserialize_and_load

        try:
            fmt, device_ids, payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            if fmt != FORMAT:
                return None
            devices = [self.devices[i] for i in device_ids]
            compiled = deserialize_and_load(payload, in_tree, out_tree, execution_devices=devices)
            os.utime(path)  # recently used
            return compiled
        except Exception:  # a file of another build, truncated, or of other devices
            logger.warning("a stored program did not load (%s); compiling it", path.name)
            logger.debug("loading %s", path, exc_info=True)
            return None

    def save(self, program: Any, compiled: jax.stages.Compiled, fresh: bool = True) -> bool:
        """Write ``program``'s ``compiled`` executable (atomically); whether it was.
        ``fresh``: XLA compiled it in this call (else ``stores_cache_hits`` decides)."""
        path = self.path(program)
        if path is None or not (fresh or self.stores_cache_hits):
            return False
        from jax.experimental.serialize_executable import serialize

        try:
            payload, in_tree, out_tree = serialize(compiled)
            device_ids = [d.id for d in compiled._executable.xla_executable.local_devices()]
            blob = pickle.dumps((FORMAT, device_ids, payload, in_tree, out_tree))
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.directory, delete=False) as file:
                try:
                    file.write(blob)
                except BaseException:
                    os.unlink(file.name)
                    raise
            os.replace(file.name, path)
        except Exception:  # a backend that does not serialize, a full disk: compile next time
            logger.warning("could not store a compiled program (%s)", program.key, exc_info=True)
            return False
        self.prune()
        return True

    def prune(self) -> None:
        """Delete the least recently used files until the store holds ``max_bytes`` at
        most (safe beside other processes: a file deleted under a load is a miss)."""
        files = []
        for path in self.directory.iterdir():
            with contextlib.suppress(OSError):  # deleted by another process meanwhile
                stat = path.stat()
                files.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size


def describe(key: Any, arguments: tuple) -> str:
    """``key`` and ``arguments`` as text that differs wherever the program would: arrays and
    abstract arrays by shape, dtype and sharding (with its devices), the rest by value."""
    leaves, treedef = jax.tree.flatten(arguments)
    parts = [repr(key), str(treedef)]
    for leaf in leaves:
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            sharding = getattr(leaf, "sharding", None)
            mesh = getattr(sharding, "mesh", None)
            devices = getattr(mesh, "device_ids", None)
            ids = None if devices is None else devices.tolist()
            parts.append(f"{tuple(leaf.shape)} {leaf.dtype} {sharding!r} {ids}")
        else:
            parts.append(repr(leaf))
    return "\n".join(parts)


def environment() -> str:
    """What decides every program beside its arguments, as text: the source of ``lazyspec``
    and its kernels, the Python, JAX and jaxlib versions, the backend and its devices, the
    environment's XLA and JAX variables and JAX's configuration (as they are now)."""
    import jax.extend.backend
    import jaxlib

    backend = jax.extend.backend.get_backend()
    devices = [(d.id, d.device_kind, d.process_index) for d in jax.devices()]
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES))
    config = sorted((k, repr(v)) for k, v in jax.config.values.items())
    return "\n".join(
        map(
            str,
            (
                FORMAT,
                source_digest(),
                sys.version,
                jax.__version__,
                jaxlib.__version__,
                backend.platform,
                backend.platform_version,
                devices,
                env,
                config,
            ),
        )
    )


@functools.cache
def source_digest() -> str:
    """A digest of every Python file of ``lazyspec`` and its kernels, read once a process
    (the code it runs)."""
    import lazyspec
    import lazyspec.kernels

    digest = hashlib.sha256()
    files = set()
    for package in (lazyspec, lazyspec.kernels):
        files.update(path.resolve() for path in Path(package.__file__).parent.rglob("*.py"))
    for path in sorted(files):
        digest.update(str(path).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()
