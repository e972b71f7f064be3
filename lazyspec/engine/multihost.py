"""Several processes, one mesh: joining them and sending process 0's device calls to the rest.

With ``nnodes > 1`` every process runs ``jax.distributed`` and holds ``tp_size // nnodes``
devices of the one ``tp`` mesh. Process 0 alone runs the scheduler; every jitted call its
``Runner`` makes (a table chunk, an extend or a decode step) must be made by every process
with the same inputs, in the same order. ``StepBroadcast`` carries those inputs through a
JAX collective (``multihost_utils.broadcast_one_to_all``): first a fixed header (the call's
kind, its bucket (rows, and an extend's length or a decode's ``2 * D + greedy``), the
payload's length), which fixes the payload's shape, then the payload
(a table chunk; a batch or a token-count seed packed into one int32 array; grammar-mask
rows and their bitmasks; nothing for the second program of a split decode step, which runs
on the batch of the first). The others loop on ``receive`` until process 0 sends ``STOP``.
A device call of process 0 that is not sent would leave the processes in different
collectives, waiting for each other forever. With one process nothing is sent.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np

from lazyspec.config import EngineConfig
from lazyspec.engine import programs
from lazyspec.engine.packing import PackedBatch, pack_batch
from lazyspec.engine.programs import ProgramKey, program_input
from lazyspec.scheduler.batch import DecodeBatch, ExtendBatch
from lazyspec.scheduler.layout import Layout

logger = logging.getLogger(__name__)

# the kinds of call a header announces; DECODE_FORWARD and DECODE_FINISH are the two programs
# of a split decode step (the finish sends no payload: the others keep the forward's batch)
STOP, TABLE, EXTEND, DECODE, SEED, MASK, DECODE_FORWARD, DECODE_FINISH = range(8)
HEADER_LEN = 4  # kind, first dim, second dim (0 when none), payload words


def initialize(config: EngineConfig) -> None:
    """Join the ``config.nnodes`` processes (``jax.distributed.initialize``); call it before
    anything touches a device. A no-op for one process or once joined (ValueError if the
    joined group differs from ``config``)."""
    if config.nnodes == 1:
        return
    if not jax.distributed.is_initialized():
        # CPU devices of different processes reach each other through gloo; the setting
        # touches only the CPU backend
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        logger.info(
            "joining %d processes at %s as process %d",
            config.nnodes,
            config.dist_init_addr,
            config.node_rank,
        )
        jax.distributed.initialize(config.dist_init_addr, config.nnodes, config.node_rank)
    joined = (jax.process_count(), jax.process_index())
    if joined != (config.nnodes, config.node_rank):
        raise ValueError(
            f"nnodes={config.nnodes}, node_rank={config.node_rank}, but this process is "
            f"process {joined[1]} of {joined[0]}"
        )


class StepBroadcast:
    """Process 0's device calls, sent to the other processes (``send_*`` on process 0,
    ``receive`` on the others). Every send is a collective: all processes take part, so
    the others must be in ``receive`` while process 0 runs."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.stopped = False  # process 0 sent STOP: the others no longer listen
        self.num_sent = 0  # device calls sent (STOP excluded)
        self._packed_layouts: dict[tuple[int, int, int], Any] = {}  # receive's cache

    # ------------------------------------------------------------------ process 0

    def send_table(self, updates: np.ndarray) -> None:
        """Announce and send one table chunk ``[3, n]`` int32."""
        assert updates.dtype == np.int32 and updates.ndim == 2, (updates.dtype, updates.shape)
        self._send(TABLE, *updates.shape, updates)

    def send_step(self, batch: ExtendBatch | DecodeBatch, packed: PackedBatch) -> None:
        """Announce ``batch``'s kind and bucket (rows, and its length or ``_decode_form``),
        then send its packed words."""
        rows = batch.req_row.shape[0]
        if isinstance(batch, ExtendBatch):
            self._send(EXTEND, rows, batch.tokens.shape[1], packed.words)
        else:
            self._send(DECODE, rows, _decode_form(batch), packed.words)

    def send_forward(self, batch: DecodeBatch, packed: PackedBatch) -> None:
        """Announce the first program of a split decode step (its bucket and
        ``_decode_form``), then send its packed words."""
        self._send(DECODE_FORWARD, batch.req_row.shape[0], _decode_form(batch), packed.words)

    def send_finish(self) -> None:
        """Announce the second program of the split decode step last sent (no payload)."""
        self._check_listening()
        _broadcast(np.array([DECODE_FINISH, 0, 0, 0], np.int32))
        self.num_sent += 1

    def send_seed(self, packed: PackedBatch) -> None:
        """Announce and send one token-count seed, packed (``pack_batch(CountSeed)``)."""
        self._send(SEED, 0, 0, packed.words)

    def send_masks(self, rows: np.ndarray, masks: np.ndarray) -> None:
        """Announce and send one grammar-mask update: request rows ``[n]`` int32 and their
        bitmasks ``[n, ...]`` int32."""
        assert rows.dtype == masks.dtype == np.int32, (rows.dtype, masks.dtype)
        words = masks.size // max(rows.size, 1)
        self._send(MASK, rows.size, words, np.concatenate([rows.ravel(), masks.ravel()]))

    def _send(self, kind: int, first: int, second: int, payload: np.ndarray) -> None:
        """The header ``[kind, first, second, payload.size]``, then the int32 payload."""
        self._check_listening()
        _broadcast(np.array([kind, first, second, payload.size], np.int32))
        _broadcast(payload)
        self.num_sent += 1

    def send_stop(self) -> None:
        """Release the other processes from their ``receive`` loop (once; later calls
        do nothing)."""
        if not self.stopped:
            _broadcast(np.array([STOP, 0, 0, 0], np.int32))
            self.stopped = True

    def _check_listening(self) -> None:
        if self.stopped:
            raise RuntimeError("the other processes were released (STOP sent): no more steps")

    # ------------------------------------------------------------------ the others

    def receive(self) -> tuple[int, Any]:
        """The next call: ``(STOP | DECODE_FINISH, None)``, ``(TABLE, chunk)``, ``(EXTEND |
        DECODE | DECODE_FORWARD | SEED, PackedBatch)`` or ``(MASK, (rows [n], masks [n,
        words]))``; blocks until process 0 sends it."""
        kind, first, second, num_words = (
            int(v) for v in _broadcast(np.zeros(HEADER_LEN, np.int32))
        )
        if kind in (STOP, DECODE_FINISH):
            return kind, None
        if kind == TABLE:
            return TABLE, _broadcast(np.zeros((first, second), np.int32))
        if kind == MASK:
            words = _broadcast(np.zeros(num_words, np.int32))
            return MASK, (words[:first], words[first:].reshape(first, second))
        if kind not in (EXTEND, DECODE, SEED, DECODE_FORWARD):
            raise RuntimeError(f"process 0 announced an unknown call kind {kind}")
        layout, expected = self._packed_layout(kind, first, second)
        if expected != num_words:
            raise RuntimeError(
                f"process 0 sends a batch of {num_words} words where this process's bucket "
                f"(kind {kind}, {first} rows, length or decode form {second}) packs "
                f"{expected}: the processes were started with different settings"
            )
        return kind, PackedBatch(_broadcast(np.zeros(num_words, np.int32)), layout)

    def _packed_layout(self, kind: int, rows: int, length: int) -> tuple[Any, int]:
        """The ``PackedLayout`` of a bucket and the words it packs into (a decode batch's are
        padded: ``pack_batch``), from its program's all-padding input (``program_input``:
        the same tree and leaf shapes as any batch of that bucket)."""
        kind = DECODE if kind == DECODE_FORWARD else kind
        key = (kind, rows, length)
        if key not in self._packed_layouts:
            if kind == SEED:
                program = ProgramKey(programs.SEED)
            elif kind == EXTEND:
                program = ProgramKey(programs.EXTEND, rows, length)
            else:
                num_verify, greedy = divmod(length, 2)
                program = ProgramKey(programs.DECODE, rows, num_verify, bool(greedy))
            packed = pack_batch(program_input(self.layout, program))
            self._packed_layouts[key] = (packed.layout, len(packed.words))
        return self._packed_layouts[key]


def _decode_form(batch: DecodeBatch) -> int:
    """A decode batch's static fields in one header word: ``2 * D + greedy``."""
    return 2 * batch.num_verify + int(batch.greedy)


def _broadcast(array: np.ndarray) -> np.ndarray:
    """Process 0's ``array`` on every process (the others pass one of the same shape)."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(array))
