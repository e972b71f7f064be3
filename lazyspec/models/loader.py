"""Reading a local Hugging Face model folder: config, safetensors (single or sharded), tokenizer.

Tensors are read one at a time from memory-mapped files, cast, and handed to the family's
parameter builder, so a checkpoint is never held twice in host memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so bf16 tensors can be read)
import numpy as np
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class SafetensorsReader:
    """Name -> tensor access over every safetensors file in a model folder."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self._file_of: dict[str, Path] = {}
        index = self.folder / INDEX_FILE
        if index.is_file():
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            for name, file_name in weight_map.items():
                self._file_of[name] = self.folder / file_name
        else:
            files = sorted(self.folder.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {str(self.folder)!r}")
            for path in files:
                with safe_open(str(path), framework="np") as f:
                    for name in f.keys():
                        self._file_of[name] = path
        self._handles: dict[Path, object] = {}

    def names(self) -> list[str]:
        return sorted(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def _handle(self, path: Path):
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="np")
        return self._handles[path]

    def get(self, name: str, shape: tuple[int, ...] | None = None, dtype=np.float32) -> np.ndarray:
        """Return tensor ``name`` cast to ``dtype``; check ``shape`` when given."""
        if name not in self._file_of:
            raise KeyError(f"checkpoint has no tensor {name!r} (folder {str(self.folder)!r})")
        array = self._handle(self._file_of[name]).get_tensor(name)
        if shape is not None and tuple(array.shape) != tuple(shape):
            raise ValueError(
                f"tensor {name!r} has shape {tuple(array.shape)}, expected {tuple(shape)}"
            )
        return np.asarray(array, dtype=dtype) if dtype is not None else array

    def shape(self, name: str) -> tuple[int, ...]:
        """Tensor ``name``'s shape in the file, read from its header only."""
        if name not in self._file_of:
            raise KeyError(f"checkpoint has no tensor {name!r} (folder {str(self.folder)!r})")
        return tuple(self._handle(self._file_of[name]).get_slice(name).get_shape())

    def get_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """``tensor[index]`` in the file's dtype, reading only those elements' pages."""
        if name not in self._file_of:
            raise KeyError(f"checkpoint has no tensor {name!r} (folder {str(self.folder)!r})")
        return self._handle(self._file_of[name]).get_slice(name)[index]

    def iter_prefix(self, prefix: str) -> Iterator[str]:
        return (n for n in self.names() if n.startswith(prefix))


def load_tokenizer(folder: str | Path):
    """The model's tokenizer from ``tokenizer.json`` (tokenizers' fast tokenizer), or None."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))
