"""The Runner owns the parameters and the device pools and launches the jitted steps.

It is the only owner of the pools: each launch passes them (donated) into a step and
replaces the reference with the step's output. ``launch`` dispatches asynchronously and
returns device arrays; ``fetch`` blocks on one step's small outputs only.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lazyspec.engine.draft_vocab import DRAFT_VOCAB, build_draft_vocab
from lazyspec.engine.multihost import (
    DECODE,
    DECODE_FINISH,
    DECODE_FORWARD,
    EXTEND,
    MASK,
    SEED,
    STOP,
    TABLE,
    StepBroadcast,
)
from lazyspec.engine.sharding import ShardingPlan, device_bytes
from lazyspec.engine.steps import (
    DecodeBatch,
    DecodeCarry,
    ExtendBatch,
    PackedBatch,
    PackedLayout,
    Pools,
    StepStatic,
    apply_table_updates,
    apply_vocab_masks,
    decode_finish,
    decode_forward,
    decode_step,
    extend_step,
    pack_batch,
    pack_outputs,
    seed_counts,
    unpack_batch,
    unpack_outputs,
)
from lazyspec.models.interface import KVPools
from lazyspec.scheduler.batch import CountSeed
from lazyspec.scheduler.grammar import mask_width
from lazyspec.scheduler.layout import Layout

logger = logging.getLogger(__name__)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _unpacking(step):
    """``step`` taking its batch packed (``PackedBatch``)."""

    @functools.wraps(step)
    def run(fam, cfg, static, params, pools, packed: PackedBatch, *rest):
        return step(fam, cfg, static, params, pools, unpack_batch(packed), *rest)

    return run


def _sharded(step, replicate_outputs: bool = True):
    """``step`` with the sharding plan as a further static argument: the pools it returns are
    constrained to the shardings they came in with (every masked scatter writes a pool in
    place) and its small outputs are replicated (unless not ``replicate_outputs``: a split
    decode step's carry keeps the shardings the forward gives it, logits by vocabulary,
    states by heads)."""

    def run(fam, cfg, static, sharding: ShardingPlan, params, pools, batch, *rest):
        outputs, pools = step(fam, cfg, static, params, pools, batch, *rest)
        pools = jax.lax.with_sharding_constraint(pools, sharding.pool_shardings(pools))
        if replicate_outputs:
            outputs = jax.lax.with_sharding_constraint(outputs, sharding.replicated)
        return outputs, pools

    run.__name__ = step.__name__
    return run


class InTurn:
    """Calls its programs in turn, one per call. A GPU program runs as command buffers (CUDA
    graphs) that XLA updates whenever a buffer the program touches has moved since its last
    call, which costs more host time than the launch itself. A decode step's words (which
    its outputs overwrite) are allocated while the last step's are still held, so their
    address alternates from step to step: two copies of the program called in turn each see
    the addresses of their own last call."""

    def __init__(self, programs: list):
        self.programs, self.turn = programs, 0

    def __call__(self, *args):
        program = self.programs[self.turn]
        self.turn = (self.turn + 1) % len(self.programs)
        return program(*args)


@dataclasses.dataclass
class PendingDecode:
    """A decode step whose forward is launched and whose sample-and-commit program is not:
    its packed batch and the forward's device outputs (``Runner.launch_forward``)."""

    packed: PackedBatch
    carry: DecodeCarry


def _seed_packed(output_counts, in_prompt, packed: PackedBatch):
    return seed_counts(output_counts, in_prompt, unpack_batch(packed))


# (family, config, static settings, the packed batch's layout) -> the layout of the
# decode step's packed outputs, recorded when the step is traced for that batch layout
_OUTPUT_LAYOUTS: dict[tuple, PackedLayout] = {}


def _packing_outputs(step):
    """``step`` (taking the sharding plan, ``_sharded``) returning its outputs packed into
    one int32 array (``pack_outputs``) the shape of its batch's words, which it is handed
    (donated): no output buffer to allocate and one copy back per step. The layout is
    recorded as the step is traced (``_OUTPUT_LAYOUTS``)."""

    def run(fam, cfg, static, sharding, params, pools, packed: PackedBatch, *rest):
        outputs, pools = step(fam, cfg, static, sharding, params, pools, packed, *rest)
        words, layout = pack_outputs(outputs)
        _OUTPUT_LAYOUTS[(fam, cfg, static, packed.layout)] = layout
        # the shape of the batch's words (donated): XLA writes the outputs over them
        room = packed.words.shape[0]
        if words.shape[0] > room:
            raise AssertionError(
                f"a decode step's outputs take {words.shape[0]} words, more than its batch's "
                f"{room}: steps.decode_output_words undercounts them"
            )
        return jnp.pad(words, (0, room - words.shape[0])), pools

    run.__name__ = step.__name__
    return run


@dataclasses.dataclass(frozen=True)
class PackedOutputs:
    """A launched step's outputs as one device array (``_packing_outputs``) and its layout;
    ``Runner.fetch`` unpacks them."""

    words: jax.Array
    layout: PackedLayout

    def copy_to_host_async(self) -> None:
        self.words.copy_to_host_async()


@dataclasses.dataclass(frozen=True)
class Programs:
    """The jitted programs of runners whose pools have one set of shardings. Each program
    returns the pools it changes with exactly the shardings they were allocated with
    (``out_shardings``), so every call after the first matches the first call's signature:
    XLA alone may return an equivalent sharding under another spec (on one device, ``P()``
    for ``P(None, 'tp', None)``), which jit's dispatch cache counts as a new signature."""

    extend: Any  # (fam, cfg, static, sharding, params, pools, packed) -> (outputs, pools)
    decode: Any
    # the same decode step jitted again: its own executables, so its own CUDA graphs
    decode_copy: Any
    # a decode step in two programs, the grammar masks written between them
    decode_forward: Any  # (fam, cfg, static, sharding, params, pools, packed) -> (carry, pools)
    decode_finish: Any  # (..., params, pools, packed, carry) -> (outputs, pools)
    table: Any  # (req_to_token, updates) -> req_to_token
    mask: Any  # (vocab_mask, rows, masks) -> vocab_mask
    seed: Any  # (output_counts, in_prompt, packed) -> (output_counts, in_prompt)

    def all(self) -> tuple[Any, ...]:
        return (
            self.extend,
            self.decode,
            self.decode_copy,
            self.decode_forward,
            self.decode_finish,
            self.table,
            self.mask,
            self.seed,
        )


# One Programs per set of pool shardings: every runner of an equal model and equal settings
# shares one compilation per shape (the config, the family, the static settings and the
# sharding plan are static arguments hashed by value). The steps take their batch packed.
_PROGRAMS: dict[tuple, Programs] = {}


def programs_for(sharding: ShardingPlan, pool_shardings: Pools) -> Programs:
    """The programs whose pool outputs carry ``pool_shardings`` (made once per such set)."""
    leaves, treedef = jax.tree.flatten(pool_shardings)
    key = (sharding, treedef, tuple(leaves))
    if key not in _PROGRAMS:
        step_out = (sharding.replicated, pool_shardings)

        def step_jit(step, replicate_outputs: bool = True, packed_outputs: bool = False):
            run = _sharded(_unpacking(step), replicate_outputs)
            return jax.jit(
                _packing_outputs(run) if packed_outputs else run,
                static_argnums=(0, 1, 2, 3),
                donate_argnums=(5, 6) if packed_outputs else (5,),
                out_shardings=step_out if replicate_outputs else (None, pool_shardings),
            )

        _PROGRAMS[key] = Programs(
            extend=step_jit(extend_step),
            decode=step_jit(decode_step, packed_outputs=True),
            decode_copy=step_jit(decode_step, packed_outputs=True),
            decode_forward=step_jit(decode_forward, replicate_outputs=False),
            decode_finish=step_jit(decode_finish),
            table=jax.jit(
                apply_table_updates,
                donate_argnums=(0,),
                out_shardings=pool_shardings.req_to_token,
            ),
            mask=jax.jit(
                apply_vocab_masks, donate_argnums=(0,), out_shardings=pool_shardings.vocab_mask
            ),
            seed=jax.jit(
                _seed_packed,
                donate_argnums=(0, 1),
                out_shardings=(pool_shardings.output_counts, pool_shardings.in_prompt),
            ),
        )
    return _PROGRAMS[key]


# grammar rows whose bitmasks one mask update writes (one compiled shape; more rows take
# several updates)
MASK_ROWS_PER_UPDATE = 8


def abstract_pools(cfg: Any, layout: Layout, spec: bool, kv_dtype: str, ssm_dtype: str) -> Pools:
    """The pools' shapes and dtypes (``jax.ShapeDtypeStruct`` leaves): the one description
    that allocation and byte accounting read. Slot 0, page 0 and request row 0 are the null
    entries (see ``Layout``)."""
    kv_spec = jax.ShapeDtypeStruct(
        (layout.num_kv_rows, cfg.num_kv_heads, cfg.head_dim), _DTYPES[kv_dtype]
    )

    def kv_pools(num_layers: int) -> KVPools:
        return KVPools(k=[kv_spec] * num_layers, v=[kv_spec] * num_layers)

    num_rec, slots = len(cfg.recurrent_layer_ids), layout.num_slot_rows
    rows = layout.num_req_rows
    return Pools(
        kv=kv_pools(len(cfg.attention_layer_ids)),
        mtp_kv=kv_pools(cfg.num_mtp_layers) if spec else None,
        conv=jax.ShapeDtypeStruct((num_rec, slots, *cfg.conv_state_shape), _DTYPES[kv_dtype]),
        ssm=jax.ShapeDtypeStruct((num_rec, slots, *cfg.ssm_state_shape), _DTYPES[ssm_dtype]),
        seq_len=jax.ShapeDtypeStruct((rows,), jnp.int32),
        last_token=jax.ShapeDtypeStruct((rows,), jnp.int32),
        drafts=jax.ShapeDtypeStruct((rows, layout.num_draft_positions), jnp.int32),
        req_to_token=jax.ShapeDtypeStruct((rows, layout.context_len), jnp.int32),
        output_counts=jax.ShapeDtypeStruct((rows, cfg.vocab_size), jnp.int32),
        in_prompt=jax.ShapeDtypeStruct((rows, cfg.vocab_size), jnp.bool_),
        vocab_mask=jax.ShapeDtypeStruct(
            (rows, layout.num_verify, mask_width(cfg.vocab_size)), jnp.int32
        ),
    )


def _nbytes(leaf: jax.ShapeDtypeStruct) -> int:
    return math.prod(leaf.shape) * leaf.dtype.itemsize


def slot_bytes(pools: Pools) -> int:
    """Bytes of one state slot over all recurrent layers (conv + ssm)."""
    return sum(_nbytes(pool) // pool.shape[1] for pool in (pools.conv, pools.ssm))


def kv_bytes_per_token(pools: Pools) -> int:
    """K + V bytes of one token over all attention layers (the draft head's excluded)."""
    return sum(_nbytes(pool) // pool.shape[0] for pool in pools.kv.k + pools.kv.v)


class Runner:
    def __init__(
        self,
        model: Any,
        layout: Layout,
        static: StepStatic,
        kv_dtype: str,
        ssm_dtype: str,
        sharding: ShardingPlan,
        broadcast: StepBroadcast | None = None,
        draft_token_ids: np.ndarray | None = None,
        decode_copies: int = 1,
    ) -> None:
        """Places the params on ``sharding``'s mesh (a copy where they lie elsewhere) and
        allocates the pools there, each array with the sharding the rule table gives it;
        the steps' kernels run per shard of it (``StepStatic.sharding``). ``broadcast``
        (process 0 of several): every device call is sent through it first, so the other
        processes (in ``follow``) make the same call. ``draft_token_ids`` (a speculative
        token map, ``token_map.draft_token_ids``): the draft head's reduced lm_head is
        gathered once and kept in the params (``draft_vocab.DRAFT_VOCAB``).
        ``decode_copies``: copies of the decode program called in turn (``InTurn``)."""
        self.broadcast = broadcast
        self.family = model.family
        self.cfg = model.config
        self.sharding = sharding
        # a step's host arrays (batch words, table updates) placed before the call: handed
        # numpy, the jitted call moves it itself, 0.25 ms slower per batch-1 step on the
        # H200, but 0.1-0.25 ms faster on a CPU (BENCHMARKS); several processes need
        # global arrays
        platform = sharding.mesh.devices.flat[0].platform
        self.place_inputs = platform != "cpu" or jax.process_count() > 1
        plan = model.family.weight_plan(self.cfg, model.params)
        self.param_shardings = sharding.param_shardings(plan, model.params)
        self.params = jax.device_put(model.params, self.param_shardings)
        if draft_token_ids is not None:
            draft = build_draft_vocab(self.family, self.cfg, self.params, draft_token_ids, sharding)
            self.params = {**self.params, DRAFT_VOCAB: draft}
        self.static = static = dataclasses.replace(static, sharding=sharding)
        self.abstract = abstract_pools(self.cfg, layout, static.spec, kv_dtype, ssm_dtype)
        self.pool_shardings = sharding.pool_shardings(self.abstract)
        self.pools = jax.tree.map(
            lambda leaf, where: jnp.zeros(leaf.shape, leaf.dtype, device=where),
            self.abstract,
            self.pool_shardings,
        )
        self.programs = programs = programs_for(sharding, self.pool_shardings)
        self._extend = functools.partial(programs.extend, self.family, self.cfg, static, sharding)
        decodes = [programs.decode, programs.decode_copy][:decode_copies]
        self.decode_copies = decode_copies
        self._decode = InTurn(
            [functools.partial(d, self.family, self.cfg, static, sharding) for d in decodes]
        )
        self._forward = functools.partial(
            programs.decode_forward, self.family, self.cfg, static, sharding
        )
        self._finish = functools.partial(
            programs.decode_finish, self.family, self.cfg, static, sharding
        )

    def slot_bytes(self) -> int:
        return slot_bytes(self.abstract)

    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.abstract)

    def bytes_per_device(self) -> dict[str, int]:
        """Bytes one device of the mesh holds: weights, KV pools (the draft head's included),
        recurrent-state slot pools, the penalties' token-count pools; reads only."""
        pools = self.pools
        return {
            "tp_size": self.sharding.tp_size,
            "weight_bytes_per_device": device_bytes(self.params),
            "kv_bytes_per_device": device_bytes([pools.kv, pools.mtp_kv]),
            "state_bytes_per_device": device_bytes([pools.conv, pools.ssm]),
            "token_count_bytes_per_device": device_bytes([pools.output_counts, pools.in_prompt]),
        }

    # ------------------------------------------------------------------ steps

    def launch(
        self,
        batch: ExtendBatch | DecodeBatch,
        table_chunks: list[np.ndarray] = (),
        count_seeds: list[CountSeed] = (),
    ) -> dict[str, jax.Array]:
        """Dispatch the step for ``batch`` (a host batch, moved to the device packed into one
        int32 array: one transfer) after applying ``table_chunks`` (request-table updates past the
        batch's own) and ``count_seeds`` (the token histories of newly admitted rows); returns
        its outputs as device arrays without waiting for them."""
        packed = self._prepare(batch, table_chunks, count_seeds)
        if self.broadcast is not None:
            self.broadcast.send_step(batch, packed)
        return self._launch_packed(isinstance(batch, ExtendBatch), packed)

    def _prepare(
        self,
        batch: ExtendBatch | DecodeBatch,
        table_chunks: list[np.ndarray],
        count_seeds: list[CountSeed],
    ) -> PackedBatch:
        """What comes before a step's launch: its table chunks and count seeds written (each
        its own device call), then ``batch`` packed."""
        for chunk in table_chunks:
            self.update_table(chunk)
        for seed in count_seeds:
            self.seed_counts(seed)
        return pack_batch(batch)

    def _launch_packed(
        self, extend: bool, packed: PackedBatch
    ) -> dict[str, jax.Array] | PackedOutputs:
        step = self._extend if extend else self._decode
        words = self._input(packed.words)
        outputs, self.pools = step(
            self.params, self.pools, dataclasses.replace(packed, words=words)
        )
        if extend:
            return outputs
        key = (self.family, self.cfg, self.static, packed.layout)
        return PackedOutputs(outputs, _OUTPUT_LAYOUTS[key])

    def launch_forward(
        self,
        batch: DecodeBatch,
        table_chunks: list[np.ndarray] = (),
        count_seeds: list[CountSeed] = (),
    ) -> PendingDecode:
        """Dispatch the first program of a split decode step (``decode_forward``: table
        updates, target forward, logits) as ``launch`` would the whole step; returns the
        step to hand to ``launch_finish`` once its rows' grammar masks are written. No other
        step may be launched in between (the forward leaves its rows' seq_len, last token
        and drafts for the finish to read)."""
        packed = self._prepare(batch, table_chunks, count_seeds)
        if self.broadcast is not None:
            self.broadcast.send_forward(batch, packed)
        return self._launch_forward(packed)

    def _launch_forward(self, packed: PackedBatch) -> PendingDecode:
        words = self._input(packed.words)
        packed = dataclasses.replace(packed, words=words)
        carry, self.pools = self._forward(self.params, self.pools, packed)
        return PendingDecode(packed, carry)

    def launch_finish(self, pending: PendingDecode) -> dict[str, jax.Array]:
        """Dispatch the second program of a split decode step (``decode_finish``: sampling
        under the grammar masks written since ``launch_forward``, commit, drafts); returns
        the step's outputs as ``launch`` does. ``pending`` is used up (launch it once)."""
        if self.broadcast is not None:
            self.broadcast.send_finish()
        return self._launch_finish(pending)

    def _launch_finish(self, pending: PendingDecode) -> dict[str, jax.Array]:
        outputs, self.pools = self._finish(self.params, self.pools, pending.packed, pending.carry)
        return outputs

    def _input(self, array: np.ndarray) -> np.ndarray | jax.Array:
        """A step's host array as its call takes it: placed on the mesh, replicated
        (``place_inputs``), or the numpy array itself."""
        return jax.device_put(array, self.sharding.replicated) if self.place_inputs else array

    def update_table(self, updates: np.ndarray) -> None:
        """Apply one padded chunk of request-table updates ``[3, table_chunk_len]``."""
        updates = np.asarray(updates, np.int32)
        if self.broadcast is not None:
            self.broadcast.send_table(updates)
        self._apply_table(updates)

    def _apply_table(self, updates: np.ndarray) -> None:
        table = self.programs.table(self.pools.req_to_token, self._input(updates))
        self.pools = dataclasses.replace(self.pools, req_to_token=table)

    def seed_counts(self, seed: CountSeed) -> None:
        """Write one request row's token history into the token-count pools (after every
        step launched before: the row's previous owner may still be written by one)."""
        packed = pack_batch(seed)
        if self.broadcast is not None:
            self.broadcast.send_seed(packed)
        self._apply_seed(packed)

    def _apply_seed(self, packed: PackedBatch) -> None:
        words = self._input(packed.words)
        counts, in_prompt = self.programs.seed(
            self.pools.output_counts, self.pools.in_prompt, dataclasses.replace(packed, words=words)
        )
        self.pools = dataclasses.replace(self.pools, output_counts=counts, in_prompt=in_prompt)

    def read_counts(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copy of one request row's (output counts, prompt marks), for tests."""
        return np.asarray(self.pools.output_counts[row]), np.asarray(self.pools.in_prompt[row])

    def follow(self, broadcast: StepBroadcast) -> int:
        """On a process other than 0: make every device call process 0 sends, in its order,
        until it sends ``STOP``; returns the number of calls made. The outputs stay here
        (process 0 reads its own copy)."""
        num_calls = 0
        pending = None  # a split decode step's forward, until its finish comes
        while True:
            kind, payload = broadcast.receive()
            if kind == STOP:
                return num_calls
            if kind == TABLE:
                self._apply_table(payload)
            elif kind == SEED:
                self._apply_seed(payload)
            elif kind == MASK:
                rows, masks = payload
                self._apply_masks(
                    rows, masks.reshape(len(rows), *self.abstract.vocab_mask.shape[1:])
                )
            elif kind == DECODE_FORWARD:
                pending = self._launch_forward(payload)
            elif kind == DECODE_FINISH:
                self._launch_finish(pending)
                pending = None
            else:
                assert kind in (EXTEND, DECODE), kind
                self._launch_packed(kind == EXTEND, payload)
            num_calls += 1

    def update_vocab_masks(self, rows: np.ndarray, masks: np.ndarray) -> None:
        """Write the grammar bitmasks ``masks [n, D, W]`` of request rows ``rows [n]``
        (before the step that reads them), ``MASK_ROWS_PER_UPDATE`` rows per update."""
        size = MASK_ROWS_PER_UPDATE
        for start in range(0, max(len(rows), 1), size):
            chunk_rows = np.full(size, self.static.sentinel_row, np.int32)
            chunk_masks = np.zeros((size, *self.abstract.vocab_mask.shape[1:]), np.int32)
            part = slice(start, start + size)
            chunk_rows[: len(rows[part])] = rows[part]
            chunk_masks[: len(rows[part])] = masks[part]
            if self.broadcast is not None:
                self.broadcast.send_masks(chunk_rows, chunk_masks)
            self._apply_masks(chunk_rows, chunk_masks)

    def _apply_masks(self, rows: np.ndarray, masks: np.ndarray) -> None:
        place = self.sharding.replicated
        vocab_mask = self.programs.mask(
            self.pools.vocab_mask, jax.device_put(rows, place), jax.device_put(masks, place)
        )
        self.pools = dataclasses.replace(self.pools, vocab_mask=vocab_mask)

    def read_table(self) -> np.ndarray:
        """A writable host copy of the device request table (waits for the launched steps)."""
        return np.array(self.pools.req_to_token)

    @staticmethod
    def fetch(outputs: dict[str, jax.Array] | PackedOutputs) -> dict[str, np.ndarray]:
        """A launched step's outputs on the host (waits for them)."""
        if isinstance(outputs, PackedOutputs):
            return unpack_outputs(np.asarray(outputs.words), outputs.layout)
        return {k: np.asarray(v) for k, v in jax.device_get(outputs).items()}

    @staticmethod
    def num_compiled() -> int:
        """Programs the jitted steps hold, for every runner of this process (runners of equal
        configs and settings share theirs)."""
        return sum(
            jitted._cache_size() for programs in _PROGRAMS.values() for jitted in programs.all()
        )

    def read_slot(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copy of one slot's (conv, ssm) state, for tests and debugging."""
        return np.asarray(self.pools.conv[:, slot]), np.asarray(self.pools.ssm[:, slot])
