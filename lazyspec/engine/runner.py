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
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lazyspec.engine import multihost
from lazyspec.engine.draft_vocab import DRAFT_VOCAB, build_draft_vocab
from lazyspec.engine.multihost import StepBroadcast
from lazyspec.engine.packing import (
    PackedBatch,
    PackedLayout,
    decode_output_layout,
    pack_batch,
    unpack_outputs,
)
from lazyspec.engine.programs import (
    DECODE,
    EXTEND,
    FINISH,
    FORWARD,
    LOAD,
    MASK,
    MASK_ROWS_PER_UPDATE,
    SEED,
    STORE,
    TABLE,
    Program,
    ProgramKey,
    num_compiled,
    program_input,
    program_keys,
    programs_for,
)
from lazyspec.engine.sharding import ShardingPlan, device_bytes
from lazyspec.engine.step_calls import StepCalls
from lazyspec.engine.steps import DecodeCarry, ExtendBatch, Pools, StepStatic
from lazyspec.engine.tier_programs import TierBlock, block_shardings, block_spec, padded_ids
from lazyspec.models.interface import KVPools
from lazyspec.scheduler.batch import CountSeed, DecodeBatch, table_updates
from lazyspec.scheduler.grammar import mask_width
from lazyspec.scheduler.layout import Layout

logger = logging.getLogger(__name__)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# the programs of one shape each: a request-table chunk, a count seed, a mask update, the
# host tier's store and load
FIXED = (TABLE, SEED, MASK, STORE, LOAD)


@dataclasses.dataclass
class PendingDecode:
    """A decode step whose forward is launched and whose sample-and-commit program is not:
    its packed batch and the forward's device outputs (``Runner.launch_forward``)."""

    packed: PackedBatch
    carry: DecodeCarry


@dataclasses.dataclass(frozen=True)
class PackedOutputs:
    """A launched decode step's outputs as one device array (``programs.step_program``) and
    their layout; ``Runner.fetch`` unpacks them."""

    words: jax.Array
    layout: PackedLayout

    def copy_to_host_async(self) -> None:
        self.words.copy_to_host_async()


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


def _spec(array: jax.Array) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=array.sharding)


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
        grammar: str | None = None,
    ) -> None:
        """Places the params on ``sharding``'s mesh (a copy where they lie elsewhere) and
        allocates the pools there, each array with the sharding the rule table gives it;
        the steps' kernels run per shard of it (``StepStatic.sharding``). ``broadcast``
        (process 0 of several): every device call is sent through it first, so the other
        processes (in ``follow``) make the same call. ``draft_token_ids`` (a speculative
        token map, ``token_map.draft_token_ids``): the draft head's reduced lm_head is
        gathered once and kept in the params (``draft_vocab.DRAFT_VOCAB``).
        ``decode_copies``: copies of the decode program called in turn (``StepCalls``);
        ``grammar``: how batches with grammar rows are served (``programs.program_keys``)."""
        self.broadcast = broadcast
        self.family = model.family
        self.cfg = model.config
        self.sharding = sharding
        # a step's host arrays (batch words, table updates) placed before the call: handed
        # numpy, the jitted call moves it itself, 0.25 ms slower per batch-1 step on the
        # H200, but 0.1-0.25 ms faster on a CPU (BENCHMARKS); several processes need
        # global arrays
        self.place_inputs = sharding.platform != "cpu" or jax.process_count() > 1
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
        self._bind_programs(layout, decode_copies, grammar)

    def _bind_programs(self, layout: Layout, decode_copies: int, grammar: str | None) -> None:
        """The programs this runner launches and its table (``programs.program_keys``):
        the keys, and each decode program's output layout by its batch's packed layout."""
        self.layout, self.decode_copies = layout, decode_copies
        self.program_keys = program_keys(layout, decode_copies, grammar)
        self.programs = programs = programs_for(self.sharding, self.pool_shardings)

        def calls(*jitted) -> StepCalls:
            static = (self.family, self.cfg, self.static, self.sharding)
            return StepCalls([functools.partial(step, *static) for step in jitted])

        self._extend = calls(programs.extend)
        self._decode = calls(*[programs.decode, programs.decode_copy][:decode_copies])
        self._forward, self._finish = calls(programs.decode_forward), calls(programs.decode_finish)
        self._steps = {EXTEND: self._extend, DECODE: self._decode}
        self._steps.update({FORWARD: self._forward, FINISH: self._finish})
        self._fixed = {kind: programs.jitted(ProgramKey(kind)) for kind in FIXED}
        self._bound: set[ProgramKey] = set()  # the keys bound to an executable (``bind``)
        # each batch program's packed layout by its key, and its key by its step kind and
        # layout (a decode key's copy is the one ``StepCalls`` calls next)
        self._layouts = {
            key: pack_batch(program_input(layout, key)).layout
            for key in self.program_keys
            if key.kind in self._steps and key.copy == 0
        }
        self._batch_keys = {(key.kind, packed): key for key, packed in self._layouts.items()}
        self._output_layouts = {
            packed: decode_output_layout(key.rows, key.tokens, self.static.spec)
            for (kind, packed), key in self._batch_keys.items()
            if kind == DECODE
        }
        self._fixed_keys = {key.kind: key for key in self.program_keys if key.kind in FIXED}
        # the table's programs still compiling (``warmup.TableCompiler``): a launch of one
        # waits for it; None once all are compiled (or the table was not compiled ahead)
        self.compiling: Any = None

    def _await_program(self, kind: str, packed: PackedLayout | None = None) -> None:
        """Block until the program that runs a ``kind`` step (of a batch laid out as
        ``packed``) is compiled, if the table is still compiling; a program of no key of
        the table is left to compile as it is called. A decode program's second copy not
        yet compiled is not waited for: the first copy is called in its turn (at the cost
        of its command buffers' update)."""
        compiling = self.compiling
        if compiling is None:
            return
        if packed is None:
            key = self._fixed_keys.get(kind)
        else:
            key = self._batch_keys.get((kind, packed))
            if key is not None and kind == DECODE:
                turn = dataclasses.replace(key, copy=self._decode.turn)
                if compiling.compiled(turn):
                    key = turn
                else:  # a second copy still compiling: the first runs in its turn
                    self._decode.turn = 0
        if key is not None:
            compiling.wait(key)
        if compiling.done:
            self.compiling = None

    def bind(self, key: ProgramKey, compiled: Callable) -> None:
        """Call ``key``'s program as ``compiled``, its executable (taking the arguments of
        its jitted function but the static ones), from now on; safe from any thread."""
        if key.kind in FIXED:
            self._fixed[key.kind] = compiled
        else:
            layout = self._layouts[dataclasses.replace(key, copy=0)]
            self._steps[key.kind].bind(layout, key.copy, compiled)
        self._bound.add(key)

    def _unlisted_output_layout(self, layout: PackedLayout) -> PackedLayout:
        """The output layout of a decode batch laid out as ``layout`` but of no key of the
        table (serving builds none: its program compiles while serving)."""
        logger.warning("a decode batch of no program of the table: %s", layout.leaves)
        batch = jax.tree.unflatten(layout.treedef, [None] * len(layout.leaves))
        rows = PackedBatch(None, layout).num_rows
        out = decode_output_layout(rows, batch.num_verify, self.static.spec)
        self._output_layouts[layout] = out
        return out

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
        if self.compiling is not None:
            self._await_program(EXTEND if extend else DECODE, packed.layout)
        words = self._input(packed.words)
        outputs, self.pools = step(
            self.params, self.pools, dataclasses.replace(packed, words=words)
        )
        if extend:
            return outputs
        layout = self._output_layouts.get(packed.layout)
        return PackedOutputs(outputs, layout or self._unlisted_output_layout(packed.layout))

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
        if self.compiling is not None:
            self._await_program(FORWARD, packed.layout)
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
        if self.compiling is not None:
            self._await_program(FINISH, pending.packed.layout)
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
        self._await_program(TABLE)
        table = self._fixed[TABLE](self.pools.req_to_token, self._input(updates))
        self.pools = dataclasses.replace(self.pools, req_to_token=table)

    def seed_counts(self, seed: CountSeed) -> None:
        """Write one request row's token history into the token-count pools (after every
        step launched before: the row's previous owner may still be written by one)."""
        packed = pack_batch(seed)
        if self.broadcast is not None:
            self.broadcast.send_seed(packed)
        self._apply_seed(packed)

    def _apply_seed(self, packed: PackedBatch) -> None:
        self._await_program(SEED)
        words = self._input(packed.words)
        counts, in_prompt = self._fixed[SEED](
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
            if kind == multihost.STOP:
                return num_calls
            if kind == multihost.TABLE:
                self._apply_table(payload)
            elif kind == multihost.SEED:
                self._apply_seed(payload)
            elif kind == multihost.MASK:
                rows, masks = payload
                self._apply_masks(
                    rows, masks.reshape(len(rows), *self.abstract.vocab_mask.shape[1:])
                )
            elif kind == multihost.DECODE_FORWARD:
                pending = self._launch_forward(payload)
            elif kind == multihost.DECODE_FINISH:
                self._launch_finish(pending)
                pending = None
            else:
                assert kind in (multihost.EXTEND, multihost.DECODE), kind
                self._launch_packed(kind == multihost.EXTEND, payload)
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
        self._await_program(MASK)
        place = self.sharding.replicated
        vocab_mask = self._fixed[MASK](
            self.pools.vocab_mask, jax.device_put(rows, place), jax.device_put(masks, place)
        )
        self.pools = dataclasses.replace(self.pools, vocab_mask=vocab_mask)

    def store_block(self, slots: np.ndarray, rows: np.ndarray) -> TierBlock:
        """Dispatch the gather of state ``slots`` and KV ``rows`` (padded to the store
        program's key with slot 0 / row 0, which read zeros); returns the block without
        waiting (in host memory where the device has one: ``tier_programs``)."""
        self._await_program(STORE)
        return self._fixed[STORE](self.pools, self._input(slots), self._input(rows))

    def load_block(self, slots: np.ndarray, rows: np.ndarray, block: TierBlock) -> None:
        """Dispatch the scatter of ``block`` (host arrays) into state ``slots`` and KV
        ``rows`` (padded with the drop sentinels, which write nothing)."""
        self._await_program(LOAD)
        placed = jax.device_put(block, block_shardings(self.pool_shardings))
        self.pools = self._fixed[LOAD](self.pools, self._input(slots), self._input(rows), placed)

    def read_table(self) -> np.ndarray:
        """A writable host copy of the device request table (waits for the launched steps)."""
        return np.array(self.pools.req_to_token)

    @staticmethod
    def fetch(outputs: dict[str, jax.Array] | PackedOutputs) -> dict[str, np.ndarray]:
        """A launched step's outputs on the host (waits for them)."""
        if isinstance(outputs, PackedOutputs):
            return unpack_outputs(np.asarray(outputs.words), outputs.layout)
        return {k: np.asarray(v) for k, v in jax.device_get(outputs).items()}

    def num_compiled(self) -> int:
        """Programs compiled: the keys bound to an executable (``bind``) and the executables
        the jitted steps hold, for every runner of this process (runners of equal configs and
        settings share theirs)."""
        return len(self._bound) + num_compiled()

    # ------------------------------------------------------------------ the program table

    def warm(self, key: ProgramKey) -> None:
        """Run ``key``'s program once on an all-padding input, which writes nothing, through
        the calls serving makes (so other processes make them too): compiles it unless it
        is compiled. A split decode step's key runs both its programs."""
        kind = key.kind
        if kind == TABLE:
            self.update_table(table_updates(self.layout, None, key.tokens))
            self.read_table()
        elif kind == SEED:
            self.seed_counts(program_input(self.layout, key))
            jax.block_until_ready((self.pools.output_counts, self.pools.in_prompt))
        elif kind == MASK:
            no_masks = np.zeros((0, *self.abstract.vocab_mask.shape[1:]), np.int32)
            self.update_vocab_masks(np.zeros(0, np.int32), no_masks)
        elif kind in (FORWARD, FINISH):
            pending = self.launch_forward(program_input(self.layout, key))
            self.fetch(self.launch_finish(pending))
        elif kind in (STORE, LOAD):
            slots, rows = self._tier_padding(key)
            block = jax.tree.map(np.asarray, self.store_block(slots * 0, rows * 0))
            if kind == LOAD:
                self.load_block(slots, rows, block)
            jax.block_until_ready(self.pools.conv)
        else:
            assert kind in (EXTEND, DECODE), key
            self._decode.turn = key.copy
            self.fetch(self.launch(program_input(self.layout, key)))

    def program_table(self) -> tuple[Program, ...]:
        """The table as programs to lower or compile ahead of a call: each key with the
        jitted function that runs it and, made as it is lowered, arguments of the shapes and
        shardings serving calls it with (a split step's finish compiles its forward first,
        for the shardings of its carry)."""
        # the shapes and shardings of the params and pools now: a program may lower in
        # another thread while serving replaces (donates) the pools
        specs = jax.tree.map(_spec, (self.params, self.pools))
        return tuple(
            Program(
                key, self.programs.jitted(key), functools.partial(self._program_args, key, *specs)
            )
            for key in self.program_keys
        )

    def _program_args(self, key: ProgramKey, params: Any, pools: Pools, carry: bool = True):
        """The arguments ``key``'s program is called with (``params`` and ``pools``
        abstract, as other arrays on the device); a finish's carry (its forward's compiled
        outputs) only with ``carry``."""
        if key.kind == TABLE:
            updates = table_updates(self.layout, None, key.tokens)
            return pools.req_to_token, self._input_spec(updates)
        if key.kind == MASK:
            width = self.abstract.vocab_mask.shape[1:]
            rows = jax.ShapeDtypeStruct((key.rows,), jnp.int32, sharding=self.sharding.replicated)
            masks = jax.ShapeDtypeStruct((key.rows, *width), jnp.int32, sharding=rows.sharding)
            return pools.vocab_mask, rows, masks
        if key.kind in (STORE, LOAD):
            slots, rows = (self._input_spec(ids) for ids in self._tier_padding(key))
            if key.kind == STORE:
                return pools, slots, rows
            shardings = block_shardings(self.pool_shardings)
            spec = block_spec(self.abstract, key.rows, key.tokens)
            block = jax.tree.map(
                lambda leaf, where: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=where),
                spec,
                shardings,
            )
            return pools, slots, rows, block
        packed = pack_batch(program_input(self.layout, key))
        packed = dataclasses.replace(packed, words=self._input_spec(packed.words))
        if key.kind == SEED:
            return pools.output_counts, pools.in_prompt, packed
        args = (self.family, self.cfg, self.static, self.sharding, params, pools, packed)
        if key.kind == FINISH and carry:
            outputs, _ = self.programs.decode_forward.lower(*args).compile().out_info
            args += (outputs,)
        return args

    def _tier_padding(self, key: ProgramKey) -> tuple[np.ndarray, np.ndarray]:
        """A copy program's all-padding ids: the drop sentinels (a scatter writes nothing)."""
        return (
            padded_ids([], key.rows, self.layout.sentinel_slot),
            padded_ids([], key.tokens, self.layout.sentinel_kv_row),
        )

    def _input_spec(self, array: np.ndarray) -> np.ndarray | jax.ShapeDtypeStruct:
        """A step's host array as its call takes it (``_input``), abstract where placed."""
        if not self.place_inputs:
            return array
        return jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=self.sharding.replicated)

    def read_slot(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copy of one slot's (conv, ssm) state, for tests and debugging."""
        return np.asarray(self.pools.conv[:, slot]), np.asarray(self.pools.ssm[:, slot])
