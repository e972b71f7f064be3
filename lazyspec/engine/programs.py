"""The device programs of an engine, as one table.

A program is a jitted step compiled for one input shape. ``program_keys`` enumerates, once,
every program an engine serves with from its ``Layout`` and what it serves (copies of the
decode program, grammar rows): one ``ProgramKey`` per step kind x bucket x positions per
row (D with speculation, K decode steps without) x form (greedy, a grammar batch's split
step) x copy. The static half of each program's key is its step's static arguments, hashed
by value: the model family and config, ``StepStatic`` (the kernels and their ``Tuning``
included) and the ``ShardingPlan``; equal engines share their programs, and two tunings
compile two.

The runner reads the table: its warm-up runs every key (``Runner.warm``), its launches read
a decode program's output layout from it, and ``Runner.program_table`` pairs each key with
the jitted function and the arguments that compile it (``Program.lower`` / ``compile``),
which start-up, lowering checks and the zero-compile tests iterate. Nothing is recorded
while a program is traced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from lazyspec.engine.packing import (
    PackedBatch,
    decode_output_layout,
    pack_outputs,
    unpack_batch,
)
from lazyspec.engine.sharding import ShardingPlan
from lazyspec.engine.steps import (
    Pools,
    apply_table_updates,
    apply_vocab_masks,
    decode_finish,
    decode_forward,
    decode_step,
    extend_step,
    seed_counts,
)
from lazyspec.engine.tier_programs import (
    block_shardings,
    gather_tier,
    host_memory_kind,
    scatter_tier,
)
from lazyspec.scheduler.batch import (
    CountSeed,
    DecodeBatch,
    ExtendBatch,
    build_decode,
    build_extend,
    empty_count_seed,
)
from lazyspec.scheduler.layout import TRANSFER_SLOTS, Layout

# the step kinds: a prefill chunk; a fused decode step; a decode step split in two programs
# around its grammar masks (``steps.decode_forward``, ``steps.decode_finish``); a request-
# table chunk, a token-count seed and a grammar-mask update; the host tier's gather of a
# store and scatter of a load (``tier_programs``)
EXTEND, DECODE, FORWARD, FINISH, TABLE, SEED, MASK, STORE, LOAD = (
    "extend",
    "decode",
    "forward",
    "finish",
    "table",
    "seed",
    "mask",
    "store",
    "load",
)
# how an engine serves grammar rows: not at all (no tokenizer), with the decode step split
# around their masks (the overlapped loop), or in the fused step (without overlap)
SPLIT, FUSED = "split", "fused"
# grammar rows whose bitmasks one mask update writes (one compiled shape; more rows take
# several updates)
MASK_ROWS_PER_UPDATE = 8


@dataclass(frozen=True)
class ProgramKey:
    """One program of an engine: its step kind and the input shape it is compiled for."""

    kind: str
    rows: int = 0  # batch rows (the bucket; a decode bucket's as ``Layout.decode_rows``)
    tokens: int = 0  # extend: tokens a row; decode, forward, finish: positions a row
    greedy: bool = False  # the argmax-only form (``DecodeBatch.greedy``)
    copy: int = 0  # which copy of the decode program (``step_calls.StepCalls``)


def program_keys(
    layout: Layout, decode_copies: int = 1, grammar: str | None = None
) -> tuple[ProgramKey, ...]:
    """Every program an engine of ``layout`` serves with, each once: every extend bucket;
    every decode shape (``Layout.decode_shapes``) in the general and the greedy form, once
    per copy of the decode program; the programs of batches with grammar rows (``grammar``:
    None, ``SPLIT`` or ``FUSED``); the table-chunk, count-seed and mask-update programs;
    with a host tier, its store and load programs."""
    keys = [ProgramKey(EXTEND, rows, length) for rows, length in layout.extend_shapes]
    keys += [
        ProgramKey(DECODE, rows, positions, greedy, copy)
        for rows, positions in layout.decode_shapes
        for greedy in (False, True)
        for copy in range(decode_copies)
    ]
    keys += _grammar_keys(layout, decode_copies, grammar)
    keys += [
        ProgramKey(TABLE, 3, layout.table_chunk_len),
        ProgramKey(SEED, 1),
        ProgramKey(MASK, MASK_ROWS_PER_UPDATE, layout.num_verify),
    ]
    if layout.host_tier:
        keys += [ProgramKey(kind, TRANSFER_SLOTS, layout.transfer_rows) for kind in (STORE, LOAD)]
    return tuple(dict.fromkeys(keys))


def _grammar_keys(layout: Layout, decode_copies: int, grammar: str | None) -> list[ProgramKey]:
    """The decode programs of batches with grammar rows, never greedy: each decode shape,
    or with K decode steps one token a step (a grammar row's mask follows each token)."""
    if grammar is None:
        return []
    shapes = layout.decode_shapes
    if layout.decode_steps > 1:
        shapes = tuple((layout.decode_rows(rows, 1), 1) for rows in layout.decode_buckets)
    if grammar == SPLIT:
        return [ProgramKey(kind, *shape) for shape in shapes for kind in (FORWARD, FINISH)]
    assert grammar == FUSED, grammar
    copies = range(decode_copies)
    return [ProgramKey(DECODE, *shape, False, copy) for shape in shapes for copy in copies]


def program_input(layout: Layout, key: ProgramKey) -> ExtendBatch | DecodeBatch | CountSeed:
    """The all-padding input of a batch program (it writes nothing): the same tree and leaf
    shapes as every batch of its bucket."""
    if key.kind == EXTEND:
        return build_extend(layout, [], num_rows=key.rows, length=key.tokens)
    if key.kind == SEED:
        return empty_count_seed(layout)
    assert key.kind in (DECODE, FORWARD, FINISH), key
    return build_decode(layout, [], num_rows=key.rows, num_verify=key.tokens, greedy=key.greedy)


def step_program(step, replicate_outputs: bool = True, packed_outputs: bool = False):
    """``step`` as a program: it takes the sharding plan as a further static argument and
    its batch packed (``PackedBatch``); the pools it returns are constrained to the
    shardings they came in with (every masked scatter writes a pool in place) and its small
    outputs are replicated (unless not ``replicate_outputs``: a split decode step's carry
    keeps the shardings the forward gives it, logits by vocabulary, states by heads). With
    ``packed_outputs`` (a decode step) it returns its outputs packed into one int32 array
    the shape of its batch's words, which it is handed (donated): no output buffer to
    allocate and one copy back per step; their layout is the key's
    (``packing.decode_output_layout``), checked here as the step is traced."""

    def run(fam, cfg, static, sharding: ShardingPlan, params, pools, packed: PackedBatch, *rest):
        batch = unpack_batch(packed)
        outputs, pools = step(fam, cfg, static, params, pools, batch, *rest)
        pools = jax.lax.with_sharding_constraint(pools, sharding.pool_shardings(pools))
        if replicate_outputs:
            outputs = jax.lax.with_sharding_constraint(outputs, sharding.replicated)
        if packed_outputs:
            outputs = _packed(outputs, packed, static.spec, batch.num_verify)
        return outputs, pools

    run.__name__ = step.__name__
    return run


def _packed(outputs: dict[str, jax.Array], packed: PackedBatch, spec: bool, num_verify: int):
    """A decode step's ``outputs`` packed into the shape of its batch's ``packed`` words."""
    words, layout = pack_outputs(outputs)
    expected = decode_output_layout(packed.num_rows, num_verify, spec)
    if layout != expected:
        raise AssertionError(
            f"a decode step's outputs are laid out as {layout.leaves}, not as its key says "
            f"(packing.decode_output_layout): {expected.leaves}"
        )
    room = packed.words.shape[0]
    if words.shape[0] > room:
        raise AssertionError(
            f"a decode step's outputs take {words.shape[0]} words, more than its batch's "
            f"{room}: packing.decode_output_words undercounts them"
        )
    return jnp.pad(words, (0, room - words.shape[0]))


@dataclass(frozen=True)
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
    store: Any  # (pools, slots, rows) -> TierBlock (in host memory where there is one)
    load: Any  # (pools, slots, rows, block) -> pools

    def all(self) -> tuple[Any, ...]:
        return tuple(getattr(self, field.name) for field in dataclasses.fields(self))

    def jitted(self, key: ProgramKey) -> Any:
        """The jitted function that runs ``key``'s program."""
        if key.kind == DECODE:
            return (self.decode, self.decode_copy)[key.copy]
        names = {FORWARD: "decode_forward", FINISH: "decode_finish"}
        return getattr(self, names.get(key.kind, key.kind))


# One Programs per set of pool shardings: every runner of an equal model and equal settings
# shares one compilation per shape (the config, the family, the static settings and the
# sharding plan are static arguments hashed by value). Made as runners are built.
_PROGRAMS: dict[tuple, Programs] = {}


def programs_for(sharding: ShardingPlan, pool_shardings: Pools) -> Programs:
    """The programs whose pool outputs carry ``pool_shardings`` (made once per such set)."""
    leaves, treedef = jax.tree.flatten(pool_shardings)
    key = (sharding, treedef, tuple(leaves))
    if key not in _PROGRAMS:
        step_out = (sharding.replicated, pool_shardings)

        def step_jit(step, replicate_outputs: bool = True, packed_outputs: bool = False):
            return jax.jit(
                step_program(step, replicate_outputs, packed_outputs),
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
            store=jax.jit(
                gather_tier,
                out_shardings=block_shardings(pool_shardings, host_memory_kind(sharding)),
            ),
            load=jax.jit(scatter_tier, donate_argnums=(0,), out_shardings=pool_shardings),
        )
    return _PROGRAMS[key]


def num_compiled() -> int:
    """Executables the jitted programs of this process hold (every runner's)."""
    return sum(jitted._cache_size() for programs in _PROGRAMS.values() for jitted in programs.all())


def _seed_packed(output_counts, in_prompt, packed: PackedBatch):
    return seed_counts(output_counts, in_prompt, unpack_batch(packed))


@dataclass(frozen=True)
class Program:
    """One entry of a runner's program table: its key, the jitted function that runs it and
    the arguments it is compiled for, static ones first (its compiled executable takes the
    others), those abstract where they are device arrays (shapes, dtypes and shardings are
    all a compilation reads). The arguments are made as it is lowered: a split step's
    finish takes its forward's carry, whose shardings the forward's compilation picks
    (``arguments(carry=False)`` leaves it out)."""

    key: ProgramKey
    jitted: Any
    arguments: Callable[..., tuple]  # (carry=True) -> the arguments

    def lower(self) -> jax.stages.Lowered:
        return self.jitted.lower(*self.arguments())

    def compile(self) -> jax.stages.Compiled:
        """The program compiled ahead of a call; a later call with arguments of these
        shapes and shardings runs it without compiling again (and compiling after such a
        call compiles nothing)."""
        return self.lower().compile()

    def signature(self) -> tuple:
        """What decides the program besides the code, made without compiling anything: its
        arguments, a finish's carry left out (its forward's arguments decide it)."""
        return self.arguments(carry=False)
