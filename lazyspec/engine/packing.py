"""A step's input and output as one int32 array each: a launch moves its batch to the
device in one transfer (``pack_batch`` on the host, ``unpack_batch`` in the step) and a
decode step returns its outputs in one array the host copies back (``pack_outputs`` in the
step, ``unpack_outputs`` on the host). Where each leaf lies is a ``PackedLayout``, static:
one program per layout, which a bucket fixes (``programs.ProgramKey``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lazyspec.scheduler.batch import CountSeed, DecodeBatch, ExtendBatch
from lazyspec.scheduler.request import TOP_LOGPROBS

# The host batches (lazyspec/scheduler/batch.py) are the device batches: registered as
# pytrees here, moved to the device packed (``pack_batch``) and unpacked in the step.
# A decode batch's D is static (one program per value, like its bucket).
_META_FIELDS = {DecodeBatch: ["num_verify", "greedy"]}
for _batch in (ExtendBatch, DecodeBatch, CountSeed):
    _meta = _META_FIELDS.get(_batch, [])
    jax.tree_util.register_dataclass(
        _batch,
        data_fields=[f.name for f in dataclasses.fields(_batch) if f.name not in _meta],
        meta_fields=_meta,
    )


@dataclass(frozen=True)
class PackedLayout:
    """Where each leaf of a packed batch lies: the batch's tree structure and each leaf's
    (shape, dtype name), in flattening order. Static: one compilation per layout, which a
    bucket fixes."""

    treedef: Any
    leaves: tuple[tuple[tuple[int, ...], str], ...]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["words"], meta_fields=["layout"])
@dataclass
class PackedBatch:
    """A host batch as one int32 array (every leaf flattened and bit-cast; bools as 0 / 1),
    so a launch moves it to the device in one transfer; ``unpack_batch`` restores it."""

    words: Any  # [N] int32
    layout: PackedLayout

    @property
    def num_rows(self) -> int:
        return self.layout.leaves[0][0][0]  # req_row [B] leads both batch kinds


def decode_output_words(num_rows: int, num_verify: int) -> int:
    """At least the words of a decode step's packed outputs (``_decode_finish``'s outputs,
    ``pack_outputs``): per row and position, a token, its logprob, a draft and
    ``TOP_LOGPROBS`` top logprobs with their ids; per row, accept_len, crossed and pre."""
    return num_rows * (num_verify * (3 + 2 * TOP_LOGPROBS) + 3)


# (treedef, each leaf's (shape, dtype)) -> (its PackedLayout, each leaf's size, the words to
# allocate): a bucket's layout is built once, not on every step
_LAYOUTS: dict[Any, tuple[PackedLayout, tuple[int, ...], int]] = {}


def pack_batch(batch: ExtendBatch | DecodeBatch) -> PackedBatch:
    """Host side: ``batch``'s leaves, each 4 bytes wide (int32, uint32, float32) or bool,
    written into one int32 array. A decode batch's array is padded (zeros) to at least its
    step's packed outputs (``decode_output_words``): the step is handed the words and writes
    its outputs over them, so a step allocates no output buffer of its own."""
    leaves, treedef = jax.tree.flatten(batch)
    key = (treedef, tuple((leaf.shape, leaf.dtype) for leaf in leaves))
    known = _LAYOUTS.get(key)
    if known is None:
        layout = PackedLayout(treedef, tuple((shape, dtype.name) for shape, dtype in key[1]))
        sizes = tuple(math.prod(shape) for shape, _ in key[1])
        room = 0
        if isinstance(batch, DecodeBatch):
            room = decode_output_words(len(batch.req_row), batch.num_verify)
        known = _LAYOUTS[key] = (layout, sizes, max(sum(sizes), room))
    layout, sizes, length = known
    words = np.empty(length, np.int32)
    offset = 0
    for leaf, size in zip(leaves, sizes):
        flat = leaf.reshape(-1)
        words[offset : offset + size] = flat if flat.dtype == np.bool_ else flat.view(np.int32)
        offset += size
    words[offset:] = 0
    return PackedBatch(words, layout)


def unpack_batch(packed: PackedBatch) -> ExtendBatch | DecodeBatch:
    """Device side (traced): the batch ``pack_batch`` packed."""
    leaves, offset = [], 0
    for shape, dtype in packed.layout.leaves:
        size = math.prod(shape)
        words = packed.words[offset : offset + size].reshape(shape)
        offset += size
        if dtype == "bool":
            leaves.append(words != 0)
        else:
            leaves.append(jax.lax.bitcast_convert_type(words, jnp.dtype(dtype)))
    return jax.tree.unflatten(packed.layout.treedef, leaves)


def pack_outputs(outputs: dict[str, jax.Array]) -> tuple[jax.Array, PackedLayout]:
    """Device side (traced): a step's outputs (each leaf 4 bytes wide or bool) as one int32
    array and where each lies, so the step allocates one output buffer and the host copies
    one array back (``unpack_outputs``)."""
    leaves, treedef = jax.tree.flatten(outputs)
    words = []
    for leaf in leaves:
        if leaf.dtype == jnp.bool_:
            words.append(leaf.astype(jnp.int32).reshape(-1))
        elif leaf.dtype.itemsize == 4:
            words.append(jax.lax.bitcast_convert_type(leaf, jnp.int32).reshape(-1))
        else:
            raise TypeError(f"a packed output must be 4 bytes wide or bool, not {leaf.dtype}")
    layout = PackedLayout(treedef, tuple((leaf.shape, leaf.dtype.name) for leaf in leaves))
    return jnp.concatenate(words), layout


def unpack_outputs(words: np.ndarray, layout: PackedLayout) -> dict[str, np.ndarray]:
    """Host side: the outputs ``pack_outputs`` packed, as numpy views of ``words``."""
    leaves, offset = [], 0
    for shape, dtype in layout.leaves:
        size = math.prod(shape)
        flat = words[offset : offset + size]
        offset += size
        leaves.append((flat != 0 if dtype == "bool" else flat.view(dtype)).reshape(shape))
    return jax.tree.unflatten(layout.treedef, leaves)


def decode_output_layout(num_rows: int, num_verify: int, spec: bool) -> PackedLayout:
    """The layout of a decode step's packed outputs (``steps.decode_step``'s outputs, as
    ``pack_outputs`` lays them out), from the batch's rows and positions and whether the
    engine drafts: the host reads it from the program's key, and the step checks its outputs
    against it as it is traced (``programs.step_program``). Per row and position a token,
    its logprob and ``TOP_LOGPROBS`` top logprobs with their ids; per row accept_len,
    crossed, pre and the next verify's drafts (none without speculation or at D = 1)."""
    rows, top = (num_rows,), (num_rows, num_verify, TOP_LOGPROBS)
    leaves = {
        "accept_len": (rows, "int32"),
        "crossed": (rows, "bool"),
        "drafts": ((num_rows, num_verify - 1 if spec else 0), "int32"),
        "logprobs": ((num_rows, num_verify), "float32"),
        "pre": (rows, "int32"),
        "tokens": ((num_rows, num_verify), "int32"),
        "top_ids": (top, "int32"),
        "top_logprobs": (top, "float32"),
    }
    treedef = jax.tree.structure(dict.fromkeys(leaves, 0))
    return PackedLayout(treedef, tuple(leaves[name] for name in sorted(leaves)))
