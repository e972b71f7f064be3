"""The default model's corpus: the Python standard library's own ``.py`` files.

Every ``.py`` file under the running interpreter's stdlib folder (site-packages excluded),
sorted by relative path; a file is held out for validation when
``crc32(relative path) % 20 == 0``. A byte-level BPE tokenizer is trained on the training
files; each file becomes ``<|endoftext|>`` + its tokens. Used by ``scripts/train_tiny.py``
and by the accept-length notebook (its held-out prompts).
"""

from __future__ import annotations

import json
import sys
import sysconfig
import zlib
from pathlib import Path

import numpy as np

EOS = "<|endoftext|>"
SPECIAL_TOKENS = (EOS, "<|im_start|>", "<|im_end|>")
VALIDATION_BUCKETS = 20


def stdlib_root() -> Path:
    """The running interpreter's standard-library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[str]:
    """Sorted relative paths of every stdlib ``.py`` file, site-packages excluded."""
    root = stdlib_root() if root is None else root
    paths = (p.relative_to(root).as_posix() for p in root.rglob("*.py"))
    return sorted(p for p in paths if not p.startswith(("site-packages/", "dist-packages/")))


def is_validation_file(relative_path: str) -> bool:
    """Held out for validation: ``crc32(path) % 20 == 0`` (about 5 % of files)."""
    return zlib.crc32(relative_path.encode()) % VALIDATION_BUCKETS == 0


def read_source(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE with the special tokens first (``<|endoftext|>`` = 0), which the
    post-processor puts in front of every encoded text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    eos_id = tokenizer.token_to_id(EOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{EOS} $A", special_tokens=[(EOS, eos_id)]
    )
    return tokenizer


def encode(tokenizer, texts: list[str]) -> np.ndarray:
    return np.concatenate([np.asarray(e.ids, np.uint16) for e in tokenizer.encode_batch(texts)])


def prepare(vocab_size: int) -> tuple[np.ndarray, dict]:
    """Train the tokenizer and encode the corpus: (token stream train + val, metadata)."""
    root = stdlib_root()
    files = stdlib_files(root)
    train = [f for f in files if not is_validation_file(f)]
    val = [f for f in files if is_validation_file(f)]
    train_texts = [read_source(root / f) for f in train]
    val_texts = [read_source(root / f) for f in val]
    tokenizer = train_tokenizer(train_texts, vocab_size)
    train_ids, val_ids = encode(tokenizer, train_texts), encode(tokenizer, val_texts)
    meta = {
        "python": sys.version.split()[0],
        "stdlib": str(root),
        "num_train_files": len(train),
        "num_val_files": len(val),
        "num_train_tokens": int(train_ids.size),
        "num_val_tokens": int(val_ids.size),
        "val_files": val,
        "train_bytes": sum(len(t.encode()) for t in train_texts),
        "tokenizer": tokenizer.to_str(),
    }
    return np.concatenate([train_ids, val_ids]), meta


def save_data(path: Path, tokens: np.ndarray, meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, tokens)
    path.with_suffix(".json").write_text(json.dumps(meta))


def load_data(path: Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """(train tokens, val tokens, metadata) of a ``--prepare-only`` data file."""
    from tokenizers import Tokenizer

    meta_path = path.with_suffix(".json")
    if not path.is_file() or not meta_path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} or its {meta_path.name} is missing")
    tokens = np.load(path)
    meta = json.loads(meta_path.read_text())
    meta["tokenizer_object"] = Tokenizer.from_str(meta["tokenizer"])
    split = meta["num_train_tokens"]
    return tokens[:split], tokens[split:], meta
