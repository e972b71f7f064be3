"""The speculative token map (SGLang's ``--speculative-token-map``): the "hot" token ids the
draft head scores.

With a map, each draft step computes the MTP logits over the map's ids only (the lm_head's
columns of those ids, gathered once at start-up: ``engine/draft_vocab.py``) and maps the
argmax back to the full id. Drafts only decide how many tokens a verify step accepts; the
verify always scores the whole vocabulary, so outputs do not depend on the map.

A map file holds distinct non-negative token ids, in one of three formats (by suffix):

* ``.json``: a JSON list of integers;
* ``.npy``: a one-dimensional integer numpy array;
* anything else: text, one id per line (blank lines and ``#`` comments ignored).

``draft_token_ids`` completes a map for a model: every id in range, the EOS ids added,
sorted (so ties pick the smallest id, as the full argmax does), and padded up to a multiple
of ``TOKEN_MAP_ALIGN`` by repeating the last id, so the reduced matmul tiles well (a
repeated column has the same logit, and the argmax's first index wins, so padding never
changes a draft).

Host-only: numpy, no jax (``EngineConfig`` validates the file with ``read_token_map``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

TOKEN_MAP_ALIGN = 128  # the reduced head's width is a multiple of this


def read_token_map(path: str | Path) -> np.ndarray:
    """The ids of the map file at ``path`` (int64, in file order). ValueError naming the file
    and the offending value when it is missing, unreadable, empty, holds a non-integer, a
    negative or a repeated id."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"speculative_token_map={str(path)!r}: no such file")
    try:
        values = _parse(path)
    except (ValueError, OSError) as exc:
        raise ValueError(f"speculative_token_map={str(path)!r}: cannot read it ({exc})") from None
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(
                f"speculative_token_map={str(path)!r}: {value!r} is not an integer token id"
            )
    try:
        ids = np.asarray(values, np.int64)
    except OverflowError:
        big = max(values, key=abs)
        raise ValueError(
            f"speculative_token_map={str(path)!r}: token id {big} is too large"
        ) from None
    if ids.size == 0:
        raise ValueError(f"speculative_token_map={str(path)!r} holds no token id")
    if ids.min() < 0:
        raise ValueError(f"speculative_token_map={str(path)!r}: negative token id {ids.min()}")
    unique, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
        raise ValueError(
            f"speculative_token_map={str(path)!r}: token id {unique[counts > 1][0]} appears "
            f"{counts[counts > 1][0]} times (ids must be unique)"
        )
    return ids


def _parse(path: Path) -> list:
    if path.suffix == ".npy":
        array = np.load(path, allow_pickle=False)
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"expected a 1-D integer array, got {array.dtype} {array.shape}")
        return [int(v) for v in array]
    text = path.read_text()
    if path.suffix == ".json":
        values = json.loads(text)
        if not isinstance(values, list):
            raise ValueError(f"expected a JSON list of token ids, got {type(values).__name__}")
        return values
    values = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            values.append(int(line))
        except ValueError:
            raise ValueError(f"line {number}: {line!r} is not an integer token id") from None
    return values


def draft_token_ids(ids: np.ndarray, vocab_size: int, eos_ids: Iterable[int]) -> np.ndarray:
    """The draft head's token ids for a model of ``vocab_size``: ``ids`` (from
    ``read_token_map``) plus the EOS ids, sorted, padded to a multiple of ``TOKEN_MAP_ALIGN``
    by repeating the largest id (int32). ValueError naming an id outside the vocabulary."""
    ids = np.asarray(ids, np.int64)
    if ids.size and (ids.max() >= vocab_size or ids.min() < 0):
        bad = ids[(ids >= vocab_size) | (ids < 0)][0]
        raise ValueError(
            f"speculative_token_map: token id {bad} is outside the model's vocabulary "
            f"[0, {vocab_size})"
        )
    ids = np.union1d(ids, np.asarray(list(eos_ids), np.int64))
    width = -(-ids.size // TOKEN_MAP_ALIGN) * TOKEN_MAP_ALIGN
    padded = np.full(width, ids[-1], np.int32)
    padded[: ids.size] = ids
    return padded


def most_frequent_ids(counts: np.ndarray, k: int) -> np.ndarray:
    """The ids of the ``k`` largest ``counts`` (most frequent first, ties by smaller id),
    only ids counted at least once: fewer than ``k`` when fewer occur."""
    if k <= 0:
        raise ValueError(f"k={k} must be positive")
    seen = np.flatnonzero(counts > 0)
    order = np.lexsort((seen, -counts[seen]))  # last key first: count descending, then id
    return seen[order][:k]


def count_token_ids(tokenizer: Any, texts: Iterable[str], vocab_size: int) -> np.ndarray:
    """How often each id occurs in ``texts`` encoded by ``tokenizer`` (a ``tokenizers``
    tokenizer: ``encode(text).ids``), ``[vocab_size]`` int64. ValueError naming an id the
    vocabulary does not hold."""
    counts = np.zeros(vocab_size, np.int64)
    for text in texts:
        ids = np.asarray(tokenizer.encode(text).ids, np.int64)
        if ids.size and ids.max() >= vocab_size:
            raise ValueError(f"token id {ids.max()} is outside the vocabulary [0, {vocab_size})")
        counts += np.bincount(ids, minlength=vocab_size)
    return counts


def write_token_map(path: str | Path, ids: np.ndarray) -> None:
    """Write ``ids`` to ``path`` in the format its suffix names (see the module docstring)."""
    path = Path(path)
    ids = np.asarray(ids, np.int64)
    if path.suffix == ".npy":
        np.save(path, ids)
    elif path.suffix == ".json":
        path.write_text(json.dumps([int(i) for i in ids]) + "\n")
    else:
        path.write_text("".join(f"{int(i)}\n" for i in ids))
